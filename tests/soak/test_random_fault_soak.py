"""Soak (off by default; `pytest --soak`): 200 consecutive saves with random injected faults.
Nothing committed is ever lost, the tracker always names a checkpoint that verifies and
loads bit-exact, and retention keeps disk use bounded."""

import errno
import os
import random

import pytest
import torch

import safe_ckpt
from safe_ckpt.megatron import save_state
from safe_ckpt.targets.retention import Retention
from safe_ckpt.sinks.faults import Fault, FaultySink
from safe_ckpt.sinks.posix import PosixSink
from safe_ckpt_lab.synthetic import bits_equal
from safe_ckpt.tools.verify import verify

FAULTS = [
    None, None, None,
    {"after_bytes": "random", "errno": errno.ENOSPC},
    {"on": "sync", "errno": errno.EIO},
    {"on": "open", "errno": errno.EACCES},
    {"on": "write_file", "errno": errno.EIO},
    {"on": "sync_root", "errno": errno.EIO},
]


def _state(it):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    g = torch.Generator().manual_seed(it)
    w = torch.randn(64, 512, generator=g)
    return {"w": ShardedTensor.from_rank_offsets("w", w), "iteration": it}, w


@pytest.mark.soak
def test_soak_random_faults(tmp_path):
    rng = random.Random(7)
    root = str(tmp_path)
    last_good, kept, failed = None, {}, 0
    for it in range(1, 201):
        state, w = _state(it)
        choice = rng.choice(FAULTS)
        factory = None
        if choice is not None:
            kw = dict(choice)
            if kw.get("after_bytes") == "random":
                kw["after_bytes"] = rng.randrange(0, 140_000)
            factory = lambda d, f=Fault(**kw): FaultySink(PosixSink(d), f)  # noqa: E731
        opts = safe_ckpt.SaveOptions(chunk_bytes=16 * 1024, io_threads=2, progress_interval_s=0, sink_factory=factory)
        try:
            save_state(state, root, os.path.join(root, f"iter_{it:07d}"), str(it), options=opts,
                       retention=Retention(keep_last=3))
            last_good = it
            kept[it] = w
        except safe_ckpt.CheckpointError:
            assert choice is not None, f"iteration {it} failed without a fault"
            failed += 1
        tracker = open(os.path.join(root, "latest_checkpointed_iteration.txt")).read() if last_good else None
        assert tracker == (str(last_good) if last_good else None)
        iters = sorted(n for n in os.listdir(root) if n.startswith("iter_"))
        assert len(iters) <= 3 and (last_good is None or f"iter_{last_good:07d}" in iters)
        assert not [n for n in os.listdir(root) if ".safe_ckpt-" in n], os.listdir(root)
        if it % 20 == 0 and last_good:
            path = os.path.join(root, f"iter_{last_good:07d}")
            assert verify(path).ok
            import torch.distributed.checkpoint as dcp

            out = {"w": torch.empty(64, 512)}
            dcp.load(out, checkpoint_id=path, no_dist=True)
            assert bits_equal(out["w"], kept[last_good])
    assert 40 < failed < 160, failed  # both paths were exercised many times
