"""Opening a file of a checkpoint directory someone may have crafted.

One job: open a file named by a checkpoint (its index, manifest, common state, data
files) so that the folder cannot block, escape or feed a reader without end: only a
regular file is read; a FIFO, a device, a socket or a directory under that name is
refused, and so is a symlink that leads out of the checkpoint directory (one inside it is
followed). A refusal is an `UnreadableCheckpointError` naming the file. Reads never go
past the size the file had when opened, nor past what the caller asks for: a caller reads
what the checkpoint declares (an item's offset and length) or up to a cap it names.
Used by `verify`, `inspect` and `copy`; a load path can use it the same way.
Must not: write, create or follow anything outside the checkpoint directory.
(A folder changed while it is being read, e.g. a file swapped for a symlink between
the check and the open, is outside what this guards against: the final component is
opened with O_NOFOLLOW, the directories above it are not re-checked.)
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from ...errors import UnreadableCheckpointError

PIECE_BYTES = 64 << 20
# O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer before fstat can refuse it.
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISLNK, "a symlink"))


def kind_of_mode(mode: int) -> str:
    """'a FIFO (named pipe)', 'a directory', ...; 'a regular file' for one."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _inside(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory and path != directory


def check_name(directory: str, name: str) -> str:
    """The path of ``name`` under ``directory``; a name that is absolute, empty or climbs out is refused."""
    parts = name.split("/")
    if not name or os.path.isabs(name) or any(p in ("", ".", "..") for p in parts) or "\0" in name:
        raise UnreadableCheckpointError(os.path.join(directory, name),
                                        "refused: the name points outside the checkpoint directory; not read")
    return os.path.join(directory, name)


def _real(directory: str, name: str) -> tuple[str, str, bool]:
    """(path, real path, whether the real path is inside the directory)."""
    path = check_name(directory, name)
    real = os.path.realpath(path)
    return path, real, _inside(real, os.path.realpath(directory))


def resolve(directory: str, name: str) -> str:
    """The real path ``name`` under ``directory`` leads to, refused if that is outside the directory."""
    path, real, inside = _real(directory, name)
    if not inside:
        raise UnreadableCheckpointError(path, f"refused: a symlink to {real}, outside the checkpoint directory; "
                                              f"not read (copy the file in, or point the tool at where it lives)")
    return real


@dataclass(frozen=True)
class FileKind:
    """What a directory entry is, without opening it: ``regular`` is what the readers will open."""

    name: str
    regular: bool
    size_bytes: int
    description: str  # 'a regular file', 'a FIFO (named pipe)', 'a symlink to /x, outside ...', ...


def describe(directory: str, name: str) -> FileKind:
    """The kind of the entry ``name`` (following a symlink only inside ``directory``)."""
    try:
        _, real, inside = _real(directory, name)
        if not inside:
            return FileKind(name, False, 0, f"a symlink to {real}, outside the checkpoint directory")
        st = os.stat(real, follow_symlinks=False)
    except (UnreadableCheckpointError, OSError) as exc:
        return FileKind(name, False, 0, f"unreadable ({getattr(exc, 'reason', None) or exc.strerror or exc})")
    regular = stat.S_ISREG(st.st_mode)
    return FileKind(name, regular, st.st_size if regular else 0, kind_of_mode(st.st_mode))


class CheckpointFile:
    """An open regular file of a checkpoint; ``size_bytes`` is its size when opened."""

    def __init__(self, fd: int, path: str, size_bytes: int) -> None:
        self.fd, self.path, self.size_bytes = fd, path, size_bytes

    def __enter__(self) -> "CheckpointFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def pieces(self, offset: int, length: int, piece_bytes: int = PIECE_BYTES):
        """The bytes at [offset, offset + length), in pieces; stops early at the size the file had
        when opened (the caller sees how many bytes came)."""
        end = min(offset + length, self.size_bytes)
        while offset < end:
            piece = os.pread(self.fd, min(piece_bytes, end - offset), offset)
            if not piece:
                return
            yield piece
            offset += len(piece)

    def read_range(self, offset: int, length: int) -> bytes:
        return b"".join(self.pieces(offset, length))

    def read_all(self, max_bytes: int, what: str = "file") -> bytes:
        """The whole file, refused unread if it is larger than ``max_bytes``."""
        if self.size_bytes > max_bytes:
            raise UnreadableCheckpointError(self.path, f"refused: {self.size_bytes} bytes, more than the {max_bytes} "
                                                       f"a {what} is read up to; not read")
        return self.read_range(0, self.size_bytes)


def open_file(directory: str, name: str) -> CheckpointFile:
    """Open ``name`` under ``directory`` for reading: a regular file inside the directory, or refused."""
    path = check_name(directory, name)
    real = resolve(directory, name)
    try:
        fd = os.open(real, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == getattr(os, "ELOOP", None) or os.path.islink(real):
            raise UnreadableCheckpointError(path, "refused: a symlink that does not lead to a file (a loop, or "
                                                  "changed while being opened); not read") from None
        if os.path.exists(real) and not os.path.isfile(real):  # a socket: open() says ENXIO
            kind = kind_of_mode(os.stat(real).st_mode)
            raise UnreadableCheckpointError(path, f"refused: {kind}, not a regular file; not read") from None
        raise UnreadableCheckpointError(path, f"cannot be read: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableCheckpointError(path, f"refused: {kind_of_mode(st.st_mode)}, not a regular file; not read")
    except BaseException:
        os.close(fd)
        raise
    return CheckpointFile(fd, path, st.st_size)


def read_file(directory: str, name: str, max_bytes: int, what: str = "file") -> bytes:
    """The whole of ``name`` under ``directory`` (see `open_file`), refused past ``max_bytes``."""
    with open_file(directory, name) as f:
        return f.read_all(max_bytes, what)
