"""What a benchmark row records besides time: peak extra RSS, pinned host bytes allocated
by torch during the call, and host-to-device copies seen by the CUDA profiler.
Must not: change what it measures (sampling runs in its own thread).
"""

from __future__ import annotations

import os
import threading
import time

import torch


class RssPeak:
    """Peak resident set size above the value at entry, sampled every ``period_s``."""

    def __init__(self, period_s: float = 0.002) -> None:
        self.period_s = period_s
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self.base = self.peak = 0

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def __enter__(self) -> "RssPeak":
        self.base = self.peak = self.rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.period_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def extra_bytes(self) -> int:
        return max(0, self.peak - self.base)


def host_alloc_bytes() -> int | None:
    """Cumulative bytes torch's pinned host allocator has allocated (None if unknown)."""
    if not torch.cuda.is_available():
        return None
    stats_fn = getattr(torch.cuda.memory, "host_memory_stats", None)
    if stats_fn is None:
        return None
    stats = stats_fn()
    for key in ("allocated_bytes.allocated", "allocated_bytes.all.allocated", "allocated_bytes.total"):
        if key in stats:
            return int(stats[key])
    return None


def host_stats_keys() -> list[str]:
    stats_fn = getattr(torch.cuda.memory, "host_memory_stats", None) if torch.cuda.is_available() else None
    return sorted(stats_fn().keys()) if stats_fn else []


def count_memcpy(fn) -> dict:
    """Run ``fn`` under the CUDA profiler; count HtoD / DtoH memcpy and NCCL kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name or "" for e in prof.events()]
    return {"HtoD": sum("HtoD" in n for n in names), "DtoH": sum("DtoH" in n for n in names),
            "nccl": sum("nccl" in n.lower() for n in names)}
