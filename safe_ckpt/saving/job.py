"""One save on one rank, from plan to published checkpoint: the orchestrator's state.

One job: carry a save through its phases on this rank: plan (this rank's message and the
global plan everyone agrees on, `local_plan` and `plan.agreement`), write (the stager and the
writers, `write.pipeline`), the write vote, commit (rank 0 builds the small files while its
writers write, then publishes through the target), the commit vote, and ``post_commit``; every
failure noted between two collectives goes to the next vote (`coord.ballot`). The call order
and failure rules are in `saving`'s docstring. Must not: contain stage logic.
"""

from __future__ import annotations

import logging
import os
import time

from ..targets.directory import inplace, prepare as dir_prepare, publish as commit
from ..encoding import small_files as commit_files
from ..host import cpu
from ..coord import dist
from ..host import gcfreeze
from ..coord import slot
from ..encoding.layout import lay_out, lay_out_rank
from ..names import METADATA_FILE
from ..errors import CheckpointError, problems_error
from ..options import SaveOptions
from ..write.pipeline import ItemWriteFailed, RankWork, RankWriter
from ..coord.ballot import Ballot
from .local_plan import plan_locally
from ..plan.agreement import agree
from ..write.progress import Progress, log_saved
from ..results import SaveResult, SaveTimings
from ..targets.objectstore import publish as kvcommit
from ..sinks.posix import PosixSink
from ..sinks.tensorstore import is_kvstore_url
from ..staging.pool import shared_pool
from ..interrupts import Deferred
from ..staging.stager import Stager, record_producer_fence

log = logging.getLogger("safe_ckpt")
# Files of equal bytes per writer thread: with two, a writer whose file another writer holds
# still finds one free (one file is never written by two threads at once: see staging.dispatch).
FILES_PER_WRITER = 2


