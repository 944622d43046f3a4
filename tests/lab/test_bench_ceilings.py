"""The bench's write ceiling: the thread counts it measures include one writer per core."""


def test_write_ceiling_thread_counts_include_one_writer_per_core(monkeypatch):
    from safe_ckpt_lab.bench import ceilings

    monkeypatch.setattr(ceilings.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert ceilings.thread_counts(8) == [8, 16] and ceilings.thread_counts(16) == [16]
    monkeypatch.setattr(ceilings.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert ceilings.thread_counts(8) == [8, 32]
