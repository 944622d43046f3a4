"""All-or-nothing publication of a checkpoint directory on a POSIX filesystem.

One job: every save writes into a hidden staging directory beside the target; only
after all ranks' files are durable, and each rank has checked that the staging directory
is still its save's and holds every planned file at its planned size (`check_staged`),
is it published with one atomic rename (or an atomic exchange with an existing
checkpoint), after which the parent directory is fsynced. The training-level tracker
file is replaced atomically and written last. A killed or failed save leaves at most
hidden directories, recognisable by their names, that no loader mistakes for a checkpoint.

Running saves are protected. The process that creates a staging directory holds it
(`safe_ckpt.targets.directory.claim`): an owner record inside it (host, pid, save id) whose mtime is a
heartbeat refreshed every 5 s, and an exclusive `flock` on the directory. `prepare` and
`safe-ckpt gc` remove a staging directory only when its owner is stale:
  - the record names this very process and none of its running saves (a failed save
    that dropped its claim unreleased does not block the next one), or
  - no process holds its `flock`, and
  - it has no readable owner record, or the record names a process on this machine
    (same hostname, boot id and pid namespace) that has exited, or the record's
    heartbeat is older than `claim.STALE_AFTER_S` (60 s; the clocks of the hosts that
    share the filesystem must agree to well within that).
A new save of a target whose staging directory is live is refused (one save per target
at a time); `prepare` holds an exclusive `flock` on the parent directory from its sweep
until its own staging directory is claimed, so two saves starting together cannot both
find none running. A staging directory removed anyway (by hand, or by a host that judged it
stale) fails its save at the pre-publish check: nothing is published.

Replacing an existing checkpoint (`safe_ckpt.targets.directory.leftovers` applies the rules below): with
`renameat2(RENAME_EXCHANGE)` it is one atomic
swap. Where the filesystem lacks it (NFS, Lustre, ...) the old checkpoint is renamed
aside to `.<name>.safe_ckpt-replaced-<save id>` and the new one renamed in; a crash
between the two leaves the name empty. Recovery rule: the next `prepare` or `gc` that
finds a `replaced` directory, no directory under the target name, and no live save of
that save id, renames the old checkpoint back (the save that was publishing never
reported success, so the name returns to what it held); the staged new one is then a
stale leftover. A `replaced` directory is deleted only while the target name holds a
complete checkpoint (or when it is not one itself): the only complete copy is never deleted.

Once the staged directory is under the final name (the rename, the exchange, or the second of
the two renames), the outcome is decided (`publish`): the save finishes (the parent directory
synced, the previous checkpoint removed), an interrupt arriving meanwhile waiting for the end
of the save; or, if the parent directory cannot be synced (EIO: the swap may not be on disk),
the previous checkpoint is put back under its name and the save fails. Nothing is ever removed
by a name whose content changed: `abort` removes a staging name only while it still holds this
save's owner record (after an exchange it holds the previous checkpoint).

A target that is a symbolic link is refused (publishing renames, which would replace
the link by a directory); save to the path it resolves to. Hidden names of long targets
use a shortened, hashed form of the name, so any name the filesystem accepts can be saved.

Must not: leave a half-written directory under the target name, or touch any
directory other than the target and hidden directories named after it.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
from dataclasses import dataclass

from ...errors import INTERRUPTS, CommitError
from ...interrupts import Deferred
from ...names import REPLACED_MARK
from ...sinks.posix import fsync_path
from .claim import read_owner
from .leftovers import hidden_path
from .prepare import StagingArea

log = logging.getLogger(__name__)

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2); False where unsupported."""
    libc = _libc()
    fn = getattr(libc, "renameat2", None) if libc is not None else None
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {a} and {b}: {os.strerror(err)}")


def _check_still_ours(area: StagingArea) -> None:
    owner = read_owner(area.staging_dir)
    if owner is None or owner.save_id != area.save_id:
        raise CommitError(f"the staging directory {area.staging_dir} of save {area.save_id} was removed or replaced "
                          "before it could be published; nothing is published")


