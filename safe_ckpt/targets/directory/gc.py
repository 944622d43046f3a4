"""`safe-ckpt gc ROOT`: clear up after interrupted saves.

One job: find the hidden staging, replaced and deleting directories (and tracker
temporaries older than the stale bound) that safe_ckpt names recognisably, under ROOT and one level below, and
deal with them by `commit.sweep`'s rules: a running save's staging directory is left
alone, a checkpoint an interrupted replace left aside is put back under its name, the
rest is removed (or listed, with ``dry_run``). A new save of a target does the same for
its own target. Must not: touch anything without one of those markers, or remove the
only complete copy of a checkpoint.
"""

from __future__ import annotations

import logging
import os
import time

from .claim import STALE_AFTER_S, liveness
from .prepare import parent_lock
from .leftovers import Sweep, sweep
from ...names import LEFTOVER_MARKS, OWNER_FILE, STAGING_MARK, TRACKER_FILE

log = logging.getLogger("safe_ckpt")


def _parents(root: str) -> list[str]:
    # A symbolic link leads out of ROOT: what it points to is not gc's to clear.
    return [root] + [os.path.join(root, d) for d in sorted(os.listdir(root))
                     if not d.startswith(".") and not os.path.islink(os.path.join(root, d))
                     and os.path.isdir(os.path.join(root, d))]


def find(root: str) -> list[str]:
    """Every path under ROOT (and one level below) that an interrupted save may have left."""
    found = []
    for parent in _parents(os.path.abspath(root)):
        for name in sorted(os.listdir(parent)):
            leftover_dir = any(mark in name for mark in LEFTOVER_MARKS) and name.startswith(".")
            tracker_tmp = name.startswith(TRACKER_FILE + STAGING_MARK)
            if leftover_dir or tracker_tmp:
                found.append(os.path.join(parent, name))
    return found


def collect(root: str, dry_run: bool = False, stale_after_s: float = STALE_AFTER_S) -> list[str]:
    """Clear ROOT's leftovers; returns the paths removed (with ``dry_run``: that would be).
    Restored checkpoints, running saves left alone and leftovers kept are logged."""
    root = os.path.abspath(root)
    found = find(root)
    tracker_tmps = [p for p in found if os.path.basename(p).startswith(TRACKER_FILE + STAGING_MARK)]
    dirs = [p for p in found if p not in tracker_tmps]
    swept = Sweep()
    for parent in sorted({os.path.dirname(p) for p in dirs}):
        # A save there may be between creating its staging directory and claiming it: its
        # `prepare` holds this lock over that window.
        with parent_lock(parent):
            part = sweep([p for p in dirs if os.path.dirname(p) == parent], dry_run=dry_run,
                         stale_after_s=stale_after_s)
        for mine, theirs in ((swept.removed, part.removed), (swept.restored, part.restored),
                             (swept.live, part.live), (swept.kept, part.kept)):
            mine.extend(theirs)
    removed = list(swept.removed)
    now = time.time()
    for path in tracker_tmps:
        # A fresh one may be a running save's, between writing it and renaming it into place.
        try:
            if now - os.lstat(path).st_mtime < stale_after_s:
                log.info("gc left %s alone: written less than %.0f s ago", path, stale_after_s)
                continue
            if not dry_run:
                os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(path)
    for parent in _parents(root):  # an owner record a crash left in a checkpoint it had just published
        record = os.path.join(parent, OWNER_FILE)
        if os.path.isfile(record) and not liveness(parent, stale_after_s).live:
            if not dry_run:
                os.unlink(record)
            removed.append(record)
    for target in swept.restored:
        log.warning("gc %s %s from the copy an interrupted replace left aside",
                    "would restore" if dry_run else "restored", target)
    for line in swept.live:
        log.info("gc left %s alone", line)
    return sorted(removed)
