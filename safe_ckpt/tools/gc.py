"""`safe-ckpt gc ROOT`: remove what interrupted saves left behind.

One job: find the hidden staging, replaced and deleting directories (and tracker
temporaries) that safe_ckpt names recognisably, under ROOT and one level below, and
remove them (or list them with ``dry_run``). A new save of a target clears its own
leftovers too. Must not: touch anything without one of those markers.
"""

from __future__ import annotations

import os
import shutil

from ..commit import LEFTOVER_MARKS, STAGING_MARK, TRACKER_FILE


def find(root: str) -> list[str]:
    found = []
    root = os.path.abspath(root)
    for parent in [root] + [os.path.join(root, d) for d in sorted(os.listdir(root))
                            if os.path.isdir(os.path.join(root, d)) and not d.startswith(".")]:
        for name in sorted(os.listdir(parent)):
            leftover_dir = any(mark in name for mark in LEFTOVER_MARKS) and name.startswith(".")
            tracker_tmp = name.startswith(TRACKER_FILE + STAGING_MARK)
            if leftover_dir or tracker_tmp:
                found.append(os.path.join(parent, name))
    return found


def collect(root: str, dry_run: bool = False) -> list[str]:
    found = find(root)
    if not dry_run:
        for path in found:
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
    return found
