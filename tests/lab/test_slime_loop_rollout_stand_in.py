"""The slime-loop bench's rollout stand-in, run on the CPU, and its GPU-memory sampler with NVML
and torch's counters replaced by fakes: the stand-in stays up between rollouts, answers rollouts
of no length (its two replies then arrive together), ignores a "stop" that comes after its
rollout ended, ends a rollout when the work beside it does, and a stand-in that died is reported
with its exit status instead of hanging the bench; the sampler counts neither the rollout's
memory nor anything while paused, and counts the rest."""

import os
import sys
import types

import pytest

from tests.helpers.paths import BENCHMARKS

sys.path.insert(0, BENCHMARKS)

from rollout_engine import GpuPeak, RolloutEngine  # noqa: E402

SHARE_BYTES = int((64 << 20) * 0.8)  # the CPU stand-in's "free memory" is 64 MiB


@pytest.fixture
def engine():
    e = RolloutEngine(device="cpu", start_timeout_s=120)
    yield e
    e.close()


def test_one_process_serves_every_rollout_even_of_no_length(engine):
    pid = engine.proc.pid
    rows = [engine.rollout(0.0) for _ in range(20)] + [engine.rollout(0.05)]
    assert engine.proc.pid == pid and engine.proc.poll() is None
    assert all(r["rollout_bytes"] == SHARE_BYTES and r["sampler_paused_s"] == 0.0 for r in rows)
    assert rows[-1]["matmuls"] > 0 and rows[-1]["rollout_s"] >= 0.05


# A child that answers each "go" with both of its replies in one write: they reach the parent
# together, as a rollout of no length's do when the parent is slow to read.
BOTH_AT_ONCE = r"""
import os, sys
print("up", flush=True)
for line in sys.stdin:
    if line.startswith("go"):
        os.write(1, b"ready 7\ndone 3\n")
    elif line.startswith("quit"):
        break
"""


def test_replies_that_arrive_together_are_both_read():
    e = RolloutEngine(device="cpu", start_timeout_s=60, program=BOTH_AT_ONCE)
    try:
        for _ in range(3):
            r = e.rollout(0.0)
            assert (r["rollout_bytes"], r["matmuls"]) == (7, 3)
    finally:
        e.close()


def test_a_stop_after_the_rollout_ended_is_ignored(engine):
    engine.rollout(0.01)
    engine._send("stop")
    assert engine.rollout(0.01)["rollout_bytes"] == SHARE_BYTES
    assert engine.proc.poll() is None


def test_work_beside_a_rollout_ends_it(engine):
    seen = []
    r = engine.rollout(0.0, during=lambda: seen.append(engine.proc.poll()) or "measured")
    assert r["during"] == "measured" and seen == [None]  # ran while the stand-in was up and holding memory
    assert engine.rollout(0.01)["rollout_bytes"] == SHARE_BYTES  # and it is ready for the next one


def test_work_beside_a_rollout_that_fails_leaves_the_stand_in_ready(engine):
    def fails():
        raise ValueError("the ceiling failed")

    with pytest.raises(ValueError, match="the ceiling failed"):
        engine.rollout(0.0, during=fails)
    assert engine.rollout(0.01)["rollout_bytes"] == SHARE_BYTES  # its "done" did not answer this "go"


def test_a_blank_line_during_a_rollout_ends_it_without_harm(engine):
    r = engine.rollout(0.0, during=lambda: engine._send(""))
    assert r["rollout_bytes"] == SHARE_BYTES
    assert engine.rollout(0.01)["rollout_bytes"] == SHARE_BYTES and engine.proc.poll() is None


SILENT_AFTER_UP = r"""
import sys
print("up", flush=True)
for line in sys.stdin:
    pass
"""


def test_a_stand_in_that_does_not_answer_is_killed_and_reported():
    e = RolloutEngine(device="cpu", start_timeout_s=60, program=SILENT_AFTER_UP, reply_timeout_s=1.0)
    try:
        with pytest.raises(RuntimeError, match=r"did not say 'ready' within 1 s \(killed, exit -9\)"):
            e.rollout(0.0)
    finally:
        e.close()


def test_a_stand_in_dead_before_a_rollout_is_reported_with_its_exit(engine):
    engine.proc.kill()
    with pytest.raises(RuntimeError, match=r"gone \(exit -9\)"):
        engine.rollout(0.05)


def test_a_stand_in_dying_during_a_rollout_is_reported_with_its_exit(engine):
    with pytest.raises(RuntimeError, match=r"gone \(exit -9\)"):
        engine.rollout(0.0, during=lambda: (engine.proc.kill(), engine.proc.wait()))


class FakeNvml(types.ModuleType):
    def __init__(self):
        super().__init__("pynvml")
        self.used = 1000

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=self.used)


@pytest.fixture
def fake_gpu(monkeypatch):
    import torch

    nvml = FakeNvml()
    allocated = {"now": 50, "peak": 50}
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: allocated.update(peak=allocated["now"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: allocated["peak"])
    return nvml, allocated


def test_the_sampler_counts_the_save_not_the_rollout(fake_gpu):
    nvml, allocated = fake_gpu
    peak = GpuPeak().start(sampling=False)
    peak.paused = True  # the rollout takes its memory: not known yet, not sampled
    nvml.used = 1000 + 700
    peak.sample()
    peak.discount_bytes, peak.paused = 700, False  # taken: discounted from now on
    peak.sample()
    assert peak.peak_bytes == 1000
    nvml.used = 1000 + 700 + 30  # the save's own 30 bytes beside the rollout
    peak.sample()
    nvml.used, peak.discount_bytes = 1000, 0  # the rollout gave its memory back
    peak.sample()
    allocated["peak"] = 50 + 8  # 8 bytes allocated through torch during the save
    assert peak.stop() == 30
    assert peak.torch_extra_bytes == 8


def test_a_rollout_pauses_then_discounts_the_sampler(fake_gpu, engine):
    nvml, _ = fake_gpu
    peak = GpuPeak().start(sampling=False)
    seen = []

    def during():  # the fake device grows by the rollout's memory once it is taken
        seen.append((peak.paused, peak.discount_bytes))
        return None

    nvml_used = nvml.used
    real_send = engine._send

    def send(line):
        seen.append(("sent", line.split()[0], peak.paused))
        real_send(line)
        if line.startswith("go"):
            nvml.used = nvml_used + SHARE_BYTES  # what the device would show once the memory is taken
    engine._send = send
    r = engine.rollout(0.0, peak, during=during)
    assert seen == [("sent", "go", True),  # paused from the request: the stand-in's size is not known yet
                    (False, SHARE_BYTES),  # sampling again, the rollout's bytes discounted
                    ("sent", "stop", False)]
    assert r["sampler_paused_s"] == r["rollout_take_s"] > 0
    assert peak.discount_bytes == 0 and not peak.paused  # both put back once the rollout is done
    assert peak.stop() == 0
