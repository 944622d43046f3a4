"""POSIX sink: positional vectored writes (`pwritev`) and `fsync` on a local or shared
filesystem. One job: bytes to files at offsets, durably. Must not: know about tensors.
"""

from __future__ import annotations

import errno
import os
from typing import Sequence

from .base import Buffer

_MAX_WRITE_BYTES = 0x7FFFF000  # Linux caps one write call at this many bytes
_MAX_IOV = 1024  # IOV_MAX


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


class PosixFile:
    def __init__(self, path: str, fsync: bool) -> None:
        self.path = path
        self._fsync = fsync
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)

    def write_at(self, offset_bytes: int, buffers: Sequence[Buffer]) -> None:
        pwrite_all(self._fd, offset_bytes, buffers)

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
