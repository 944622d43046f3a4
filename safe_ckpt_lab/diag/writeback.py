"""Early writeback, kept for diagnostics: hand a file's freshly written bytes to the kernel's
writeback (`sync_file_range(SYNC_FILE_RANGE_WRITE)`, which does not wait for them to land)
in contiguous runs, so the disk works while a save still writes.

One job: the runs, the libc binding, and a sink file (`WritebackFile`) that uses them, for
`benchmarks/diag/diag_ttd.py`'s write-ceiling and save cases. The hypothesis it was built to
test: on a host with plenty of memory a whole save can stay dirty in the page cache and the
disk idle until the final `fsync`. The library leaves writeback to `fsync`: this moved
neither the write ceiling nor a save's time to durable, and stalled an async save whose
writers free the pool (benchmarks/results/HISTORY.md). Must not: be imported by the library.
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Sequence

from safe_ckpt.sinks.base import Buffer
from safe_ckpt.sinks.posix import PosixFile, PosixSink, pwrite_all

_SYNC_FILE_RANGE_WRITE = 2
# errnos that mean "this file or kernel cannot do it", not "the write failed"
_WRITEBACK_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP}


def _load_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):  # not Linux / glibc
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


class EarlyWriteback:
    """Hands a file's freshly written bytes to the kernel's writeback in contiguous runs of
    ``threshold_bytes`` or more, so the disk works while the save still writes. A write that
    does not continue the pending run starts a new one; the shorter run it leaves behind is
    left to `fsync` (writes in any order would otherwise make a call per write). The writes
    of one file come from one thread at a time (the sink's contract), so this keeps no lock.
    A failure to start writeback is raised from the write that asked for it, naming the byte
    range; a file or kernel that cannot do it is left to `fsync`."""

    def __init__(self, fd: int, path: str, threshold_bytes: int) -> None:
        self._fd, self._path, self._threshold_bytes = fd, path, threshold_bytes
        self._start_bytes = self._end_bytes = 0
        self.started_bytes = 0  # handed to writeback so far (for tests and traces)
        self._enabled = _sync_file_range is not None

    def wrote(self, offset_bytes: int, length_bytes: int) -> None:
        if not self._enabled or length_bytes <= 0:
            return
        if offset_bytes != self._end_bytes:
            self._start_bytes = offset_bytes
        self._end_bytes = offset_bytes + length_bytes
        if self._end_bytes - self._start_bytes >= self._threshold_bytes:
            self._start()

    def _start(self) -> None:
        length_bytes = self._end_bytes - self._start_bytes
        if _sync_file_range(self._fd, self._start_bytes, length_bytes, _SYNC_FILE_RANGE_WRITE) != 0:
            code = ctypes.get_errno()
            if code in _WRITEBACK_UNSUPPORTED:
                self._enabled = False
                return
            raise OSError(code, f"starting write-back of bytes {self._start_bytes}-{self._end_bytes}: "
                                f"{os.strerror(code)}", self._path)
        self.started_bytes += length_bytes
        self._start_bytes = self._end_bytes


class WritebackFile(PosixFile):
    """A `PosixFile` that hands its written runs of ``threshold_bytes`` to the kernel's writeback;
    none without fsync (the bytes are not asked to be durable) or at a threshold of 0."""

    def __init__(self, path: str, fsync: bool, threshold_bytes: int) -> None:
        super().__init__(path, fsync)
        self.writeback = (EarlyWriteback(self._fd, path, threshold_bytes)
                          if fsync and threshold_bytes > 0 else None)

    def write_at(self, offset_bytes: int, buffers: Sequence[Buffer]) -> None:
        written = pwrite_all(self._fd, offset_bytes, buffers)
        if self.writeback is not None:
            self.writeback.wrote(offset_bytes, written)


class WritebackSink(PosixSink):
    """A `PosixSink` whose files are `WritebackFile`s (a save's ``sink_factory``)."""

    def __init__(self, root: str, fsync: bool = True, threshold_bytes: int = 32 << 20) -> None:
        super().__init__(root, fsync)
        self.threshold_bytes = threshold_bytes

    def _file(self, relative_path: str) -> PosixFile:
        path = self._path(relative_path)
        try:
            return WritebackFile(path, self.fsync, self.threshold_bytes)
        except FileNotFoundError:
            if not os.path.isdir(self.root):
                raise self._gone() from None
            raise
