"""Progress of a long save: periodic log lines (bytes, rate, ETA) and a summary line.

One job: count bytes from any thread and log at most once per interval, word the line that
sums up a finished save, and (`show_progress`) put the "safe_ckpt" logger's lines on a
terminal for a script that configured no logging. Must not: block writers (logging happens
in whichever thread crosses the interval).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import sys
import time
from typing import Callable, Iterator, Optional, TextIO

from ..units import human_bytes

log = logging.getLogger("safe_ckpt")


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
                "rank %d wrote %s of %s (%.0f%%) at %s/s, ETA %.1f s",
                self.rank, human_bytes(done), human_bytes(self.total_bytes),
                100.0 * done / max(1, self.total_bytes), human_bytes(rate), eta,
            )


def log_saved(r) -> None:
    """The summary line of a finished save (a `SaveResult`): at INFO on rank 0, DEBUG elsewhere."""
    t = r.timings
    level = logging.INFO if r.rank == 0 else logging.DEBUG
    log.log(
        level,
        "saved %s: %s on %d rank(s) in %.2f s (%s/s), stall %.2f s; rank %d: %s",
        r.checkpoint_dir, human_bytes(r.total_file_bytes), r.world_size, t.total_s,
        human_bytes(r.throughput_bytes_per_s), t.stall_s, r.rank,
        ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(r.bytes_by_residence.items())) or "nothing",
    )


class LineFormatter(logging.Formatter):
    """``12:00:01 safe_ckpt: message``; the level is named only when it is not INFO."""

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno == logging.INFO else f" {record.levelname}"
        line = f"{self.formatTime(record, '%H:%M:%S')} safe_ckpt{level}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _ProgressHandler(logging.StreamHandler):
    """The handler `show_progress` attaches; its type is how a second call finds it."""


def show_progress(stream: Optional[TextIO] = None) -> logging.Handler:
    """Show safe_ckpt's progress lines and save summaries (INFO and above) on ``stream``
    (default: stderr), for a script that configured no logging. Idempotent: a second call
    returns the handler the first attached (pointing it at ``stream`` if one is given).

    The "safe_ckpt" logger is set to INFO and stops passing its records to the root logger,
    so each line appears once; a script that configures logging itself at INFO
    (`logging.basicConfig(level=logging.INFO)`) sees the same lines without this call.
    Undo with ``logging.getLogger("safe_ckpt").removeHandler(handler)`` and ``propagate = True``.
    """
    handler = next((h for h in log.handlers if isinstance(h, _ProgressHandler)), None)
    if handler is None:
        handler = _ProgressHandler(stream if stream is not None else sys.stderr)
        handler.setFormatter(LineFormatter())
        log.addHandler(handler)
    elif stream is not None:
        handler.setStream(stream)
    if log.level == logging.NOTSET or log.level > logging.INFO:
        log.setLevel(logging.INFO)
    log.propagate = False
    return handler


@contextlib.contextmanager
def progress_lines(stream: Optional[TextIO] = None, level: int = logging.INFO) -> Iterator[None]:
    """`show_progress` for the length of a block (a command-line command, which may run inside
    another program), at ``level``; the logger is as it was afterwards. Where `show_progress` is
    already in effect its handler prints them, and only the level changes."""
    shown = any(isinstance(h, _ProgressHandler) for h in log.handlers)
    before = log.level, log.propagate
    handler = None
    if not shown:
        handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
        handler.setFormatter(LineFormatter())
        log.addHandler(handler)
        log.propagate = False
    if log.level == logging.NOTSET or log.level > level:
        log.setLevel(level)
    try:
        yield
    finally:
        if handler is not None:
            log.removeHandler(handler)
        log.setLevel(before[0])
        log.propagate = before[1]
