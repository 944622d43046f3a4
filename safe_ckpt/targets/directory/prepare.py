"""A save's claim on a checkpoint directory, before any rank writes, and its check before publication.

One job: on rank 0, refuse a target the replace policy does not allow (`check_target`), clear
what interrupted saves of it left and refuse while another save of it runs (`leftovers.sweep`,
under an exclusive `flock` on the parent, `parent_lock`), then create and claim the hidden
staging directory every rank writes into (`prepare`, `claim.Claim`); on every rank before the
vote that leads to publishing, check that directory is still this save's and holds every
planned file at its size (`check_staged`). The rules are in `publish`'s docstring.
Must not: publish, or remove anything but what `leftovers.sweep` judges stale.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
from dataclasses import dataclass, field

from ...errors import CommitError
from ...names import CHECKPOINT_DIR, TRACKER_FILE, iteration_dir
from ..base import new_save_id  # noqa: F401  (kept here: the directory's callers name it so)
from .claim import _NO_LOCKS, STALE_AFTER_S, Claim, Owner, read_owner
from .leftovers import is_complete_checkpoint, leftovers_of, staging_dir_for, sweep

log = logging.getLogger(__name__)

LOCK_WAIT_S = STALE_AFTER_S  # bound on waiting for another save's `prepare` in the same directory
_warned_no_locks = False


@dataclass(frozen=True)
class StagingArea:
    final_dir: str
    staging_dir: str
    save_id: str
    claim: Claim | None = field(default=None, compare=False, repr=False)


def check_target(final_dir: str, replace: str) -> None:
    """Refuse a target the replace policy does not allow (see `SaveOptions.replace`)."""
    if os.path.islink(final_dir):
        raise CommitError(
            f"{final_dir} is a symbolic link (to {os.readlink(final_dir)}); publishing renames the checkpoint "
            f"into place and would replace the link by a directory. Save to {os.path.realpath(final_dir)} instead"
        )
    if os.path.exists(final_dir) and not os.path.isdir(final_dir):
        raise CommitError(f"{final_dir} exists and is not a directory")
    held = _checkpoints_held(final_dir)
    if held:  # whatever the policy: replacing a save root would delete every checkpoint in it
        raise CommitError(
            f"{final_dir} is a save root (it holds {', '.join(held[:3])}{' and more' if len(held) > 3 else ''}): "
            "saving into it would replace every checkpoint it holds. Save to an iteration directory inside it, "
            f"e.g. {os.path.join(final_dir, iteration_dir(0))} (safe_ckpt.megatron.save_state names it and "
            "writes the tracker)"
        )
    if not os.path.isdir(final_dir) or not os.listdir(final_dir) or replace == "any":
        return
    if replace == "never":
        raise CommitError(f"{final_dir} is not empty and SaveOptions(replace='never') forbids replacing it")
    if not is_complete_checkpoint(final_dir):
        raise CommitError(
            f"{final_dir} holds files but no complete torch_dist checkpoint (foreign data or a broken save); "
            "refusing to replace it. Remove it, or pass SaveOptions(replace='any')"
        )


def _checkpoints_held(directory: str) -> list[str]:
    """The tracker file and checkpoint directories (`iter_NNNNNNN`, `release`) directly inside."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    return [n for n in names if n == TRACKER_FILE or
            (CHECKPOINT_DIR.match(n) and os.path.isdir(os.path.join(directory, n)))]


def prepare(final_dir: str, save_id: str, replace: str = "checkpoint") -> StagingArea:
    """Create and claim the staging directory (rank 0, before any rank writes). First restore
    a checkpoint an interrupted replace left aside and clear stale leftovers; refuse while
    another save of the same target is running."""
    final_dir = os.path.abspath(final_dir)
    parent = os.path.dirname(final_dir)
    os.makedirs(parent, exist_ok=True)
    # From the sweep until the new staging directory is claimed, no other save of a target in
    # this directory may look: otherwise two saves could both find none running and both go on.
    with parent_lock(parent):
        swept = sweep(leftovers_of(final_dir))
        check_target(final_dir, replace)
        if swept.live:
            raise CommitError(
                f"another save of {final_dir} is running ({'; '.join(swept.live)}); one save per target at a time. "
                f"If that save is dead, its directory is removed once its heartbeat is {STALE_AFTER_S:.0f} s old "
                "(at once where its process ran on this machine and has exited)"
            )
        staging = staging_dir_for(final_dir, save_id)
        os.mkdir(staging)
        try:
            claim = Claim(staging, Owner.here(save_id, final_dir))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return StagingArea(final_dir, staging, save_id, claim)


@contextlib.contextmanager
def parent_lock(parent: str, timeout_s: float = LOCK_WAIT_S):
    """An exclusive `flock` on the parent directory, waited for at most ``timeout_s``; where the
    filesystem has no advisory locks, nothing (logged once per process)."""
    global _warned_no_locks
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise CommitError(
                        f"another process has held the lock on {parent} for over {timeout_s:.0f} s while "
                        "preparing a save there; retry, or find that process (lsof)") from None
                time.sleep(0.05)  # the holder is sweeping and creating one directory
            except OSError as exc:
                if exc.errno not in _NO_LOCKS:
                    raise
                if not _warned_no_locks:
                    _warned_no_locks = True
                    log.warning("%s has no advisory locks (%s); two saves of one target started at "
                                "the same moment are not told apart", parent, exc)
                break
        yield
    finally:
        os.close(fd)  # drops the lock


def check_staged(staging_dir: str, save_id: str, planned: dict[str, int]) -> None:
    """Before the vote that leads to publishing, on every rank: the staging directory is still
    the one this save created (its owner record names ``save_id``) and holds each file of
    ``planned`` (relative path -> bytes) at exactly that size. Raises `CommitError` naming
    the file; the save then fails on every rank and nothing is published."""
    what = f"staging directory {staging_dir} of save {save_id}"
    if not os.path.isdir(staging_dir):
        raise CommitError(f"the {what} is gone: it was removed while the save was writing (by hand, or by "
                          "a host that took it for a dead save's); nothing is published")
    owner = read_owner(staging_dir)
    if owner is None or owner.save_id != save_id:
        found = "no owner record" if owner is None else f"the owner record of save {owner.save_id}"
        raise CommitError(f"the {what} holds {found}: it was removed and made again while the save was "
                          "writing; nothing is published")
    for name, size_bytes in sorted(planned.items()):
        try:
            actual_bytes = os.stat(os.path.join(staging_dir, name)).st_size
        except FileNotFoundError:
            raise CommitError(f"{name} is missing from the {what}; nothing is published") from None
        if actual_bytes != size_bytes:
            raise CommitError(f"{name} in the {what} holds {actual_bytes} bytes, not the {size_bytes} "
                              "written; nothing is published")
