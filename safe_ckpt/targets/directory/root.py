"""A save root on a filesystem: the Megatron tracker, and the removal of one of its checkpoints.

One job: point `latest_checkpointed_iteration.txt` at an iteration atomically (a temporary
file renamed over it), and delete a checkpoint so that no crash leaves a half-deleted one
under its name (renamed to a hidden `deleting` name first). Must not: decide which
checkpoint to remove (`targets.retention` does).
"""

from __future__ import annotations

import os
import shutil

from ...errors import CommitError
from ...names import DELETING_MARK, STAGING_MARK, TRACKER_FILE
from ...sinks.posix import fsync_path
from .leftovers import hidden_path
from .prepare import new_save_id


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint so that no crash leaves a half-deleted one under its name:
    rename it to a hidden `...safe_ckpt-deleting-...` name first, then remove that."""
    if os.path.islink(path):
        raise CommitError(f"{path} is a symbolic link; not removing it or what it points to")
    doomed = hidden_path(path, DELETING_MARK, new_save_id())
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


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
