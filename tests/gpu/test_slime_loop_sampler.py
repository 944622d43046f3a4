"""The slime-loop bench's instruments on the GPU, as a control for the zeros it reports: the
sampler reads a 1 GiB allocation made in another thread (as a save's threads would make one)
both by torch's count and by NVML, the rollout stand-in's memory is not counted, and the CUDA
stand-in takes and gives back its share of the free memory rollout after rollout.
Marked `gpu` (skipped without CUDA, tests/conftest.py)."""

import os
import sys
import threading

import pytest

from tests.helpers.paths import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))

pytestmark = pytest.mark.gpu

GIB = 1 << 30


def test_the_sampler_sees_an_allocation_beside_a_rollout_but_not_the_rollout():
    import torch

    from rollout_engine import GpuPeak, RolloutEngine

    torch.cuda.init()
    engine = RolloutEngine(device="cuda")
    try:
        peak = GpuPeak()
        free_before = torch.cuda.mem_get_info()[0]
        held = {}
        allocated = threading.Event()

        def allocate():  # a save's thread allocating 1 GiB on the device while the rollout runs
            held["t"] = torch.empty(GIB, dtype=torch.uint8, device="cuda")
            held["t"].fill_(1)
            torch.cuda.synchronize()
            allocated.set()

        def during():
            worker = threading.Thread(target=allocate)
            worker.start()
            worker.join()
            assert allocated.is_set()
            peak.sample()  # at least one reading while the 1 GiB and the rollout are both held
            return torch.cuda.mem_get_info()[0]

        peak.start()
        r = engine.rollout(0.0, peak, share=0.5, during=during)
        del held["t"]
        torch.cuda.empty_cache()
        extra = peak.stop()
        print(f"sampler control: 1 GiB allocated beside a rollout of {r['rollout_bytes'] / GIB:.1f} GiB "
              f"(taken in {r['rollout_take_s']:.3f} s): torch's count {peak.torch_extra_bytes / GIB:.3f} GiB, "
              f"NVML less the rollout {extra / GIB:.3f} GiB")
        assert r["rollout_bytes"] >= int(0.5 * (free_before - 2 * GIB))  # the stand-in took its share
        assert r["during"] < free_before - r["rollout_bytes"]  # and held it while the allocation was there
        assert peak.torch_extra_bytes == GIB
        assert GIB <= extra < GIB + (256 << 20)  # the allocation (and its allocator rounding), no rollout bytes
        for _ in range(3):  # the stand-in gives its memory back after each rollout
            engine.rollout(0.0)
            assert torch.cuda.mem_get_info()[0] > free_before - (512 << 20)
    finally:
        engine.close()
