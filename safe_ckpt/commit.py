"""All-or-nothing publication of a checkpoint directory on a POSIX filesystem.

One job: every save writes into a hidden staging directory beside the target; only
after all ranks' files are durable is it published with one atomic rename (or an
atomic exchange with an existing checkpoint), after which the parent directory is
fsynced. The training-level tracker file is replaced atomically and written last.
A killed or failed save leaves at most a hidden staging directory, recognisable by
its name, that no loader mistakes for a checkpoint.

Must not: leave a half-written directory under the target name, or touch any
directory other than the target and its own staging directory.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import uuid
from dataclasses import dataclass

from .errors import CommitError
from .sinks.posix import fsync_path

log = logging.getLogger(__name__)

STAGING_MARK = ".safe_ckpt-staging-"
REPLACED_MARK = ".safe_ckpt-replaced-"
DELETING_MARK = ".safe_ckpt-deleting-"
LEFTOVER_MARKS = (STAGING_MARK, REPLACED_MARK, DELETING_MARK)
TRACKER_FILE = "latest_checkpointed_iteration.txt"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


@dataclass(frozen=True)
class StagingArea:
    final_dir: str
    staging_dir: str
    save_id: str


def new_save_id() -> str:
    return uuid.uuid4().hex[:16]


def staging_dir_for(final_dir: str, save_id: str) -> str:
    final_dir = os.path.abspath(final_dir)
    parent, name = os.path.split(final_dir.rstrip(os.sep))
    return os.path.join(parent, f".{name}{STAGING_MARK}{save_id}")


def is_complete_checkpoint(path: str) -> bool:
    """A published torch_dist checkpoint has both its index and its config."""
    return os.path.isfile(os.path.join(path, ".metadata")) and os.path.isfile(os.path.join(path, "metadata.json"))


def check_target(final_dir: str, replace: str) -> None:
    """Refuse a target the replace policy does not allow (see `SaveOptions.replace`)."""
    if os.path.exists(final_dir) and not os.path.isdir(final_dir):
        raise CommitError(f"{final_dir} exists and is not a directory")
    if not os.path.isdir(final_dir) or not os.listdir(final_dir) or replace == "any":
        return
    if replace == "never":
        raise CommitError(f"{final_dir} is not empty and SaveOptions(replace='never') forbids replacing it")
    if not is_complete_checkpoint(final_dir):
        raise CommitError(
            f"{final_dir} holds files but no complete torch_dist checkpoint (foreign data or a broken save); "
            "refusing to replace it. Remove it, or pass SaveOptions(replace='any')"
        )


def leftovers_of(final_dir: str) -> list[str]:
    """Staging / replaced / deleting directories an interrupted save of this target left behind."""
    parent, name = os.path.split(os.path.abspath(final_dir).rstrip(os.sep))
    prefix = f".{name}.safe_ckpt-"
    try:
        return [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(prefix)]
    except FileNotFoundError:
        return []


def prepare(final_dir: str, save_id: str, replace: str = "checkpoint") -> StagingArea:
    """Create the staging directory (rank 0, before any rank writes); clear old leftovers."""
    final_dir = os.path.abspath(final_dir)
    check_target(final_dir, replace)
    parent = os.path.dirname(final_dir)
    os.makedirs(parent, exist_ok=True)
    for stale in leftovers_of(final_dir):  # one save per target at a time: older ones are dead
        log.info("safe_ckpt: removing %s left by an interrupted save", stale)
        shutil.rmtree(stale, ignore_errors=True)
    staging = staging_dir_for(final_dir, save_id)
    os.mkdir(staging)
    return StagingArea(final_dir, staging, save_id)


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint so that no crash leaves a half-deleted one under its name:
    rename it to a hidden `...safe_ckpt-deleting-...` name first, then remove that."""
    parent, name = os.path.split(os.path.abspath(path).rstrip(os.sep))
    doomed = os.path.join(parent, f".{name}{DELETING_MARK}{new_save_id()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


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


def publish(area: StagingArea, fsync: bool = True) -> None:
    """Make the staged checkpoint visible under its final name, atomically."""
    if fsync:
        fsync_path(area.staging_dir, directory=True)
    parent = os.path.dirname(area.final_dir)
    if not os.path.lexists(area.final_dir):
        os.rename(area.staging_dir, area.final_dir)
    elif _exchange(area.staging_dir, area.final_dir):
        # The staging name now holds the previous checkpoint; it goes once the swap is durable.
        if fsync:
            fsync_path(parent, directory=True)
        shutil.rmtree(area.staging_dir, ignore_errors=True)
    else:
        aside = os.path.join(parent, f".{os.path.basename(area.final_dir)}{REPLACED_MARK}{area.save_id}")
        os.rename(area.final_dir, aside)
        os.rename(area.staging_dir, area.final_dir)
        if fsync:
            fsync_path(parent, directory=True)
        shutil.rmtree(aside, ignore_errors=True)
    if fsync:
        fsync_path(parent, directory=True)


def publish_into(area: StagingArea, last: str, fsync: bool = True) -> None:
    """Move the staged files into the (existing) target directory, ``last`` at the very end.

    For writers that own only part of a directory another component is filling (Megatron's
    save calls a sharded strategy after writing `common.pt` itself): the loader keys on
    ``last`` (`.metadata`), so until it lands nothing of this save is visible as complete.
    """
    os.makedirs(area.final_dir, exist_ok=True)
    names = sorted(os.listdir(area.staging_dir))
    for name in [n for n in names if n != last] + ([last] if last in names else []):
        if name == last and fsync:
            fsync_path(area.final_dir, directory=True)
        os.replace(os.path.join(area.staging_dir, name), os.path.join(area.final_dir, name))
    if fsync:
        fsync_path(area.final_dir, directory=True)
    os.rmdir(area.staging_dir)


def abort(area: StagingArea) -> None:
    """Remove the staging directory of a failed save (best effort)."""
    shutil.rmtree(area.staging_dir, ignore_errors=True)


def write_tracker(save_root: str, iteration, fsync: bool = True) -> None:
    """Atomically point `latest_checkpointed_iteration.txt` at ``iteration`` (a number or "release")."""
    path = os.path.join(save_root, TRACKER_FILE)
    tmp = f"{path}{STAGING_MARK}{new_save_id()}"
    try:
        with open(tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if fsync:
            fsync_path(save_root, directory=True)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise CommitError(f"cannot update {path}: {exc}") from exc
