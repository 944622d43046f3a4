"""`safe-ckpt gc` on an object-store prefix: the keys interrupted saves left.

One job: find, and remove (the commit marker first), what interrupted saves left under a
prefix and one level below it: keys of a prefix without `metadata.json` that only a save
writes (`publish.is_save_leftover`), data files a complete checkpoint's `.metadata` does not
name, and a prefix whose `metadata.json` stands over missing data files (a broken checkpoint).
Must not: touch a key it cannot attribute to a save (no `safe_ckpt`-named data file, a prefix
holding foreign keys, or one whose `.metadata` the restricted unpickler refuses), or the keys of
a save whose owner object is live (`publish.running_saves`: a save still running), unless told
no save is running (``force``).
"""

from __future__ import annotations

import logging

from ...errors import PathUsageError
from ...names import CONFIG_FILE
from ...sinks.tensorstore import (
    DEFAULT_REQUEST_TIMEOUT_S, KvDeadlines, KvTarget, StoreNotFoundError, TensorStoreSink, open_sink,
)
from . import publish as kvcommit
from .root import by_directory

log = logging.getLogger("safe_ckpt")


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
    for directory, names in sorted(by_directory(keys).items()):
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
