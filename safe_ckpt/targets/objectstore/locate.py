"""Which checkpoint prefix a path given to `verify`, `inspect` or `copy` means, and its local copy.

One job: give the read-only tools the same meaning on a kvstore prefix (a bucket path, a
TensorStore spec) as on a directory: follow a save root's tracker to the checkpoint it names
(`locate`, as `directory.locate` does), and fetch every file of a prefix into a local
directory (`download`: verify reads every byte anyway; the copy costs local disk of the
checkpoint's size). A prefix with no keys, or a bucket that does not exist, is a
`PathUsageError` (a missing path). Must not: read environment variables, or modify the prefix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

from ...encoding.safe_read.files import check_name
from ...errors import PathUsageError, TrackerError
from ...names import METADATA_FILE, TRACKER_FILE
from ...sinks.tensorstore import (
    DEFAULT_REQUEST_TIMEOUT_S, KvDeadlines, KvTarget, StoreNotFoundError, TensorStoreSink, open_sink,
)
from ..directory.locate import checkpoint_names, save_root_error, tracker_directory


@dataclass(frozen=True)
class KvLocated:
    """The checkpoint prefix a tool argument means; ``via_tracker``: the tracker's content, when
    the argument was a save root."""

    target: KvTarget
    description: str
    via_tracker: str | None = None

    def note(self) -> str | None:
        if self.via_tracker is None:
            return None
        return f"followed {TRACKER_FILE} ({self.via_tracker}) to {self.description}"


def locate(target: KvTarget, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> KvLocated:
    """``target``, or where its tracker points when it is a save root (a `latest_checkpointed_iteration.txt`
    and no `.metadata`); a `PathUsageError` where there is nothing (no key, no bucket), or where
    the prefix is a save root without a tracker (naming the checkpoints below it)."""
    sink = open_sink(target, KvDeadlines(request_timeout_s))
    keys = _existing(sink)
    names = [k for k in keys if "/" not in k]
    if METADATA_FILE in names:
        return KvLocated(target, sink.root)
    if TRACKER_FILE not in names:
        children = checkpoint_names({k.split("/", 1)[0] for k in keys if "/" in k})
        if children:
            raise save_root_error(sink.root, children)
        if not names:
            raise PathUsageError(f"{sink.root}: no such checkpoint prefix (no key directly under it)")
        return KvLocated(target, sink.root)
    content = sink.read(TRACKER_FILE).decode(errors="replace").strip()[:64]
    child = tracker_directory("", content).lstrip("/")
    checkpoint = target.child(child)
    located = open_sink(checkpoint, KvDeadlines(request_timeout_s))
    if not located.list():
        raise TrackerError(f"{sink.root}{TRACKER_FILE} names {content!r}, but {located.root} holds nothing")
    return KvLocated(checkpoint, located.root, content)


def _existing(sink: TensorStoreSink) -> list[str]:
    """Every key under the prefix (``sub/name`` below it)."""
    try:
        keys = sink.list_tree()
    except StoreNotFoundError as exc:
        raise PathUsageError(str(exc)) from None
    if not keys:
        raise PathUsageError(f"{sink.root}: no such checkpoint prefix (no key under it)")
    return keys


def download(src: KvTarget, local_dir: str, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
             progress: Optional[Callable] = None) -> list[str]:
    """Every file directly under ``src`` into ``local_dir`` as it is (complete or not: for
    `verify` and `inspect`, which report what is missing); returns the names. A key that is not
    a plain file name ('..', 'a/b') is refused; a name already in ``local_dir`` is not overwritten."""
    source = open_sink(src, KvDeadlines(request_timeout_s))
    os.makedirs(local_dir, exist_ok=True)
    names = source.list()
    done_bytes = 0
    for i, name in enumerate(names, 1):
        path = check_name(local_dir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        with open(fd, "wb") as f:
            blob = source.read(name)
            f.write(blob)
        done_bytes += len(blob)
        if progress is not None:
            progress(done_bytes, None, f"fetched {i} of {len(names)} files")
    return names
