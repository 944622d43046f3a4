"""`ObjectStoreTarget`: a checkpoint under an object-store prefix (any TensorStore kvstore).

One job: the `Target` calls in terms of this folder's modules: every rank opens the store
(`sinks.tensorstore`), rank 0 checks the prefix and writes the owner object of a running save
(`publish.claim`), each data file is one key tagged with the save, and `publish.publish` writes
the small files with `metadata.json` last as the commit marker. The save root: the tracker,
complete iterations and removals (`root`), gc (`gc`). Must not: read environment variables.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
from typing import Callable, Mapping

from ...errors import ValidationError
from ...interrupts import Deferred
from ...names import TRACKER_FILE
from ...sinks.tensorstore import KvDeadlines, KvTarget, TensorStoreSink, open_sink, shown_location
from ..base import (
    Followed, LayoutRules, LocalView, PublishMode, Prepared, Survey, Target, TargetSettings, WholeFiles, WriterSink,
)
from ..registry import register
from . import copying, gc, locate, publish as kvcommit, root

log = logging.getLogger("safe_ckpt")


class ObjectStoreTarget(Target):
    def __init__(self, path: str, settings: TargetSettings = TargetSettings(), *, spec: dict | None = None,
                 deadlines: KvDeadlines | None = None) -> None:
        self.settings = settings
        self.location = KvTarget(path, spec)
        self.name = shown_location(self.location)  # the URL (bucket included) every message and result shows
        self._deadlines = deadlines  # one shared deadline (`bounded`); None: each call starts its own
        self._sink: TensorStoreSink | None = None  # opened by `open`, for the whole save
        self._save_id: str | None = None  # set by `prepare` on rank 0: what `abort` removes

    def _fresh_deadlines(self) -> KvDeadlines:
        if self._deadlines is not None:
            return self._deadlines
        total = self.settings.save_timeout_s
        return KvDeadlines(self.settings.request_timeout_s, None if total is None else time.monotonic() + total)

    def _open(self) -> TensorStoreSink:
        return open_sink(self.location, self._fresh_deadlines())

    # --- one save
    def open(self, mode: PublishMode) -> None:
        if mode is PublishMode.INTO_EXISTING:
            raise ValidationError("the Megatron strategy writes local directories only, not kvstores")
        self._sink = self._open()  # the save's deadline starts here

    def prepare(self, save_id: str, replace: str) -> Prepared:
        self._save_id = save_id  # from here a failure's abort removes what this save left
        kvcommit.check_target(self._sink, replace)
        kvcommit.claim(self._sink, save_id, self.settings.save_timeout_s)  # gc: a save is running
        return Prepared(save_id, None)

    def layout_rules(self, save_id: str) -> LayoutRules:
        return LayoutRules(one_item_per_file=True, file_tag=kvcommit.new_file_tag(save_id))

    def route_whole_files(self, files: Mapping[str, bytes]) -> WholeFiles:
        return WholeFiles(to_publish=dict(files))  # written at commit, in commit order

    def writer_sink(self, prepared: Prepared, factory: Callable | None) -> WriterSink:
        return WriterSink(factory(self._sink) if factory else self._sink, whole_writes=True)

    def publish(self, prepared: Prepared, sink, small: Mapping[str, bytes], data_files: frozenset,
                mode: PublishMode, interrupts: Deferred) -> None:
        with interrupts.holding_sigint():  # its last write decides: a SIGINT waits for the outcome
            kvcommit.publish(sink, dict(small), set(data_files), owner=kvcommit.owner_key(prepared.save_id))

    def abort(self) -> None:
        if self._sink is not None and self._save_id:
            sink, self._sink = self._sink, None  # once: a failed commit and its vote both abort
            kvcommit.abort(sink, kvcommit.new_file_tag(self._save_id))

    # --- a save root
    def write_tracker(self, value: str) -> None:
        root.write_tracker(self.location, value, self._fresh_deadlines())

    def bounded(self):
        return contextlib.nullcontext(ObjectStoreTarget(self.location.path, self.settings, spec=self.location.spec,
                                                        deadlines=self._fresh_deadlines()))

    def survey(self) -> Survey:
        """A listing that fails is logged and surveys as empty: retention then removes nothing."""
        try:
            return Survey(root.iterations(self.location, self._fresh_deadlines()))
        except Exception as exc:
            log.warning("retention could not list %s: %s", self.location.path, exc)
            return Survey()

    def remove_checkpoint(self, name: str) -> None:
        root.remove_checkpoint(self._open(), name)

    def shown(self, name: str) -> str:
        return self.name.rstrip("/") + "/" + name

    def collect_leftovers(self, dry_run: bool, force: bool = False) -> list[str]:
        return gc.collect(self.location, dry_run=dry_run, request_timeout_s=self.settings.request_timeout_s,
                          force=force)

    # --- the read-only tools
    def follow_tracker(self) -> Followed:
        found = locate.locate(self.location, self.settings.request_timeout_s)
        checkpoint = ObjectStoreTarget(found.target.path, self.settings, spec=found.target.spec)
        return Followed(checkpoint, found.description, found.via_tracker)

    @contextlib.contextmanager
    def local_view(self, purpose: str, progress=None):
        with tempfile.TemporaryDirectory(prefix=f"safe_ckpt-{purpose}-") as local:
            locate.download(self.location, local, self.settings.request_timeout_s, progress)
            yield LocalView(local, copied=True, config_required=True)

    def reader(self) -> copying.PrefixSource:
        return copying.PrefixSource(open_sink(self.location, KvDeadlines(self.settings.request_timeout_s)))

    def import_checkpoint(self, read, data: list[str], small: list[str], replace: str) -> str:
        return copying.import_checkpoint(self.location, replace, read, data, small, self.settings.request_timeout_s)

    def parent(self) -> "ObjectStoreTarget | None":
        head, _, tail = self.location.path.rstrip("/").rpartition("/")
        if not tail or (self.location.spec is None and head.endswith(":/")):
            return None  # a bucket's (or a spec's) root has no parent prefix here
        return ObjectStoreTarget(head, self.settings, spec=self.location.spec)

    def read_tracker(self) -> str | None:
        try:
            return open_sink(self.location, KvDeadlines(self.settings.request_timeout_s)).read(TRACKER_FILE) \
                .decode().strip()
        except FileNotFoundError:
            return None

    def place_key(self) -> str:
        spec = json.dumps(self.location.spec, sort_keys=True, default=str)
        path = self.location.path.strip("/")
        return "kvstore:" + ("" if path == "." else path) + "|" + spec


register(ObjectStoreTarget, urls=True)
