"""`verify` and `inspect` of a checkpoint on any target (a directory, an object-store prefix).

One job: run the directory tools (`verify`, `inspect`) on the local view a target gives of the
checkpoint a tool argument means (`Target.follow_tracker`, then `Target.local_view`), and name
what they report as the user would: where the view is a temporary copy, by the checkpoint's
own name, with its save root's tracker read from the target. Must not: know which kind of
target it is given, or modify the checkpoint.
"""

from __future__ import annotations

import os

from ..errors import UnreadableCheckpointError
from ..targets import Followed
from . import inspect as inspect_tool, verify as verify_tool


def verify(followed: Followed, *, deep: bool = False, progress=None):
    with followed.target.local_view("verify", progress) as view:
        extra = {"config_required": True} if view.config_required else {}
        report = verify_tool.verify(view.directory, deep=deep, progress=progress, **extra)
    if view.copied:
        report.directory = followed.shown
    return report


def inspect(followed: Followed) -> dict:
    with followed.target.local_view("inspect") as view:
        try:
            info = inspect_tool.inspect(view.directory)
        except UnreadableCheckpointError as exc:
            if not view.copied:
                raise
            # named in the target, not in the temporary copy
            raise UnreadableCheckpointError(_shown(exc.path, view.directory, followed.shown), exc.reason,
                                            exc.refused_global) from None
    if view.copied:
        info["directory"] = followed.shown
    info["followed_tracker"] = followed.via_tracker
    if view.copied:
        info.pop("tracker", None)  # the temporary directory's parent is not the save root
        parent = followed.target.parent()
        tracker = parent.read_tracker() if parent is not None else None
        if tracker is not None:
            info["tracker"] = tracker
    return info


def _shown(path: str, local: str, shown: str) -> str:
    """``path`` inside the temporary copy ``local`` as the target's path under ``shown``."""
    relative = os.path.relpath(path, local)
    return path if relative.startswith("..") else shown + relative
