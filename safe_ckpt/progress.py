"""Progress of a long save: periodic log lines (bytes, rate, ETA) and a summary line.

One job: count bytes from any thread and log at most once per interval, and word the line
that sums up a finished save. Must not: block writers (logging happens in whichever thread
crosses the interval).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

log = logging.getLogger("safe_ckpt")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


class Progress:
    def __init__(self, total_bytes: int, rank: int, interval_s: float,
                 callback: Optional[Callable[[int, int], None]] = None) -> None:
        self.total_bytes = total_bytes
        self.rank = rank
        self.interval_s = interval_s
        self.callback = callback
        self.done_bytes = 0
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._last_log = self._start

    def add(self, n: int) -> None:
        with self._lock:
            self.done_bytes += n
            now = time.monotonic()
            due = self.interval_s and now - self._last_log >= self.interval_s
            if due:
                self._last_log = now
            done = self.done_bytes
        if self.callback is not None:
            self.callback(done, self.total_bytes)
        if due:
            elapsed = now - self._start
            rate = done / elapsed if elapsed > 0 else 0.0
            eta = (self.total_bytes - done) / rate if rate > 0 else float("inf")
            log.info(
                "safe_ckpt: rank %d wrote %s of %s (%.0f%%) at %.2f GB/s, ETA %.1f s",
                self.rank, human_bytes(done), human_bytes(self.total_bytes),
                100.0 * done / max(1, self.total_bytes), rate / 1e9, eta,
            )


def log_saved(r) -> None:
    """The summary line of a finished save (a `SaveResult`): at INFO on rank 0, DEBUG elsewhere."""
    t = r.timings
    level = logging.INFO if r.rank == 0 else logging.DEBUG
    log.log(
        level,
        "safe_ckpt: saved %s: %s on %d rank(s) in %.2f s (%.2f GB/s), stall %.2f s; rank %d: %s",
        r.checkpoint_dir, human_bytes(r.total_file_bytes), r.world_size, t.total_s,
        r.throughput_bytes_per_s / 1e9, t.stall_s, r.rank,
        ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(r.bytes_by_residence.items())) or "nothing",
    )
