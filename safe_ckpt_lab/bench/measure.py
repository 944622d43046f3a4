"""What a benchmark row records besides time: peak extra RSS, pinned host bytes allocated
by torch during the call, and host-to-device copies seen by the CUDA profiler; and how a
buffer is mapped (`mapping_of`: its page size and advice, for the huge-page diagnostic).
Must not: run a thread beside the call where the kernel's peak can be reset (it samples in a
thread of its own only where it cannot), or be nested: the reset is the whole process's, so
an inner measure would erase an outer one's peak.
"""

from __future__ import annotations

import os
import threading
import time

import torch


class RssPeak:
    """Peak resident set size above the value at entry. On Linux the kernel's own high-water
    mark (VmHWM, reset through /proc/self/clear_refs) gives it exactly and costs nothing during
    the call; elsewhere a thread samples it every ``period_s``, which misses short peaks and
    takes a core's turn every period (beside 16 busy writers, the thread that issues an async
    save's device copies is the one that waits)."""

    def __init__(self, period_s: float = 0.002) -> None:
        self.period_s = period_s
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.base = self.peak = 0
        self.sampled = False

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    @staticmethod
    def _reset_high_water() -> bool:
        """Reset the peak and check that it took: a write accepted and ignored (a sandboxed
        /proc) would report the process's lifetime peak as this call's."""
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # 5: reset the peak RSS only (the other values clear page bits)
        except OSError:
            return False
        status = RssPeak._status()
        peak, now = status.get("VmHWM"), status.get("VmRSS")
        return peak is not None and now is not None and peak - now <= 8 * 2**20

    @staticmethod
    def _status() -> dict:
        out = {}
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    if key in ("VmHWM", "VmRSS"):
                        out[key] = int(rest.split()[0]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return out

    @staticmethod
    def _high_water() -> int | None:
        return RssPeak._status().get("VmHWM")

    def __enter__(self) -> "RssPeak":
        self.base = self.peak = self.rss()
        self.sampled = not self._reset_high_water()
        if self.sampled:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.period_s)

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self.peak = max(self.peak, self.rss(), (None if self.sampled else self._high_water()) or 0)

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


def mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding ``address`` (Linux), e.g.
    ``Size`` / ``AnonHugePages`` ("123 kB") and ``VmFlags`` ("rd wr mr mw me ac hg")."""
    fields: dict[str, str] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head, _, rest = line.partition(" ")
            if head.endswith(":"):
                if fields is not None:
                    fields[head[:-1]] = rest.strip()
                continue
            if fields is not None:
                return fields  # the next mapping's header: ours is complete
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= address < hi:
                fields = {}
    if fields is None:
        raise ValueError(f"no mapping of this process holds {address:#x}")
    return fields


def count_memcpy(fn) -> dict:
    """Run ``fn`` under the CUDA profiler; count HtoD / DtoH memcpy and NCCL kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name or "" for e in prof.events()]
    return {"HtoD": sum("HtoD" in n for n in names), "DtoH": sum("DtoH" in n for n in names),
            "nccl": sum("nccl" in n.lower() for n in names)}
