"""A sink wrapper that fails on purpose: for tests and soak runs of the failure paths.

One job: pass writes through to an inner sink until a configured point, then raise the
configured `OSError` (ENOSPC, EIO, ...) or stall. Must not: be used for real saves.
"""

from __future__ import annotations

import errno as errno_codes
import os
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from .base import Buffer, Sink, SinkFile


@dataclass(frozen=True)
class Fault:
    """When to fail: after ``after_bytes`` bytes of data writes, or at a named step."""

    after_bytes: int | None = None
    on: str | None = None  # "open", "sync", "write_file", "sync_root"
    errno: int = errno_codes.EIO
    stall_s: float = 0.0  # sleep instead of (before) failing, to simulate a hung disk
    delay_s: float = 0.0  # sleep before every data write (a slow disk that does not fail)
    kill_signal: int | None = None  # instead of raising, send this signal to the process (SIGKILL: a crash)


class _Counter:
    def __init__(self) -> None:
        self.bytes = 0
        self.lock = threading.Lock()


class FaultyFile:
    def __init__(self, inner: SinkFile, sink: "FaultySink") -> None:
        self._inner = inner
        self._sink = sink

    def write_at(self, offset_bytes: int, buffers: Sequence[Buffer]) -> None:
        n = sum(len(b) for b in buffers)
        fault = self._sink.fault
        if fault.delay_s:
            time.sleep(fault.delay_s)
        with self._sink.counter.lock:
            before = self._sink.counter.bytes
            self._sink.counter.bytes += n
        if fault.after_bytes is not None and before + n > fault.after_bytes:
            self._sink.trip(f"write of {n} bytes at offset {offset_bytes}")
        self._inner.write_at(offset_bytes, buffers)

    def sync(self) -> None:
        if self._sink.fault.on == "sync":
            self._sink.trip("fsync")
        self._inner.sync()

    def close(self) -> None:
        self._inner.close()


class FaultySink:
    def __init__(self, inner: Sink, fault: Fault) -> None:
        self.inner = inner
        self.root = inner.root
        self.fault = fault
        self.counter = _Counter()

    def trip(self, what: str) -> None:
        if self.fault.kill_signal is not None:
            os.kill(os.getpid(), self.fault.kill_signal)
            time.sleep(60)  # the signal is delivered asynchronously
        if self.fault.stall_s:
            time.sleep(self.fault.stall_s)
        raise OSError(self.fault.errno, f"injected fault during {what}: {os.strerror(self.fault.errno)}")

    def open(self, relative_path: str, size_bytes: int) -> FaultyFile:
        if self.fault.on == "open":
            self.trip(f"open of {relative_path}")
        return FaultyFile(self.inner.open(relative_path, size_bytes), self)

    def write_file(self, relative_path: str, data: bytes) -> None:
        if self.fault.on == "write_file":
            self.trip(f"write of {relative_path}")
        self.inner.write_file(relative_path, data)

    def sync_root(self) -> None:
        if self.fault.on == "sync_root":
            self.trip("directory fsync")
        self.inner.sync_root()
