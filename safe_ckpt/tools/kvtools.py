"""`verify` and `inspect` on kvstore prefixes (a bucket path, a TensorStore spec).

One job: give `verify` and `inspect` the same meaning on a kvstore prefix as on a directory:
follow a save root's tracker to the checkpoint it names (`locate`, as for directories), then
read every file of the prefix into a temporary local directory and run the directory tools
there (verify reads every byte anyway; the copy costs local disk of the checkpoint's size). A
prefix with no keys, or a bucket that does not exist, is a `PathUsageError` (a missing path).
`gc` on a prefix is `targets.objectstore.gc`; its tracker and retention,
`targets.objectstore.root`. Must not: read environment variables, or modify the prefix.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass

from ..sinks.tensorstore import (
    DEFAULT_REQUEST_TIMEOUT_S, KvDeadlines, KvTarget, StoreNotFoundError, TensorStoreSink, open_sink,
)
from ..errors import PathUsageError, TrackerError, UnreadableCheckpointError
from ..names import METADATA_FILE, TRACKER_FILE
from .copy import download
from ..targets.directory.locate import checkpoint_names, save_root_error, tracker_directory

log = logging.getLogger("safe_ckpt")


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
    keys = _existing(sink, target)
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


def _existing(sink: TensorStoreSink, target: KvTarget) -> list[str]:
    """Every key under the prefix (``sub/name`` below it)."""
    try:
        keys = sink.list_tree()
    except StoreNotFoundError as exc:
        raise PathUsageError(str(exc)) from None
    if not keys:
        raise PathUsageError(f"{sink.root}: no such checkpoint prefix (no key under it)")
    return keys


def verify(target: KvTarget, *, deep: bool = False, progress=None,
           request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S):
    from .verify import verify as verify_dir

    located = locate(target, request_timeout_s)
    with tempfile.TemporaryDirectory(prefix="safe_ckpt-verify-") as local:
        download(located.target, local, request_timeout_s, progress)
        report = verify_dir(local, deep=deep, progress=progress, config_required=True)
    report.directory = located.description
    return report


def inspect(target: KvTarget, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> dict:
    from .inspect import inspect as inspect_dir

    located = locate(target, request_timeout_s)
    with tempfile.TemporaryDirectory(prefix="safe_ckpt-inspect-") as local:
        download(located.target, local, request_timeout_s)
        try:
            info = inspect_dir(local)
        except UnreadableCheckpointError as exc:  # named in the store, not in the temporary copy
            raise UnreadableCheckpointError(_in_store(exc.path, local, located.description), exc.reason,
                                            exc.refused_global) from None
    info["directory"] = located.description
    info["followed_tracker"] = located.via_tracker
    info.pop("tracker", None)  # the temporary directory's parent is not the save root
    parent = _parent(located.target)
    if parent is not None:
        try:
            info["tracker"] = open_sink(parent, KvDeadlines(request_timeout_s)).read(TRACKER_FILE).decode().strip()
        except FileNotFoundError:
            pass
    return info


def _in_store(path: str, local: str, description: str) -> str:
    """``path`` inside the temporary copy ``local`` as the store's path under ``description``."""
    relative = os.path.relpath(path, local)
    return path if relative.startswith("..") else description + relative


def _parent(target: KvTarget) -> KvTarget | None:
    head, _, tail = target.path.rstrip("/").rpartition("/")
    if not tail or (target.spec is None and head.endswith(":/")):
        return None  # a bucket's (or a spec's) root has no parent prefix here
    return KvTarget(head, target.spec)


def kv_target(path: str, spec: dict | None = None, endpoint: str | None = None,
              region: str | None = None) -> KvTarget | None:
    """The kvstore target a tool argument names, or None for a plain local directory."""
    from ..sinks.tensorstore import resolve_target

    target = resolve_target(path, spec, endpoint, region)
    return target if target.is_kvstore else None

