"""A save root on an object store: the Megatron tracker, its complete iterations, their removal.

One job: give the Megatron entry point's tracker file and retention the same meaning under a
kvstore prefix (a bucket path, a TensorStore spec) as in a directory. Retention counts only
complete checkpoints (`publish.is_complete`: every data file its index names is there) and
deletes an iteration's `metadata.json` first, so a crash mid-delete leaves keys `gc`
recognises, never a prefix that looks like a checkpoint with files missing.
Must not: read environment variables.
"""

from __future__ import annotations

import logging

from ...names import CONFIG_FILE, ITERATION_DIR, TRACKER_FILE
from ...sinks.tensorstore import KvDeadlines, KvTarget, TensorStoreSink, open_sink
from . import publish as kvcommit

log = logging.getLogger("safe_ckpt")


def by_directory(keys: list[str]) -> dict[str, list[str]]:
    """Keys grouped by their directory ("" for the root), names relative to it."""
    out: dict[str, list[str]] = {}
    for key in keys:
        head, _, name = key.rpartition("/")
        out.setdefault(head, []).append(name)
    return out


def write_tracker(save_root: KvTarget, iteration, deadlines: KvDeadlines = KvDeadlines()) -> None:
    """`latest_checkpointed_iteration.txt` under the save root: one whole value, so a reader
    sees the old or the new iteration, never a torn one."""
    open_sink(save_root, deadlines).write_file(TRACKER_FILE, str(iteration).encode())


def iterations(save_root: KvTarget, deadlines: KvDeadlines = KvDeadlines()) -> dict[int, str]:
    """Iteration prefixes under the save root that hold a complete checkpoint (`kvcommit.is_complete`:
    a marker over an index whose data files are all there)."""
    root = open_sink(save_root, deadlines)
    out = {}
    for directory, names in by_directory(root.list_tree()).items():
        m = ITERATION_DIR.match(directory)
        if m and kvcommit.is_complete(root.child(directory), names):
            out[int(m.group(1))] = directory
    return out


def remove_checkpoint(root: TensorStoreSink, directory: str) -> None:
    """`metadata.json` first (the prefix stops being a checkpoint), then everything else."""
    sink = root.child(directory)
    sink.delete(CONFIG_FILE)
    root.delete_tree(directory)
