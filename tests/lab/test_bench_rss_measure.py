"""The bench's peak-RSS measure: exact from the kernel's high-water mark where it can be reset,
with no thread of its own beside the save; sampled otherwise."""

import mmap
import sys
import threading
import time

import pytest

from safe_ckpt_lab.bench.measure import RssPeak

MiB = 1 << 20


def _touch(nbytes: int) -> mmap.mmap:
    """``nbytes`` of fresh resident memory: its own mapping, since heap memory earlier tests freed
    may already be resident (a raised mmap threshold keeps large blocks in the heap)."""
    block = mmap.mmap(-1, nbytes)
    for i in range(0, nbytes, 4096):  # resident only once written
        block[i] = 1
    return block


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_a_short_peak_is_seen_exactly_and_no_thread_runs_beside_the_call():
    # an earlier, larger peak: a reset that did nothing would report it instead
    _touch(256 * MiB)  # freed at once
    before = threading.active_count()
    with RssPeak(period_s=10.0) as rss:  # a sampler this slow would see nothing
        assert threading.active_count() == before
        status = RssPeak._status()
        assert status["VmHWM"] - status["VmRSS"] < 16 * MiB  # the reset took
        block = _touch(128 * MiB)
        del block
    assert not rss.sampled
    assert 120 * MiB <= rss.extra_bytes < 200 * MiB, rss.extra_bytes


def test_an_ignored_reset_falls_back_to_sampling(monkeypatch):
    """A /proc that accepts the write and keeps the old peak must not pass the lifetime peak
    off as this call's."""
    monkeypatch.setattr(RssPeak, "_status", staticmethod(lambda: {"VmHWM": 900 * MiB, "VmRSS": 100 * MiB}))
    assert RssPeak._reset_high_water() is False


def test_without_the_high_water_mark_it_samples(monkeypatch):
    monkeypatch.setattr(RssPeak, "_reset_high_water", staticmethod(lambda: False))
    with RssPeak(period_s=0.001) as rss:
        block = _touch(128 * MiB)
        deadline = time.monotonic() + 10  # the sampler thread may wait for a core on a busy machine
        while rss.peak - rss.base < 120 * MiB and time.monotonic() < deadline:
            time.sleep(0.005)
        del block
    assert rss.sampled
    assert rss.extra_bytes >= 120 * MiB, rss.extra_bytes
