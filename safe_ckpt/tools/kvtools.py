"""The tools on kvstore prefixes: verify, inspect, gc, and the Megatron tracker and retention.

One job: give `verify`, `inspect`, `gc` and the Megatron entry point's tracker file and
retention the same meaning on a kvstore prefix (a bucket path, a TensorStore spec) as on
a directory. `verify` and `inspect` follow a save root's tracker to the checkpoint it names
(`locate`, as for directories), then read every file of the prefix into a temporary local
directory and run the directory tools there (verify reads every byte anyway; the copy
costs local disk of the checkpoint's size). A prefix with no keys, or a bucket that does not
exist, is a `PathUsageError` (a missing path). `gc` finds what interrupted saves left: keys
of a prefix without `metadata.json` that only a save writes (`kvcommit.is_save_leftover`),
data files a complete checkpoint's `.metadata` does not name, and a prefix whose
`metadata.json` stands over missing data files (a broken checkpoint, removed marker first).
Retention counts only complete checkpoints (`kvcommit.is_complete`: every data file its index
names is there) and deletes an iteration's `metadata.json` first, so a crash mid-delete leaves
keys `gc` recognises, never a prefix that looks like a checkpoint with files missing.

Must not: read environment variables, or touch a key `gc` cannot attribute to a save
(no `safe_ckpt`-named data file, a prefix holding foreign keys, or one whose `.metadata`
the restricted unpickler refuses), or the keys of a save whose owner object is live
(`kvcommit.running_saves`: a save still running), unless told no save is running (``force``).
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass

from .. import kvcommit
from ..retention import Retention, to_remove
from ..sinks.tensorstore import (
    DEFAULT_REQUEST_TIMEOUT_S, KvDeadlines, KvTarget, StoreNotFoundError, TensorStoreSink, open_sink,
)
from ..errors import UnreadableCheckpointError
from ..names import CONFIG_FILE, ITERATION_DIR, METADATA_FILE, TRACKER_FILE
from .copy import download
from .locate import PathUsageError, TrackerError, checkpoint_names, save_root_error, tracker_directory

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


# ------------------------------------------------------------------------------- gc


def _by_directory(keys: list[str]) -> dict[str, list[str]]:
    """Keys grouped by their directory ("" for the root), names relative to it."""
    out: dict[str, list[str]] = {}
    for key in keys:
        head, _, name = key.rpartition("/")
        out.setdefault(head, []).append(name)
    return out


def leftovers_in(sink: TensorStoreSink, names: list[str], force: bool = False) -> list[str]:
    """The keys of one prefix (its ``names``) that an interrupted save left there. A save whose
    owner object is live is running: its keys, and the prefix's small files, are not leftovers
    (``force``: no save is running)."""
    running = kvcommit.running_saves(sink, names, force=force)
    if running:
        log.info("gc leaves the keys of running save(s) %s under %s alone", sorted(running), sink.root)
    if kvcommit.is_save_leftover(names):
        if not running:
            return sorted(names)
        return sorted(n for n in names if kvcommit.save_id_of(n) not in (None, *running))
    if CONFIG_FILE not in names:
        return []  # foreign keys, or nothing of ours
    try:
        referenced = kvcommit.referenced_files(sink)
    except kvcommit.ForeignMetadataError as exc:
        log.warning("gc skips %s: its .metadata is not a checkpoint index it may read (%s)",
                    sink.root, exc)
        return []
    if not referenced:
        return []  # an index we cannot read: keep everything
    if not referenced <= set(names):
        # A marker over missing data (a commit whose data was removed): not a checkpoint.
        if running or not kvcommit.only_ours(names):
            log.warning("gc leaves %s alone: its metadata.json stands over %d missing data file(s), "
                        "but %s", sink.root, len(referenced - set(names)),
                        "a save of it is running" if running else "it holds keys safe_ckpt did not write")
            return []
        log.warning("%s is a broken checkpoint: its index names %d data file(s) that are not there",
                    sink.root, len(referenced - set(names)))
        return sorted(names)
    return sorted(n for n in names if n not in referenced and kvcommit.save_id_of(n) is not None
                  and kvcommit.save_id_of(n) not in running)


def find(target: KvTarget, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, force: bool = False) -> list[str]:
    """Leftover keys under ``target`` and one level below (as `gc` does for directories),
    relative to ``target``."""
    root = open_sink(target, KvDeadlines(request_timeout_s))
    try:
        keys = root.list_tree()
    except StoreNotFoundError as exc:
        raise PathUsageError(str(exc)) from None
    if not keys:
        raise PathUsageError(f"{root.root}: no such prefix (no key under it)")
    found = []
    for directory, names in sorted(_by_directory(keys).items()):
        if directory.count("/") > 0:
            continue  # deeper than one level below the root
        sink = root.child(directory) if directory else root
        found += [f"{directory}/{n}" if directory else n for n in leftovers_in(sink, names, force)]
    return found


def collect(target: KvTarget, dry_run: bool = False, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
            force: bool = False) -> list[str]:
    found = find(target, request_timeout_s, force)
    if not dry_run:
        root = open_sink(target, KvDeadlines(request_timeout_s))
        # A marker first: a removal cut short never leaves a prefix that reads as a checkpoint.
        for key in sorted(found, key=lambda k: (k.rpartition("/")[2] != CONFIG_FILE, k)):
            root.delete(key)
    return found


# ---------------------------------------------------------------- tracker, retention


def write_tracker(save_root: KvTarget, iteration, deadlines: KvDeadlines = KvDeadlines()) -> None:
    """`latest_checkpointed_iteration.txt` under the save root: one whole value, so a reader
    sees the old or the new iteration, never a torn one."""
    open_sink(save_root, deadlines).write_file(TRACKER_FILE, str(iteration).encode())


def iterations(save_root: KvTarget, deadlines: KvDeadlines = KvDeadlines()) -> dict[int, str]:
    """Iteration prefixes under the save root that hold a complete checkpoint (`kvcommit.is_complete`:
    a marker over an index whose data files are all there)."""
    root = open_sink(save_root, deadlines)
    out = {}
    for directory, names in _by_directory(root.list_tree()).items():
        m = ITERATION_DIR.match(directory)
        if m and kvcommit.is_complete(root.child(directory), names):
            out[int(m.group(1))] = directory
    return out


def remove_checkpoint(root: TensorStoreSink, directory: str) -> None:
    """`metadata.json` first (the prefix stops being a checkpoint), then everything else."""
    sink = root.child(directory)
    sink.delete(CONFIG_FILE)
    root.delete_tree(directory)


def prune(save_root: KvTarget, current: int, policy: Retention, deadlines: KvDeadlines = KvDeadlines(),
          resumed_from: int | None = None) -> list[int]:
    """`retention.prune` for a kvstore save root (``resumed_from``, the checkpoint the run
    resumed from, is never removed); failures are logged, not raised."""
    try:
        root = open_sink(save_root, deadlines)
        found = iterations(save_root, deadlines)
    except Exception as exc:
        log.warning("retention could not list %s: %s", save_root.path, exc)
        return []
    removed = []
    for it in to_remove(list(found), current, policy, resumed_from=resumed_from):
        try:
            remove_checkpoint(root, found[it])
            removed.append(it)
        except Exception as exc:
            log.warning("could not remove old checkpoint %s%s: %s", root.root, found[it], exc)
    if removed:
        log.info("retention removed iterations %s", removed)
    return removed


def kv_target(path: str, spec: dict | None = None, endpoint: str | None = None,
              region: str | None = None) -> KvTarget | None:
    """The kvstore target a tool argument names, or None for a plain local directory."""
    from ..sinks.tensorstore import resolve_target

    target = resolve_target(path, spec, endpoint, region)
    return target if target.is_kvstore else None


# The environment's endpoint rule lives in `safe_ckpt.endpoints` (the names stay here for callers).
from ..endpoints import endpoint_from, region_from  # noqa: E402,F401
