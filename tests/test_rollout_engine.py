"""The slime-loop bench's rollout stand-in, run on the CPU: it stays up between rollouts, a
rollout with work beside it ends when that work does (not at its time limit), and a stand-in
that died is reported as such, with its exit status, instead of hanging the bench."""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from rollout_engine import RolloutEngine  # noqa: E402


@pytest.fixture
def engine():
    e = RolloutEngine(device="cpu", start_timeout_s=120)
    yield e
    e.close()


def test_one_process_serves_every_rollout(engine):
    pid = engine.proc.pid
    first = engine.rollout(0.05)
    second = engine.rollout(0.05)
    assert engine.proc.pid == pid and engine.proc.poll() is None
    for r in (first, second):
        assert r["rollout_bytes"] == int((64 << 20) * 0.8)
        assert r["matmuls"] > 0 and r["rollout_s"] >= 0.05
        assert r["sampler_paused_s"] == 0.0  # no sampler given: nothing paused


def test_work_beside_a_rollout_ends_it(engine):
    seen = []
    r = engine.rollout(0.0, during=lambda: seen.append(engine.proc.poll()) or "measured")
    assert r["during"] == "measured" and seen == [None]  # ran while the stand-in was up and holding memory
    assert r["rollout_s"] < 600  # stopped by the request, not by its hour-long limit
    assert engine.rollout(0.01)["matmuls"] > 0  # and ready for the next one


def test_a_dead_stand_in_is_reported_not_waited_for(engine):
    engine.proc.kill()
    engine.proc.wait()
    with pytest.raises(RuntimeError, match="rollout stand-in"):
        engine.rollout(0.05)