def _holds(path: str, save_id: str) -> bool:
    """Whether the directory at ``path`` is this save's staged checkpoint (its owner record names
    ``save_id``; the record travels with the directory through every rename and exchange)."""
    owner = read_owner(path)
    return owner is not None and owner.save_id == save_id


@dataclass(frozen=True)
class Published:
    """What `publish` did, once the checkpoint is in place: ``interrupt`` is a `KeyboardInterrupt`
    or `SystemExit` that arrived meanwhile; the caller raises it once its save is over (tracker
    included), never before."""

    interrupt: BaseException | None = None


@dataclass(frozen=True)
class _Switched:
    how: str  # "rename" (a new name), "exchange", "two_renames"
    old: str | None  # where the previous checkpoint now is (None: there was none)


def publish(area: StagingArea, fsync: bool = True, interrupts: Deferred | None = None) -> Published:
    """Make the staged checkpoint visible under its final name, atomically.

    Until the swap (or rename) into place a failure changes nothing (the caller's `abort`
    removes the staging directory). From the swap on the outcome is decided here, with any
    interrupt kept for the caller (a SIGINT to the main thread is held, an idempotent step an
    interrupt cuts short runs again):
      - finish: the parent directory is synced (the checkpoint is durable), the previous
        checkpoint and the owner record removed; returns `Published`;
      - or, when the parent directory cannot be synced (EIO: the swap may not be on disk), put
        the previous checkpoint back (exchange or rename back), sync again, and raise
        `CommitError`: nothing is published, and the staging directory holds this save's
        checkpoint again for `abort` to remove. Should putting it back fail too, nothing is
        removed: the error says where each checkpoint is.
    ``interrupts``: where to keep the interrupts (the caller's, so that it has them even when
    this raises).
    """
    _check_still_ours(area)
    if area.claim is not None:
        area.claim.stop_heartbeat()
    if fsync:
        fsync_path(area.staging_dir, directory=True)
    deferred = interrupts if interrupts is not None else Deferred()
    with deferred.holding_sigint():
        switched, failure = _switch(area, deferred)
        if failure is None and fsync:
            try:
                deferred.step(lambda: fsync_path(os.path.dirname(area.final_dir), directory=True))
            except Exception as exc:
                failure = exc
        if failure is not None:
            _roll_back(area, switched, failure, fsync, deferred)
        _tidy(area, switched, fsync, deferred)
    return Published(deferred.first)


def _switch(area: StagingArea, deferred: Deferred) -> tuple[_Switched, BaseException | None]:
    """Put the staged directory under the final name. Returns how, and an error met once it was
    there (the caller rolls back); raises with everything as it was if it never got there."""
    final, staging = area.final_dir, area.staging_dir

    def landed(exc: BaseException) -> BaseException | None:
        """``exc`` came from a renaming call: re-raise it if the staged directory is not in place;
        otherwise keep an interrupt (None) or hand the error on for a roll-back."""
        if not _holds(final, area.save_id):
            raise exc
        if isinstance(exc, INTERRUPTS):
            deferred.keep(exc)
            return None
        return exc

    if not os.path.lexists(final):
        try:
            os.rename(staging, final)
            return _Switched("rename", None), None
        except BaseException as exc:
            return _Switched("rename", None), landed(exc)
    try:
        exchanged = _exchange(staging, final)
    except BaseException as exc:
        return _Switched("exchange", staging), landed(exc)
    if exchanged:
        # The staging name now holds the previous checkpoint; it goes once the swap is durable.
        return _Switched("exchange", staging), None
    aside = hidden_path(final, REPLACED_MARK, area.save_id)
    try:
        os.rename(final, aside)
    except BaseException:
        if os.path.lexists(aside) and not os.path.lexists(final):  # it moved, then came the interrupt
            os.rename(aside, final)
        raise
    try:
        os.rename(staging, final)
        return _Switched("two_renames", aside), None
    except BaseException as exc:
        if not _holds(final, area.save_id):
            os.rename(aside, final)  # the name keeps what it held
            raise
        return _Switched("two_renames", aside), landed(exc)


