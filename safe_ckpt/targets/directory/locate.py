"""Which checkpoint directory a path given to `verify`, `inspect` or `copy` means.

One job: check the path is an existing directory and, when it is a save root (it
holds `latest_checkpointed_iteration.txt` and no `.metadata`), follow the tracker to
`iter_NNNNNNN` or `release` as Megatron does; a save root without a tracker is refused,
naming the checkpoints inside it. Must not: read anything else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ...errors import PathUsageError, TrackerError
from ...names import CHECKPOINT_DIR, METADATA_FILE, RELEASE_DIR, TRACKER_FILE, iteration_dir, iteration_of


def checkpoint_names(names) -> list[str]:
    """The names among ``names`` that Megatron gives checkpoint directories, in iteration order."""
    found = {n for n in names if CHECKPOINT_DIR.match(n)}
    return sorted(found, key=lambda n: (n == RELEASE_DIR, iteration_of(n) or 0))


def save_root_error(shown: str, children: list[str]) -> PathUsageError:
    """The error for a save root without a tracker: ``shown`` as the user wrote it, ``children``
    its checkpoint directories (`checkpoint_names`)."""
    listed = children if len(children) <= 3 else [*children[:2], "...", children[-1]]
    count = f" ({len(children)} checkpoints)" if len(children) > 3 else ""
    example = shown.rstrip("/") + "/" + children[-1]
    return PathUsageError(f"{shown}: no tracker ({TRACKER_FILE}) and no {METADATA_FILE}: this looks like a save root "
                          f"holding {', '.join(listed)}{count}; pass one of them, e.g. {example}")


@dataclass(frozen=True)
class Located:
    directory: str  # absolute
    via_tracker: str | None = None  # the tracker's content, when the path was a save root
    shown: str | None = None  # the checkpoint as the user would write it (the typed path, and what the tracker adds)

    def note(self) -> str | None:
        if self.via_tracker is None:
            return None
        return f"followed {TRACKER_FILE} ({self.via_tracker}) to {self.shown or self.directory}"


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
    if content == RELEASE_DIR:
        return os.path.join(save_root, RELEASE_DIR)
    try:
        iteration = int(content)
    except ValueError:
        raise TrackerError(f"{os.path.join(save_root, TRACKER_FILE)}: holds {content[:40]!r}, "
                           f"neither an iteration number nor '{RELEASE_DIR}'") from None
    return os.path.join(save_root, iteration_dir(iteration))


def locate(path: str) -> Located:
    directory = require_directory(path, "checkpoint directory")
    tracker = os.path.join(directory, TRACKER_FILE)
    if os.path.isfile(os.path.join(directory, METADATA_FILE)):
        return Located(directory, shown=path)
    if not os.path.isfile(tracker):
        children = checkpoint_names(n for n in os.listdir(directory) if os.path.isdir(os.path.join(directory, n)))
        if children:
            raise save_root_error(path, children)
        return Located(directory, shown=path)
    try:
        with open(tracker) as f:
            content = f.read(64).strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise TrackerError(f"{tracker}: cannot be read: {exc}") from None
    target = tracker_directory(directory, content)
    if not os.path.isdir(target):
        raise TrackerError(f"{tracker} names {content!r}, but {target} does not exist; pass a checkpoint "
                           "directory instead, or point the tracker at one")
    return Located(target, content, os.path.join(path, os.path.basename(target)))
