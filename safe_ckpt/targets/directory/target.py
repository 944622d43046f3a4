"""`DirectoryTarget`: a checkpoint directory on a filesystem the ranks share.

One job: the `Target` calls in terms of this folder's modules: rank 0 claims a hidden staging
directory beside the checkpoint (`prepare`), every rank writes into it through a `PosixSink`,
the small files go in with `.metadata` last, and one rename or exchange publishes it
(`publish`), or its files move into the directory Megatron's own save fills (`inplace`). The
save root: the tracker and removals (`root`), the survey (`leftovers`), gc (`gc`).
Must not: know about tensors or plans.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Mapping

from ...encoding import small_files as commit_files
from ...errors import CheckpointError
from ...interrupts import Deferred
from ...names import ITERATION_DIR, METADATA_FILE, TRACKER_FILE
from ...sinks.posix import PosixSink
from ...sinks.tensorstore import KvTarget
from ..base import Followed, LocalView, PublishMode, Prepared, Survey, Target, TargetSettings, WriterSink
from ..registry import register
from . import copying, gc, inplace, locate, prepare as dir_prepare, publish as commit, root
from .leftovers import is_complete_checkpoint


class DirectoryTarget(Target):
    def __init__(self, path: str, settings: TargetSettings = TargetSettings()) -> None:
        self.given = os.fspath(path)  # as the user wrote it, for usage errors
        self.name = os.path.abspath(self.given)
        self.location = KvTarget(self.given)
        self.settings = settings
        self._area: dir_prepare.StagingArea | None = None  # rank 0's, between prepare and publish/abort

    # --- one save
    def open(self, mode: PublishMode) -> None:
        pass

    def prepare(self, save_id: str, replace: str) -> Prepared:
        self._area = dir_prepare.prepare(self.name, save_id, replace)
        return Prepared(save_id, self._area.staging_dir)

    def writer_sink(self, prepared: Prepared, factory: Callable | None) -> WriterSink:
        sink = factory(prepared.staging) if factory else PosixSink(prepared.staging, self.settings.fsync)
        if not os.path.isdir(prepared.staging):
            raise CheckpointError(f"staging directory {prepared.staging} is not visible here: "
                                  "all ranks must share the filesystem")
        return WriterSink(sink, whole_writes=False)

    def check_staged(self, prepared: Prepared, planned_bytes: Mapping[str, int]) -> None:
        dir_prepare.check_staged(prepared.staging, prepared.save_id, dict(planned_bytes))

    def integrity_into(self, mode: PublishMode) -> str | None:
        return self._area.final_dir if mode is PublishMode.INTO_EXISTING and self._area else None

    def publish(self, prepared: Prepared, sink, small: Mapping[str, bytes], data_files: frozenset,
                mode: PublishMode, interrupts: Deferred) -> None:
        for name in commit_files.write_order(small):
            sink.write_file(name, small[name])
        sink.sync_root()
        if mode is PublishMode.INTO_EXISTING:
            inplace.publish_into(self._area, last=METADATA_FILE, fsync=self.settings.fsync, interrupts=interrupts)
        else:
            commit.publish(self._area, fsync=self.settings.fsync, interrupts=interrupts)
        self._area = None

    def abort(self) -> None:
        if self._area is not None:
            area, self._area = self._area, None
            commit.abort(area)

    # --- a save root
    def write_tracker(self, value: str) -> None:
        root.write_tracker(self.name, value, fsync=self.settings.fsync)

    def survey(self) -> Survey:
        complete, incomplete, links = {}, {}, {}
        for name in os.listdir(self.name):
            m = ITERATION_DIR.match(name)
            path = os.path.join(self.name, name)
            if not m:
                continue
            if os.path.islink(path):
                links[int(m.group(1))] = path
            elif os.path.isdir(path):
                (complete if is_complete_checkpoint(path) else incomplete)[int(m.group(1))] = path
        return Survey(complete, incomplete, links)

    def remove_checkpoint(self, name: str) -> None:
        root.remove_checkpoint(name)

    def collect_leftovers(self, dry_run: bool, force: bool = False) -> list[str]:
        root_dir = locate.require_directory(self.given, "save root")
        return gc.collect(root_dir, dry_run=dry_run, **({"stale_after_s": 0.0} if force else {}))

    # --- the read-only tools
    def follow_tracker(self) -> Followed:
        found = locate.locate(self.given)
        shown = found.shown or found.directory  # relative as the user wrote it: the same directory
        return Followed(DirectoryTarget(shown, self.settings), shown, found.via_tracker)

    def require_exists(self, what: str) -> None:
        locate.require_directory(self.given, what)

    def can_hold_a_checkpoint(self) -> bool:
        return not os.path.exists(self.name) or os.path.isdir(self.name)

    def local_view(self, purpose: str, progress=None):
        return contextlib.nullcontext(LocalView(self.name))

    def reader(self) -> copying.LocalSource:
        return copying.LocalSource(self.name, self.given)

    def is_same_place(self, other: Target) -> bool:
        return isinstance(other, DirectoryTarget) and os.path.realpath(self.given) == os.path.realpath(other.name)

    def import_checkpoint(self, read, data: list[str], small: list[str], replace: str) -> str:
        return copying.import_checkpoint(self.given, replace, read, data + small)

    def parent(self) -> "DirectoryTarget":
        return DirectoryTarget(os.path.dirname(self.name), self.settings)

    def read_tracker(self) -> str | None:
        try:
            with open(os.path.join(self.name, TRACKER_FILE)) as f:
                return f.read(64).strip()
        except FileNotFoundError:
            return None

    def place_key(self) -> str:
        return "dir:" + os.path.realpath(self.name)


register(DirectoryTarget, paths=True)
