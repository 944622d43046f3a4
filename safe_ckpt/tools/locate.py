"""Which checkpoint directory a path given to `verify` / `inspect` means.

One job: check the path is an existing directory and, when it is a save root (it
holds `latest_checkpointed_iteration.txt` and no `.metadata`), follow the tracker to
`iter_NNNNNNN` or `release` as Megatron does. Must not: read anything else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..commit import TRACKER_FILE


class PathUsageError(ValueError):
    """The path given is not something a tool can work on (missing, not a directory)."""


class TrackerError(ValueError):
    """A save root's tracker file is unreadable or names a checkpoint that is not there."""


@dataclass(frozen=True)
class Located:
    directory: str
    via_tracker: str | None = None  # the tracker's content, when the path was a save root

    def note(self) -> str | None:
        if self.via_tracker is None:
            return None
        return f"followed {TRACKER_FILE} ({self.via_tracker}) to {self.directory}"


def require_directory(path: str, what: str = "directory") -> str:
    """``path`` made absolute; a PathUsageError if it does not exist or is not a directory."""
    full = os.path.abspath(path)
    if not os.path.exists(full):
        raise PathUsageError(f"{path}: no such {what}")
    if not os.path.isdir(full):
        raise PathUsageError(f"{path}: not a directory")
    return full


def tracker_directory(save_root: str, content: str) -> str:
    """The checkpoint directory Megatron loads for tracker content ``content``."""
    if content == "release":
        return os.path.join(save_root, "release")
    try:
        iteration = int(content)
    except ValueError:
        raise TrackerError(f"{os.path.join(save_root, TRACKER_FILE)}: holds {content[:40]!r}, "
                           f"neither an iteration number nor 'release'") from None
    return os.path.join(save_root, f"iter_{iteration:07d}")


def locate(path: str) -> Located:
    directory = require_directory(path, "checkpoint directory")
    tracker = os.path.join(directory, TRACKER_FILE)
    if os.path.isfile(os.path.join(directory, ".metadata")) or not os.path.isfile(tracker):
        return Located(directory)
    try:
        with open(tracker) as f:
            content = f.read(64).strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise TrackerError(f"{tracker}: cannot be read: {exc}") from None
    target = tracker_directory(directory, content)
    if not os.path.isdir(target):
        raise TrackerError(f"{tracker} names {content!r}, but {target} does not exist")
    return Located(target, content)
