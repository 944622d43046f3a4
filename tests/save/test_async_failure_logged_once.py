"""A failed `async_save` is reported once: raised to a thread already waiting for it, or, where none
waits, logged as an ERROR when it fails (and at exit, if still nobody looked)."""

import logging
import threading
import time

import pytest
import torch

import safe_ckpt
from safe_ckpt.sinks.faults import Fault, FaultySink
from safe_ckpt.sinks.posix import PosixSink


class _HeldFault(FaultySink):
    """Fails at the first fsync, once the test lets it."""

    go = None

    def trip(self, what: str) -> None:
        assert self.go.wait(60), "the test never let the fault happen"
        super().trip(what)


def _save(path, go):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def factory(d):
        sink = _HeldFault(PosixSink(d), Fault(on="sync"))
        sink.go = go
        return sink

    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(11))
    opts = safe_ckpt.SaveOptions(io_threads=1, progress_interval_s=0, sink_factory=factory)
    return safe_ckpt.async_save({"w": ShardedTensor.from_rank_offsets("w", w)}, str(path), opts)


def _errors(caplog):
    return [r for r in caplog.records if r.levelno >= logging.ERROR and "asynchronous save of" in r.getMessage()]


def test_a_failure_raised_to_a_waiting_thread_is_not_also_logged(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="safe_ckpt")
    go = threading.Event()
    handle = _save(tmp_path / "ck", go)
    raised = []
    waiter = threading.Thread(target=lambda: raised.append(handle.exception()))
    waiter.start()
    deadline = time.monotonic() + 60
    while handle._waiters == 0 and time.monotonic() < deadline:  # the waiter is inside the wait
        time.sleep(0.001)
    assert handle._waiters == 1
    go.set()
    waiter.join(60)
    assert isinstance(raised[0], safe_ckpt.CheckpointError), raised
    assert _errors(caplog) == [], [r.getMessage() for r in _errors(caplog)]


def test_a_failure_nobody_waits_for_is_logged_when_it_happens(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="safe_ckpt")
    go = threading.Event()
    handle = _save(tmp_path / "ck", go)
    go.set()
    assert handle._finished.wait(60)  # nobody in wait() when it failed
    assert len(_errors(caplog)) == 1
    with pytest.raises(safe_ckpt.CheckpointError):
        handle.wait()  # observed: the exit handler has nothing to report
