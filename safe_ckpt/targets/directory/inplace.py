"""Publication into an existing directory another writer is filling (Megatron's own save with
a safe_ckpt sharded strategy): the staged files moved in, the index last.

One job: `publish_into`, with the same rule as `commit.publish` once the point of no return is
passed (interrupts wait, the move finishes). Must not: show a mix of old and new files as a
complete checkpoint.
"""

from __future__ import annotations

import os

from . import publish as commit
from .prepare import StagingArea
from ...names import OWNER_FILE, is_data_file
from ...errors import INTERRUPTS, CommitError
from ...interrupts import Deferred


def publish_into(area: StagingArea, last: str, fsync: bool = True,
                 interrupts: Deferred | None = None) -> commit.Published:
    """Move the staged files into the (existing) target directory, ``last`` at the very end.

    For writers that own only part of a directory another component is filling (Megatron's
    save calls a sharded strategy after writing `common.pt` itself). This path is not atomic:
    a crash part-way leaves the directory holding a mix of old and new files. It never shows
    such a mix as a complete checkpoint: the loader keys on ``last`` (`.metadata`), so an
    existing one is removed (and the removal made durable) before any file moves, data files
    (`__*.distcp`) of an earlier save that this save did not write are removed, and the new
    ``last`` lands only after every other file.

    Removing the old index is the point of no return (the previous checkpoint stops being one):
    from there an interrupt is kept for the caller (as `publish` does) and the move finishes;
    an I/O error leaves the directory without an index (no checkpoint, never a mixed one) and
    raises `CommitError`. ``interrupts`` as for `publish`.
    """
    commit._check_still_ours(area)
    os.makedirs(area.final_dir, exist_ok=True)
    deferred = interrupts if interrupts is not None else Deferred()
    with deferred.holding_sigint():
        old_index = os.path.join(area.final_dir, last)
        if os.path.lexists(old_index):
            try:
                os.unlink(old_index)
            except BaseException as exc:
                if os.path.lexists(old_index) or not isinstance(exc, INTERRUPTS):
                    raise  # nothing changed, or an error the caller's abort handles
                deferred.keep(exc)
        try:
            _move_in(area, last, fsync, deferred)
        except Exception as exc:
            raise CommitError(
                f"publishing into {area.final_dir} failed after its previous index was removed "
                f"({type(exc).__name__}: {exc}): it holds no checkpoint now (never a mix that reads as one); "
                "save again") from exc
    return commit.Published(deferred.first)


def _move_in(area: StagingArea, last: str, fsync: bool, deferred: Deferred) -> None:
    final, staging = area.final_dir, area.staging_dir
    if fsync:
        # Until the new index lands, the directory must not read as a (mixed) checkpoint.
        deferred.step(lambda: commit.fsync_path(final, directory=True))
    names = sorted(n for n in os.listdir(staging) if n != OWNER_FILE)
    for name in names:
        if name != last:
            deferred.step(lambda name=name: _move(os.path.join(staging, name), os.path.join(final, name)))
    for name in sorted(os.listdir(final)):  # an earlier save's shards would confuse readers
        if is_data_file(name) and name not in names:
            deferred.step(lambda name=name: _unlink(os.path.join(final, name)))
    if last in names:
        if fsync:
            deferred.step(lambda: commit.fsync_path(final, directory=True))
        deferred.step(lambda: _move(os.path.join(staging, last), os.path.join(final, last)))
    if fsync:
        deferred.step(lambda: commit.fsync_path(final, directory=True))
    deferred.step(lambda: commit._release(area))
    deferred.step(lambda: _rmdir(staging))


def _move(src: str, dst: str) -> None:
    if os.path.lexists(src) or not os.path.lexists(dst):  # else: moved by an attempt an interrupt cut short
        os.replace(src, dst)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
