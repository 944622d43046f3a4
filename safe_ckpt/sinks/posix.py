"""POSIX sink: positional vectored writes (`pwritev`) and `fsync` on a local or shared
filesystem, optionally handing written runs to the kernel's writeback early
(`sync_file_range`). One job: bytes to files at offsets, durably. Must not: know about
tensors.
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Sequence

from .base import Buffer

_MAX_WRITE_BYTES = 0x7FFFF000  # Linux caps one write call at this many bytes
_MAX_IOV = 1024  # IOV_MAX

# Once a file has this many contiguous bytes written and not yet handed to the kernel's
# writeback, ask it to start writing them (`sync_file_range(SYNC_FILE_RANGE_WRITE)`, which
# does not wait for them to land). The hypothesis it was built to test: on a host with
# plenty of memory a whole save can stay dirty in the page cache (under the kernel's
# background-writeback threshold) and the disk idle until the final `fsync`. 0 leaves
# everything to `fsync`. Only for files that are fsynced.
# Off: on the H200 host (ext4 on a virtio disk, 125 GiB RAM), every 32 MiB, neither the
# write ceiling (3.81-5.08 s without, 4.08-5.31 s with) nor a save's time-to-durable moved
# beyond the disk's drift, and with the default 2 GiB pool an async save stalled 2.96-4.03 s
# against 0.36-0.43 s: the writers, which free the pool, spent that long in the call, most
# likely waiting for the device to take the pages (not traced; the `*_pool2048m_wb32_trace`
# diag case would show it) (diagnostics_2026-12-01_02.txt, section
# h200_diag_ttd_anchor_disk_writeback_pythread_2026-12-01.txt).
EARLY_WRITEBACK_BYTES = 0
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


def _advance(buffers: list[memoryview], n: int) -> list[memoryview]:
    while n and buffers:
        if n >= len(buffers[0]):
            n -= len(buffers[0])
            buffers.pop(0)
        else:
            buffers[0] = buffers[0][n:]
            n = 0
    return buffers


def pwrite_all(fd: int, offset_bytes: int, buffers: Sequence[Buffer]) -> int:
    """Write every buffer back to back at ``offset_bytes``; retries short writes."""
    pending = [memoryview(b).cast("B") for b in buffers if len(b)]
    written = 0
    while pending:
        batch, batch_bytes = [], 0
        for b in pending:
            if len(batch) == _MAX_IOV:
                break
            if batch_bytes + len(b) > _MAX_WRITE_BYTES:
                if not batch:
                    batch.append(b[:_MAX_WRITE_BYTES])
                break
            batch.append(b)
            batch_bytes += len(b)
        n = os.pwritev(fd, batch, offset_bytes + written)
        if n <= 0:
            raise OSError(f"pwritev wrote {n} bytes")
        written += n
        pending = _advance(pending, n)
    return written


def fsync_path(path: str, directory: bool = False) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


class PosixFile:
    def __init__(self, path: str, fsync: bool) -> None:
        self.path = path
        self._fsync = fsync
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self.writeback = (EarlyWriteback(self._fd, path, EARLY_WRITEBACK_BYTES)
                          if fsync and EARLY_WRITEBACK_BYTES > 0 else None)

    def write_at(self, offset_bytes: int, buffers: Sequence[Buffer]) -> None:
        written = pwrite_all(self._fd, offset_bytes, buffers)
        if self.writeback is not None:
            self.writeback.wrote(offset_bytes, written)

    def sync(self) -> None:
        if self._fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


class PosixSink:
    """Files under ``root``, which must exist: it is never created here, so a root removed
    while a save writes (by hand, or by a cleanup that took it for a dead save's) fails the
    next open with an error that says so, instead of being quietly made again and half filled.
    Subdirectories below the root are created as needed."""

    def __init__(self, root: str, fsync: bool = True) -> None:
        self.root = root
        self.fsync = fsync

    def _gone(self) -> OSError:
        return FileNotFoundError(errno.ENOENT, f"the directory {self.root} this save writes into is gone (removed "
                                 "while the save was writing); not making it again", self.root)

    def _path(self, relative_path: str) -> str:
        path = os.path.join(self.root, relative_path)
        below = os.path.relpath(os.path.dirname(path), self.root)
        current = self.root
        for part in [] if below == os.curdir else below.split(os.sep):
            current = os.path.join(current, part)
            try:
                os.mkdir(current)  # fails (ENOENT) rather than make the root again
            except FileExistsError:
                pass
            except FileNotFoundError:
                raise self._gone() from None
        return path

    def _file(self, relative_path: str) -> PosixFile:
        try:
            return PosixFile(self._path(relative_path), self.fsync)
        except FileNotFoundError:
            if not os.path.isdir(self.root):
                raise self._gone() from None
            raise

    def open(self, relative_path: str, size_bytes: int) -> PosixFile:
        return self._file(relative_path)

    def write_file(self, relative_path: str, data: bytes) -> None:
        f = self._file(relative_path)
        try:
            f.write_at(0, [data])
            f.sync()
        finally:
            f.close()

    def sync_root(self) -> None:
        if self.fsync:
            fsync_path(self.root, directory=True)

    # ---- used by tools and tests (the same calls the kvstore sink offers) ----------------
    def list(self) -> list[str]:
        return sorted(n for n in os.listdir(self.root) if os.path.isfile(os.path.join(self.root, n)))

    def read(self, relative_path: str) -> bytes:
        with open(os.path.join(self.root, relative_path), "rb") as f:
            return f.read()

    def delete(self, relative_path: str) -> None:
        os.unlink(os.path.join(self.root, relative_path))
