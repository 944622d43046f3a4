"""The directory ends of `safe-ckpt copy`: a checkpoint's files read whole, and one imported whole.

One job: read a local checkpoint as `copy` reads any (names, whole values) through
`safe_read.files` (regular files inside it only: a FIFO, a device or a symlink leading out is
refused, not read), and publish a copied checkpoint as a save is published (written into a
hidden staging directory beside DST, then one atomic rename or exchange), so DST holds the
old content or exactly the copied checkpoint, never a mix. Must not: modify the source.
"""

from __future__ import annotations

import os
from typing import Callable

from ...encoding.safe_read.files import check_name, read_file
from ...errors import CommitError, PathUsageError
from . import prepare as dir_prepare, publish as commit

# A local file is read whole, as one kvstore value: no cap but its size when opened.
_ANY_SIZE = 1 << 62


class LocalSource:
    """A local source directory; ``shown``: the directory as the user wrote it."""

    def __init__(self, directory: str, shown: str) -> None:
        self.directory = os.path.abspath(directory)
        self.root = shown.rstrip("/") + "/"
        self.shown = self.root.rstrip("/")

    def list(self) -> list[str]:
        return sorted(n for n in os.listdir(self.directory) if not os.path.isdir(os.path.join(self.directory, n)))

    def read(self, name: str) -> bytes:
        return read_file(self.directory, name, _ANY_SIZE)

    def total_bytes(self, names) -> int | None:
        return sum(os.lstat(os.path.join(self.directory, n)).st_size for n in names)


def import_checkpoint(dst: str, replace: str, read: Callable[[str], bytes], order: list[str]) -> str:
    """Write into a staging directory beside ``dst``, then publish it as a save is published."""
    dir_prepare.check_target(dst, replace)  # refused before anything is read, naming DST as given
    parent = os.path.dirname(dst.rstrip("/"))
    if parent and os.path.exists(parent) and not os.path.isdir(parent):
        raise PathUsageError(f"{dst}: {parent} is not a directory")
    try:
        area = dir_prepare.prepare(dst, dir_prepare.new_save_id(), replace)
    except OSError as exc:  # named by DST, not by the staging directory beside it
        raise PathUsageError(f"{dst}: cannot create a checkpoint there ({exc.strerror or exc})") from None
    try:
        for name in order:  # data first, `.metadata` last, as a save writes them
            try:
                _write_local(area.staging_dir, name, read(name))
            except OSError as exc:
                raise CommitError(f"{dst}: cannot write {name} ({exc.strerror or exc}); {dst} is as it was") \
                    from None
        published = commit.publish(area)
    except BaseException:
        commit.abort(area)
        raise
    if published.interrupt is not None:
        raise published.interrupt  # the copy is in place; the interrupt still ends the command
    return dst


def _write_local(directory: str, name: str, blob: bytes) -> None:
    path = check_name(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    with open(fd, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
