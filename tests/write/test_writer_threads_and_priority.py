"""Writer threads run nicer than the thread that saves (`cpu.WRITER_NICE_INCREMENT`):
the thread that issues device copies, and a training loop beside an async save, get the
cores first. The caller's own priority never changes: a thread cannot get it back."""

import os
import sys
import threading

import pytest

import safe_ckpt
from safe_ckpt.host import cpu
from safe_ckpt.write import pipeline
from tests.save.test_index_built_while_writers_write import _load, _state

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
    if before + increment > 19:
        pytest.skip(f"the test process already runs at nice {before}")
    options = safe_ckpt.SaveOptions(io_threads=3)
    if mode == "sync":
        safe_ckpt.save(state, tmp_path / "ck", options=options)
    else:
        safe_ckpt.async_save(state, tmp_path / "ck", options=options).wait(timeout=60)
    assert _priority() == before
    assert len(seen) == 3 and all(name.startswith("safe_ckpt-write") for name, _ in seen), seen
    assert {p for _, p in seen} == {min(19, before + increment)}, seen
    assert _load(tmp_path / "ck", tensors)


@pytest.mark.parametrize("start, expected", [(18, 19), (19, 19), (0, 5)])
def test_the_priority_is_capped_at_the_lowest(monkeypatch, start, expected):
    calls = []
    monkeypatch.setattr(os, "getpriority", lambda which, who: start)
    monkeypatch.setattr(os, "setpriority", lambda which, who, value: calls.append((who, value)))
    ids = []

    def run():
        ids.append(threading.get_native_id())
        cpu.lower_thread_priority(5)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert calls == [(ids[0], expected)]  # the calling thread's own id, never the process's


def test_a_refused_priority_change_is_not_an_error(monkeypatch):
    calls = []

    def refuse(*a):
        calls.append(a)
        raise PermissionError("not allowed")

    monkeypatch.setattr(os, "setpriority", refuse)
    cpu.lower_thread_priority(5)  # logs at debug level and returns
    assert len(calls) == 1


def test_no_writer_thread_started_the_caller_writes_at_its_own_priority(tmp_path, monkeypatch):
    """Where no writer thread can start, `join` drains the staged items on the caller's thread:
    that must not make the caller (a training loop) nicer for good."""
    monkeypatch.setattr(cpu, "WRITER_NICE_INCREMENT", 3)
    start = threading.Thread.start

    def refuse_writers(self):
        if self.name.startswith("safe_ckpt-write"):
            raise RuntimeError("can't start new thread")
        return start(self)

    monkeypatch.setattr(threading.Thread, "start", refuse_writers)
    seen, loop = [], pipeline.RankWriter._write_loop

    def recording(self):
        seen.append((threading.get_native_id(), _priority()))
        return loop(self)

    monkeypatch.setattr(pipeline.RankWriter, "_write_loop", recording)
    _, state = _state(6)
    before, me = _priority(), threading.get_native_id()
    with pytest.raises(safe_ckpt.CheckpointError, match="can't start new thread"):
        safe_ckpt.save(state, tmp_path / "ck", options=safe_ckpt.SaveOptions(io_threads=2))
    assert seen == [(me, before)]
    assert _priority() == before
    assert not (tmp_path / "ck").exists()


def test_the_save_option_overrides_the_default_and_is_validated(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "WRITER_NICE_INCREMENT", 3)
    seen, loop = [], pipeline.RankWriter._write_loop

    def recording(self):
        seen.append(_priority())
        return loop(self)

    monkeypatch.setattr(pipeline.RankWriter, "_write_loop", recording)
    tensors, state = _state(5)
    before = _priority()
    if before + 2 > 19:
        pytest.skip(f"the test process already runs at nice {before}")
    safe_ckpt.save(state, tmp_path / "ck", options=safe_ckpt.SaveOptions(io_threads=2, writer_nice=2))
    assert seen == [before + 2] * 2 and _priority() == before
    assert _load(tmp_path / "ck", tensors)
    seen.clear()
    safe_ckpt.save(state, tmp_path / "ck0", options=safe_ckpt.SaveOptions(io_threads=2, writer_nice=0))
    assert seen == [before] * 2
    for bad in (-1, 20, 1.5, True, "5"):
        with pytest.raises(safe_ckpt.ValidationError, match=f"writer_nice={bad!r}"):
            safe_ckpt.SaveOptions(writer_nice=bad)


def test_a_writer_whose_priority_cannot_be_set_still_writes(tmp_path, monkeypatch):
    def broken(increment):
        raise TypeError("not a number")

    monkeypatch.setattr(pipeline, "lower_thread_priority", broken)
    tensors, state = _state(5)
    safe_ckpt.save(state, tmp_path / "ck", options=safe_ckpt.SaveOptions(io_threads=3))
    assert _load(tmp_path / "ck", tensors)


def test_files_never_finished_fail_the_save_and_publish_nothing(tmp_path, monkeypatch):
    """A writer that vanished without an error (the files' ends never reached) must not let the
    save report success over missing data files."""
    monkeypatch.setattr(pipeline.RankWriter, "_finish_file", lambda self, index: None)
    _, state = _state(5)
    with pytest.raises(safe_ckpt.CheckpointError, match="data files were never finished"):
        safe_ckpt.save(state, tmp_path / "ck", options=safe_ckpt.SaveOptions(io_threads=2))
    assert not (tmp_path / "ck").exists()


def test_slime_flag_reaches_the_option():
    import argparse

    from safe_ckpt.integrations import slime
    from safe_ckpt.megatron.training import options_from_args

    parser = slime.add_arguments(argparse.ArgumentParser())
    assert options_from_args(parser.parse_args(["--safe-ckpt-writer-nice", "7"])).writer_nice == 7
    assert options_from_args(parser.parse_args([])).writer_nice is None
