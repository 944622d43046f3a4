"""The object-store ends of `safe-ckpt copy`: a prefix's files read whole, and a checkpoint imported.

One job: read a checkpoint prefix as `copy` reads any (names, whole values), and write a
copied checkpoint under a prefix with the data files first and `.metadata` / `metadata.json`
last (`publish.publish`); a checkpoint already there stops being one (its `metadata.json`
goes) before any of its files change, and a save running into the prefix is never replaced.
Must not: modify the source, or read environment variables.
"""

from __future__ import annotations

from typing import Callable

from ...errors import CommitError
from ...names import CONFIG_FILE
from ...sinks.tensorstore import KvDeadlines, KvTarget, TensorStoreSink, open_sink
from . import publish as kvcommit


class PrefixSource:
    """A checkpoint prefix, read through its sink; ``root`` and ``shown``: the prefix's name."""

    def __init__(self, sink: TensorStoreSink) -> None:
        self.sink = sink
        self.root = self.shown = sink.root

    def list(self) -> list[str]:
        return self.sink.list()

    def read(self, name: str) -> bytes:
        return self.sink.read(name)

    def total_bytes(self, names) -> int | None:
        return None  # a store says a size only per request: the progress line goes without a total


def import_checkpoint(target: KvTarget, replace: str, read: Callable[[str], bytes], data: list[str],
                      small: list[str], request_timeout_s: float) -> str:
    sink = open_sink(target, KvDeadlines(request_timeout_s))
    kvcommit.check_target(sink, replace)
    existing = set(sink.list())
    live = kvcommit.running_saves(sink, existing) if existing else set()
    if live:  # "any" replaces files, never a save that is writing them
        raise CommitError(f"another save of {sink.root} is running (save {', '.join(sorted(live))}); "
                          "copy there once it has finished")
    previous: set[str] = set()
    if CONFIG_FILE in existing:
        try:
            previous = kvcommit.referenced_files(sink) & existing
        except kvcommit.ForeignMetadataError:
            previous = set()  # only "any" gets here with an index it may not read: every key goes anyway
        # The copied data files keep their names and may overwrite the checkpoint there: it stops
        # being one first, so no marker ever stands over a mix of two checkpoints.
        sink.delete(CONFIG_FILE)
    for name in data:
        sink.write_file(name, read(name))
    kvcommit.publish(sink, {name: read(name) for name in small}, set(data))
    keep = set(data) | set(small)
    doomed = set(sink.list_tree()) - keep if replace == "any" else previous - keep
    for name in sorted(doomed):
        sink.delete(name)
    return sink.root