class _Job:
    """One save on one rank, from plan to published checkpoint."""

    def __init__(self, sharded_state_dict, checkpoint_dir, process_group, options, content_metadata,
                 sharded_only: bool = False, post_commit=None, asynchronous: bool = False):
        self.options = options or SaveOptions()
        target = os.fspath(checkpoint_dir)
        # A URL ("file://", "gs://", "memory://", ...) or a kvstore spec selects the TensorStore sink.
        self.kv = is_kvstore_url(target) or self.options.kvstore_spec is not None
        self.checkpoint_dir = target if self.kv else os.path.abspath(target)
        self.kv_sink = None
        self.whole_files: dict = {}
        self.state = sharded_state_dict
        self.process_group = process_group
        self.content_metadata = content_metadata
        # sharded_only: another writer (Megatron's own save) owns the directory, the common
        # state and metadata.json; we add the sharded items and `.metadata` into it.
        self.sharded_only = sharded_only
        self.post_commit = post_commit  # collective step after a successful commit (tracker file)
        # The caller runs on while host sources are written: each is checked again after its write.
        self.asynchronous = asynchronous
        self.area: dir_prepare.StagingArea | None = None
        self.gc_hold = gcfreeze.Hold(False)  # start() puts the save's hold here
        self.slot: slot.Held | None = None  # start() puts the process's save slot here
        self._prebuilt: dict | None = None  # rank 0's small files, built while the writers write
        self.coord: dist.Coordinator | None = None
        self.writer: RankWriter | None = None
        self._writers_started = False
        self.awaits_vote = False  # the planning exchange passed: the peers' next collective is a vote
        self.ballot: Ballot | None = None  # this rank's failures, for the next vote
        self.t0 = time.perf_counter()

    def note(self, stage: str, exc: BaseException, key: str | None = None) -> None:
        self.ballot.note(stage, exc, key)

    # ------------------------------------------------------------------ plan
    def plan(self) -> None:
        self.coord = dist.coordinator(self.process_group, self.options.collective_timeout_s, self.checkpoint_dir)
        # Defaults left None (io_threads, the pool, hashing threads) from this rank's share of its host.
        self.options = cpu.settle(self.options, self.coord)
        rank = self.coord.rank
        self.ballot = Ballot(self.coord, self._abort)
        mine = plan_locally(self.state, rank, checkpoint_dir=self.checkpoint_dir, options=self.options,
                            content_metadata=self.content_metadata, sharded_only=self.sharded_only, kv=self.kv)
        self.state = None  # the job keeps only the sources it needs
        self.area, self.kv_sink = mine.area, mine.kv_sink
        self.save_id = mine.message.save_id  # rank 0's: a failed plan's abort removes its kvstore owner object
        self.ballot.keep_interrupt(mine.interrupt)
        try:
            messages = self.coord.exchange("planning", mine.message)
        except CheckpointError:
            self._abort()
            raise
        with self.coord.interrupts_held():  # a SIGINT here must not leave the peers in a second exchange
            agreement = agree(messages, mine.paths, self.options.chunk_bytes,
                              FILES_PER_WRITER * self.options.io_threads, self.coord.exchange)
        self.ballot.keep_interrupt(self.ballot.take_held())
        if agreement.plan is None:
            self._abort()
            self.ballot.raise_interrupt()
            error = problems_error("planning", agreement.problems)
            if agreement.cause is None:
                raise error  # not `from None`: that would hide an exception the caller is handling
            raise error from agreement.cause
        global_plan = agreement.plan
        self.awaits_vote = True
        self.global_plan = global_plan
        self.staging_dir = messages[0].staging_dir
        self.save_id = messages[0].save_id
        self.coord.save_id = self.save_id
        if self.ballot.interrupt is not None:
            self.note("planning", self.ballot.interrupt)
            return
        try:
            self.layout = lay_out_rank(global_plan, rank, **self._layout_kwargs())
            self._start_writes(mine.local, mine.residences, mine.sources)
        except BaseException as exc:
            self.note("writing", exc)

    def _start_writes(self, local, residences, sources) -> None:
        opts = self.options
        self.pool = shared_pool(opts.staging_budget_bytes)
        self.pool_allocations_before = self.pool.stats().allocations
        devices = {s.device.index for s in sources if s.device.type == "cuda"}
        fence = record_producer_fence(devices) if devices else None
        root = self.staging_dir if not self.kv else None
        if opts.sink_factory:
            sink = opts.sink_factory(root if root is not None else self.kv_sink)
        else:
            sink = self.kv_sink if self.kv else PosixSink(self.staging_dir, opts.fsync)
        self.sink = sink
        if self.kv and self.coord.rank == 0:
            self.whole_files = dict(local.whole_files)  # kvstore: written at commit, in commit order
        work = RankWork(
            layout=self.layout,
            sources=sources,
            residences=residences,
            versions=[s._version for s in sources],
            object_payloads=local.object_payloads,
            whole_files={} if self.kv else local.whole_files,
        )
        self.planned_bytes = {**{f.relative_path: f.size_bytes for f in self.layout.files},  # for check_staged
                              **{name: len(data) for name, data in work.whole_files.items()}}
        payload = sum(i.length_bytes for i in self.layout.items)
        progress = Progress(payload, self.coord.rank, opts.progress_interval_s)
        writer = RankWriter(
            work, sink, Stager(self.pool, fence, grid=opts.checksums and opts.device_checksums), crc32=opts.zip_crc32,
            progress=progress, checksums=opts.checksums, lanes=opts.io_threads, checksum_threads=opts.checksum_threads,
            whole_writes=self.kv, nice=opts.writer_nice, recheck_host_sources=self.asynchronous,
            file_digests=opts.integrity_manifest,
        )
        self.t_planned = time.perf_counter()  # plan_s ends where write_s begins
        if not self.kv and not os.path.isdir(self.staging_dir):
            raise CheckpointError(f"staging directory {self.staging_dir} is not visible here: "
                                  "all ranks must share the filesystem")
        self.writer = writer
        self.ballot.on_note(writer.cancel)
        self._writers_started = True  # before start(): an interrupt inside it must still join
        writer.start()

    def wait_staged(self) -> float:
        """For `async_save`: wait until every device byte is in host memory. On a failure here
        (an interrupt) nobody else will finish this job: vote it now, and raise."""
        try:
            if self.ballot.failure is None and self._writers_started:
                self.writer.wait_staged()
        except BaseException as exc:
            self.note("writing", exc)
            self.finish()
            raise
        return time.perf_counter() - self.t0

    def release(self) -> None:
        self.gc_hold.release()
        if self.slot is not None:
            self.slot.release()

    # ---------------------------------------------------------------- finish
    def finish(self, stall_s: float | None = None) -> SaveResult:
        try:
            return self._finish(stall_s)
        finally:
            self.release()

    def _join_writers(self):
        """The write stats, or None after a failure (noted); the writers have all ended."""
        if not self._writers_started:
            return None
        if self.ballot.failure is None:
            try:
                self._prepare_commit()
            except BaseException as exc:
                self.note("writing", exc)
        while True:
            try:
                stats = self.writer.join()
            except ItemWriteFailed as exc:
                self.note("writing", exc.cause, exc.key)
                return None
            except BaseException as exc:  # an interrupt while waiting: the writers stop, then join again
                self.note("writing", exc)
                continue
            if self.ballot.failure is None and not self.kv:
                try:  # the staging area is still this save's, with every planned file whole
                    dir_prepare.check_staged(self.staging_dir, self.save_id, self.planned_bytes)
                except Exception as exc:
                    self.note("writing", exc)
            return stats if self.ballot.failure is None else None

    def _finish(self, stall_s: float | None) -> SaveResult:
        rank = self.coord.rank
        stats = self._join_writers()
        reports = self.ballot.vote("writing", stats)
        t_commit = time.perf_counter()
        if rank == 0 and self.ballot.failure is None:
            try:
                self._commit([r for r in reports if r is not None])
            except BaseException as exc:
                self.note("commit", exc)
                self._abort()
        self.ballot.vote("commit", decides=True)
        if self.post_commit is not None:
            try:
                with self.coord.interrupts_held():  # the tracker is written before a SIGINT acts
                    self.post_commit(self.coord)
            except BaseException as exc:
                if self.coord.lost:  # no collective can pair any more: report what broke
                    self.ballot.raise_interrupt()
                    raise
                self.note("post-commit", exc)
            self.ballot.vote("post-commit")
        if self.ballot.interrupt is not None:  # it arrived once the commit was under way: the checkpoint stays
            log.warning("%s was published%s before the interrupt (%s) took effect; raising it now",
                        self.checkpoint_dir, " and the tracker written" if self.post_commit is not None else "",
                        type(self.ballot.interrupt).__name__)
        self.ballot.raise_interrupt()
        t_end = time.perf_counter()
        total = t_end - self.t0
        result = SaveResult(
            checkpoint_dir=self.checkpoint_dir,
            rank=rank,
            world_size=self.coord.world_size,
            payload_bytes=stats.payload_bytes,
            file_bytes=stats.file_bytes,
            total_file_bytes=self._total_file_bytes(),
            bytes_by_residence=stats.bytes_by_residence,
            files=stats.files,
            items=len(self.layout.items),
            timings=SaveTimings(
                plan_s=self.t_planned - self.t0,
                stall_s=total if stall_s is None else stall_s,
                write_s=stats.written_s,
                commit_s=t_end - t_commit,
                total_s=total,
            ),
            staging_pool_allocations=self.pool.stats().allocations - self.pool_allocations_before,
            # what this rank used where the options left them to the defaults (`cpu.settle`)
            extra={"io_threads": self.options.io_threads, "staging_budget_bytes": self.options.staging_budget_bytes,
                   "checksum_threads": self.options.checksum_threads},
        )
        log_saved(result)
        return result

    def _layout_kwargs(self) -> dict:
        if not self.kv:
            return {}
        return {"one_item_per_file": True, "tag": kvcommit.new_file_tag(self.save_id)}

    def _all_layouts(self):
        """Every rank's layout (a pure function of the plan), computed at most once."""
        if getattr(self, "_layouts", None) is None:
            self._layouts = lay_out(self.global_plan, **self._layout_kwargs())
        return self._layouts

    def _total_file_bytes(self) -> int:
        return sum(layout.file_bytes for layout in self._all_layouts())

    def _small_files(self) -> dict:
        """The index and config (and, for a kvstore, the common state): they depend on the plan only."""
        return commit_files.small_files(self.global_plan, self._all_layouts(), self.checkpoint_dir, self.save_id,
                                        sharded_only=self.sharded_only, whole_files=self.whole_files)

    def _prepare_commit(self) -> None:
        """Rank 0 builds the small files (the others every rank's layout, for `total_file_bytes`)
        while its writers write, so the commit after the vote only adds the manifest and
        publishes (the caller's thread would only wait in `join`). It waits for the device
        copies to be issued and landed first, so that it does not hold the GIL while the stager
        issues them. A failure here is left for `_commit` to meet again, in the commit stage."""
        self.writer.wait_staged()
        if self.coord.rank != 0:
            self._all_layouts()  # for total_file_bytes: every rank's chunks, cut now rather than after the commit
            return
        try:
            self._prebuilt = self._small_files()
        except Exception as exc:
            log.debug("building the index early failed (%s); the commit builds it again", exc)

    def _commit(self, reports: list) -> None:
        """Rank 0, after every rank's files are durable: index, config, manifest, publish."""
        layouts = self._all_layouts()
        small = self._prebuilt or self._small_files()
        if self.options.checksums:
            small = commit_files.with_manifest(small, [c for r in reports for c in r.checksums],
                                               save_id=self.save_id, world_size=self.coord.world_size)
        if self.options.integrity_manifest:
            small = commit_files.with_integrity(small, {k: v for r in reports for k, v in r.file_digests.items()},
                                                into=self.area.final_dir if self.sharded_only and self.area else None)
        # An interrupt that arrives once the publish is under way is raised when the save is over
        # (or, should the publish fail, with its failure).
        deferred = Deferred()
        try:
            if self.kv:
                with deferred.holding_sigint():  # its last write decides: a SIGINT waits for the outcome
                    kvcommit.publish(self.sink, small, {f.relative_path for lay in layouts for f in lay.files},
                                     owner=kvcommit.owner_key(self.save_id))
                return
            for name in commit_files.write_order(small):
                self.sink.write_file(name, small[name])
            self.sink.sync_root()
            if self.sharded_only:
                inplace.publish_into(self.area, last=METADATA_FILE, fsync=self.options.fsync, interrupts=deferred)
            else:
                commit.publish(self.area, fsync=self.options.fsync, interrupts=deferred)
            self.area = None
        finally:
            self.ballot.keep_interrupt(deferred.first)

    def _abort(self) -> None:
        if self.area is not None:
            commit.abort(self.area)
            self.area = None
        if self.kv_sink is not None and getattr(self, "save_id", None) and self.coord.rank == 0:
            kv_sink, self.kv_sink = self.kv_sink, None  # once: a failed commit and its vote both abort
            kvcommit.abort(kv_sink, kvcommit.new_file_tag(self.save_id))
