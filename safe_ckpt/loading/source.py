"""Where a checkpoint's bytes come from: a local directory, read with positioned system calls.

One job: open the files a checkpoint's index names and fill caller-given buffers from byte
offsets in them, refusing anything that is not a regular file of the checkpoint: a name is
resolved (symlinks included) and must stay inside the checkpoint directory, and the opened
file must be a regular file (a FIFO or a device is refused before it is read; opening never
blocks). Reads go straight into the caller's memory (`os.preadv`, several buffers per call),
release the GIL, and fail with `ReadError` naming the file where it ends early.

`Source` is the interface the reader talks to; `kvsource.KvSource` is the object-store one.
Must not: interpret bytes, or know about tensors.
"""

from __future__ import annotations

import os
import stat
import threading
from typing import Protocol, Sequence

from ..errors import ReadError

# Linux moves at most this many bytes per read call; a longer read is split.
_MAX_READ_BYTES = 0x7FFFF000
_IOV_MAX = 1024


class Source(Protocol):
    """A checkpoint's files, by name relative to the checkpoint directory."""

    root: str  # for messages

    def describe(self, name: str) -> str:
        """The file's full name, for messages."""

    def size_bytes(self, name: str) -> int | None:
        """The file's size, or None where the store does not say without reading."""

    def exists(self, name: str) -> bool:
        ...

    def read_whole(self, name: str, limit_bytes: int) -> bytes:
        """The whole file (FileNotFoundError if absent); `ReadError` past ``limit_bytes``."""

    def readv(self, name: str, offset_bytes: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` in order from ``offset_bytes``; `ReadError` if the file ends first."""

    def close(self) -> None:
        ...


def _short(path: str, offset_bytes: int, wanted_bytes: int, got_bytes: int) -> ReadError:
    return ReadError(f"{path}: ends early: {wanted_bytes} bytes wanted at offset {offset_bytes}, only {got_bytes} "
                     f"there (truncated or still being written?)")


def _after(buffers: list, n: int) -> list:
    """What is left of ``buffers`` once a read filled their first ``n`` bytes (a buffer filled in
    part continues from where it stopped)."""
    i = 0
    while n and n >= buffers[i].nbytes:
        n -= buffers[i].nbytes
        i += 1
    rest = buffers[i:]
    if n:
        rest[0] = rest[0][n:]
    return rest


class DirectorySource:
    """`Source` over a local directory; file descriptors are opened once and shared by threads."""

    def __init__(self, root: str) -> None:
        self.root = os.fspath(root)
        try:
            self._real_root = os.path.realpath(self.root)
            if not os.path.isdir(self._real_root):
                raise ReadError(f"{self.root}: not a directory (no checkpoint there)")
        except OSError as exc:
            raise ReadError(f"{self.root}: cannot be read: {exc.strerror or exc}") from None
        self._lock = threading.Lock()
        self._fds: dict[str, tuple[int, int]] = {}  # name -> (fd, size)

    def describe(self, name: str) -> str:
        return os.path.join(self.root, name)

    def _resolve(self, name: str) -> str:
        real = os.path.realpath(os.path.join(self._real_root, name))
        if os.path.commonpath([real, self._real_root]) != self._real_root or real == self._real_root:
            raise ReadError(f"{self.describe(name)}: refused: it resolves to {real}, outside the checkpoint "
                            f"directory (a symlink out of it?)")
        return real

    def _open(self, name: str) -> tuple[int, int]:
        with self._lock:
            known = self._fds.get(name)
            if known is not None:
                return known
            real = self._resolve(name)
            try:
                # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
                fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            except FileNotFoundError:
                raise
            except OSError as exc:
                raise ReadError(f"{self.describe(name)}: cannot be opened: {exc.strerror or exc}") from None
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                os.close(fd)
                raise ReadError(f"{self.describe(name)}: refused: not a regular file (a FIFO, device or socket "
                                f"is never part of a checkpoint)")
            self._fds[name] = (fd, info.st_size)
            return fd, info.st_size

    def size_bytes(self, name: str) -> int | None:
        try:
            return self._open(name)[1]
        except FileNotFoundError:
            raise ReadError(f"{self.describe(name)}: missing (the checkpoint's index names it)") from None

    def exists(self, name: str) -> bool:
        try:
            self._open(name)
            return True
        except FileNotFoundError:
            return False

    def read_whole(self, name: str, limit_bytes: int) -> bytes:
        fd, size = self._open(name)
        if size > limit_bytes:
            raise ReadError(f"{self.describe(name)}: refused: {size} bytes, more than the {limit_bytes} such a "
                            f"file is read up to")
        out = bytearray(size)
        self.readv(name, 0, [memoryview(out)])
        return bytes(out)

    def readv(self, name: str, offset_bytes: int, buffers: Sequence[memoryview]) -> None:
        try:
            fd = self._open(name)[0]
        except FileNotFoundError:
            raise ReadError(f"{self.describe(name)}: missing (the checkpoint's index names it)") from None
        pending = [b for b in buffers if b.nbytes]
        offset = offset_bytes
        wanted = sum(b.nbytes for b in pending)
        got = 0
        if 0 < len(pending) <= _IOV_MAX and wanted <= _MAX_READ_BYTES:  # one call, as almost every read is
            try:
                got = os.preadv(fd, pending, offset)
            except OSError as exc:
                raise ReadError(f"{self.describe(name)}: read at offset {offset} failed: {exc.strerror or exc}") \
                    from None
            if got == wanted:
                return
            if got == 0:
                raise _short(self.describe(name), offset_bytes, wanted, got)
            offset += got
            pending = _after(pending, got)
        while pending:
            batch, total = [], 0
            for b in pending[:_IOV_MAX]:
                if total + b.nbytes > _MAX_READ_BYTES:
                    if not batch:
                        batch.append(b[:_MAX_READ_BYTES])
                    break
                batch.append(b)
                total += b.nbytes
            try:
                n = os.preadv(fd, batch, offset)
            except OSError as exc:
                raise ReadError(f"{self.describe(name)}: read at offset {offset} failed: {exc.strerror or exc}") \
                    from None
            if n == 0:
                raise _short(self.describe(name), offset_bytes, wanted, got)
            got += n
            offset += n
            pending = _after(pending, n)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd, _ in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
