"""Writer threads run nicer than the thread that saves (`cpu.WRITER_NICE_INCREMENT`):
the thread that issues device copies, and a training loop beside an async save, get the
cores first. The caller's own priority never changes: a thread cannot get it back."""

import os
import sys
import threading

import pytest

import safe_ckpt
from safe_ckpt import cpu, pipeline
from tests.test_commit_prepare import _load, _state

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")


def _priority() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("increment", [0, 3])
def test_writers_run_nicer_and_the_caller_keeps_its_priority(tmp_path, monkeypatch, mode, increment):
    monkeypatch.setattr(cpu, "WRITER_NICE_INCREMENT", increment)
    seen, loop = [], pipeline.RankWriter._write_loop

    def recording(self):
        seen.append((threading.current_thread().name, _priority()))
        return loop(self)

    monkeypatch.setattr(pipeline.RankWriter, "_write_loop", recording)
    tensors, state = _state(5)
    before = _priority()
    options = safe_ckpt.SaveOptions(io_threads=3)
    if mode == "sync":
        safe_ckpt.save(state, tmp_path / "ck", options=options)
    else:
        safe_ckpt.async_save(state, tmp_path / "ck", options=options).wait(timeout=60)
    assert _priority() == before
    assert len(seen) == 3 and all(name.startswith("safe_ckpt-write") for name, _ in seen), seen
    assert {p for _, p in seen} == {min(19, before + increment)}, seen
    assert _load(tmp_path / "ck", tensors)


def test_a_thread_already_at_the_lowest_priority_stays_there(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "getpriority", lambda which, who: 18)
    monkeypatch.setattr(os, "setpriority", lambda which, who, value: calls.append(value))
    t = threading.Thread(target=cpu.lower_thread_priority, args=(5,))
    t.start()
    t.join()
    assert calls == [19]


def test_a_refused_priority_change_is_not_an_error(monkeypatch):
    def refuse(*a):
        raise PermissionError("not allowed")

    monkeypatch.setattr(os, "setpriority", refuse)
    cpu.lower_thread_priority(5)  # logs at debug level and returns