def _roll_back(area: StagingArea, switched: _Switched, failure: BaseException, fsync: bool,
               deferred: Deferred) -> None:
    """Put what the final name held back under it (see `publish`); always raises `CommitError`."""
    final, staging, parent = area.final_dir, area.staging_dir, os.path.dirname(area.final_dir)
    what = f"{final} was put in place but could not be made durable ({type(failure).__name__}: {failure})"
    try:
        if switched.how == "exchange":
            if not deferred.step(lambda: _holds(staging, area.save_id) or _exchange(final, staging)):
                raise OSError(errno.ENOTSUP, "renameat2(RENAME_EXCHANGE) no longer supported")
        else:
            deferred.step(lambda: _holds(staging, area.save_id) or os.rename(final, staging))
            if switched.how == "two_renames":
                deferred.step(lambda: os.path.lexists(final) or os.rename(switched.old, final))
    except Exception as exc:
        kept = switched.old
        if switched.how == "exchange" and not _holds(staging, area.save_id):
            kept = _set_aside(staging, final, area.save_id)  # never a stale "staging" directory that gc removes
        log.error("%s; putting the previous checkpoint back failed too (%s)", what, exc)
        raise CommitError(
            f"{what}, and putting the previous checkpoint back failed too ({type(exc).__name__}: {exc}). "
            f"Nothing was deleted: {final} may hold this save's checkpoint"
            + (f", the previous one is at {kept}" if kept else "")
            + "; check the disk, then compare them (safe-ckpt verify)") from failure
    if fsync:
        try:
            deferred.step(lambda: fsync_path(parent, directory=True))
        except Exception as exc:
            log.warning("syncing %s after putting the previous checkpoint back failed too: %s", parent, exc)
    log.error("%s; the previous checkpoint was put back", what)
    raise CommitError(f"{what}; the previous checkpoint was put back under its name: nothing is published") \
        from failure


def _set_aside(path: str, final_dir: str, save_id: str) -> str:
    """The previous checkpoint left at the staging name by a failed roll-back, renamed to the
    `replaced` name whose recovery rules keep it (best effort: where it is, if that fails too)."""
    aside = hidden_path(final_dir, REPLACED_MARK, save_id)
    try:
        os.rename(path, aside)
        return aside
    except OSError:
        return path


def _tidy(area: StagingArea, switched: _Switched, fsync: bool, deferred: Deferred) -> None:
    """After the checkpoint is in place and durable: remove the previous one and the owner record.
    Nothing here can undo the publish: a failure is logged (gc removes what stays)."""
    final, parent = area.final_dir, os.path.dirname(area.final_dir)
    try:
        if switched.old is not None and not _holds(switched.old, area.save_id):
            deferred.step(lambda: shutil.rmtree(switched.old, ignore_errors=True))
        # The owner record travelled with the directory: it must not stay in the checkpoint.
        deferred.step(lambda: _release(area, record_in=final))
        if fsync:
            deferred.step(lambda: fsync_path(final, directory=True))
            deferred.step(lambda: fsync_path(parent, directory=True))
    except Exception as exc:
        log.warning("%s is published, but tidying up after it failed (%s: %s); `safe-ckpt gc %s` "
                    "removes what was left", final, type(exc).__name__, exc, parent)


def _release(area: StagingArea, record_in: str | None = None) -> None:
    if area.claim is not None:
        area.claim.release(record_in)


def abort(area: StagingArea) -> None:
    """Remove the staging directory of a failed save (best effort) and give up its claim. Only
    while that name still holds this save's directory: after a publish swapped it, the name holds
    the previous checkpoint, which is never removed by it."""
    ours = _holds(area.staging_dir, area.save_id)
    _release(area)
    if ours:
        shutil.rmtree(area.staging_dir, ignore_errors=True)
    elif os.path.lexists(area.staging_dir):
        log.warning("not removing %s: it no longer holds save %s's files", area.staging_dir, area.save_id)

