"""The commit phase's work on rank 0: the small files of the checkpoint, then its publication.

One job: build the index, config and manifests (`encoding.small_files`) from the agreed plan and
every rank's layout, early while the writers write where it can, and hand them to the target's
`publish`. Must not: vote, or know which kind of target it publishes to.
"""

from __future__ import annotations

import logging

from ..encoding import small_files as commit_files
from ..encoding.layout import lay_out
from ..interrupts import Deferred
from ..targets import PublishMode

log = logging.getLogger("safe_ckpt")


class IndexBuilder:
    """Every rank's layout (a pure function of the plan, cut at most once) and rank 0's small
    files, built while the writers write where possible."""

    def __init__(self, job) -> None:
        self._job = job
        self._layouts = None
        self.prebuilt: dict | None = None

    def layouts(self):
        if self._layouts is None:
            p = self._job.planned
            self._layouts = lay_out(p.global_plan, one_item_per_file=p.rules.one_item_per_file, tag=p.rules.file_tag)
        return self._layouts

    def total_file_bytes(self) -> int:
        return sum(layout.file_bytes for layout in self.layouts())

    def small_files(self) -> dict:
        """The index and config (and the whole files the target publishes): they depend on the plan only."""
        job = self._job
        return commit_files.small_files(job.planned.global_plan, self.layouts(), job.checkpoint_dir,
                                        job.planned.save_id, sharded_only=job.mode is PublishMode.INTO_EXISTING,
                                        whole_files=dict(job.writing.to_publish))

    def build_early(self, rank: int) -> None:
        """Rank 0 builds the small files (the others every rank's layout, for `total_file_bytes`)
        while its writers write; a failure is left for `commit` to meet again, in the commit stage."""
        if rank != 0:
            self.layouts()  # every rank's chunks, cut now rather than after the commit
            return
        try:
            self.prebuilt = self.small_files()
        except Exception as exc:
            log.debug("building the index early failed (%s); the commit builds it again", exc)


def commit(job, reports: list) -> None:
    """Rank 0, after every rank's files are durable: index, config, manifest, publish."""
    index, planned, options = job.index, job.planned, job.options
    small = index.prebuilt or index.small_files()
    if options.checksums:
        small = commit_files.with_manifest(small, [c for r in reports for c in r.checksums],
                                           save_id=planned.save_id, world_size=job.coord.world_size)
    if options.integrity_manifest:
        small = commit_files.with_integrity(small, {k: v for r in reports for k, v in r.file_digests.items()},
                                            into=job.target.integrity_into(job.mode))
    data_files = frozenset(f.relative_path for lay in index.layouts() for f in lay.files)
    # An interrupt that arrives once the publish is under way is raised when the save is over
    # (or, should the publish fail, with its failure).
    deferred = Deferred()
    try:
        job.target.publish(planned.prepared, job.writing.sink.sink, small, data_files, job.mode, deferred)
    finally:
        job.ballot.keep_interrupt(deferred.first)
