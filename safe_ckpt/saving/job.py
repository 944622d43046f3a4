"""One save on one rank, from plan to published checkpoint, in explicit phases.

One job: carry a save through its phases on this rank: planning (this rank's message and the
global plan everyone agrees on, `local_plan` and `plan.agreement`) gives `Planned`; writing
(the stager and the writers, `write.pipeline`) is `Writing`, which for an async save that returns right
after planning (`SaveOptions.return_after="planned"`) first has its copy window open (until every
source byte is in host memory: `write.window_staging`); then the write vote, the commit
(`committing`: rank 0 builds the small files while its writers write, then publishes through
the `Target`), the commit vote, and ``post_commit``, which give the `SaveResult`. Every failure
noted between two collectives goes to the next vote (`coord.ballot`). The call order and
failure rules are in `saving`'s docstring. Must not: contain stage logic, or branch on the
kind of target.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Mapping

from ..coord import dist, slot
from ..coord.ballot import Ballot
from ..encoding.layout import RankLayout, lay_out_rank
from ..errors import CheckpointError, problems_error
from ..host import cpu, gcfreeze
from ..options import SaveOptions
from ..plan.agreement import agree
from ..plan.records import GlobalPlan
from ..results import SaveResult, SaveTimings
from ..staging.host_gate import open_host_gate
from ..staging.pool import PinnedPool, shared_pool
from ..staging.stager import Stager, record_producer_fence
from ..targets import LayoutRules, Prepared, PublishMode, Target, WriterSink
from ..write.pipeline import ItemWriteFailed, RankWork, RankWriter
from ..write.window_staging import WindowStaging, build_window, pool_holds_every_chunk
from ..write.progress import Progress, log_saved
from . import committing
from .local_plan import plan_locally

log = logging.getLogger("safe_ckpt")
# Files of equal bytes per writer thread: with two, a writer whose file another writer holds
# still finds one free (one file is never written by two threads at once: see staging.dispatch).
FILES_PER_WRITER = 2


@dataclass(frozen=True)
class Planned:
    """The planning phase's result on this rank: everything writing needs."""

    save_id: str
    prepared: Prepared  # rank 0's, as the planning exchange brought it
    global_plan: GlobalPlan
    rules: LayoutRules
    layout: RankLayout  # this rank's files


@dataclass
class Writing:
    """The writing phase on this rank (its writers are threads: not frozen)."""

    writer: RankWriter
    sink: WriterSink
    pool: PinnedPool
    pool_allocations_before: int
    planned_bytes: Mapping[str, int]  # every file this rank writes, for the target's `check_staged`
    to_publish: Mapping[str, bytes]  # rank 0's whole files the target publishes itself
    t_started: float  # the planning time ends here
    started: bool = False  # the writers were started (an interrupt inside `start` must still join them)


class SaveJob:
    """A save on this rank whose writers are running (returned by `saving.start`). Every rank
    must finish it: `finish()`, or `in_background()` for an asynchronous save."""

    def __init__(self, sharded_state_dict, target: Target, process_group, options: SaveOptions, content_metadata,
                 mode: PublishMode = PublishMode.WHOLE, post_commit=None, asynchronous: bool = False,
                 copy_start: str = "now"):
        self.options = options
        self.target = target
        self.state = sharded_state_dict  # dropped once planned: the job keeps only the sources it needs
        self.process_group = process_group
        self.content_metadata = content_metadata
        self.mode = mode
        self.post_commit = post_commit  # collective step after a successful commit (tracker file)
        # The caller runs on while host sources are written: each is checked again after its write.
        self.asynchronous = asynchronous
        # Returns right after planning: the copies run through a copy window, opened "now" or at the
        # next trigger ("deferred", `staging.gates.open_deferred`).
        self.overlapped = asynchronous and options.return_after == "planned"
        self.copy_start = copy_start
        self.gc_hold = gcfreeze.Hold(False)  # start() puts the save's hold here
        self.slot: slot.Held | None = None  # start() puts the process's save slot here
        self.coord: dist.Coordinator | None = None
        self.ballot: Ballot | None = None  # this rank's failures, for the next vote
        self.awaits_vote = False  # the planning exchange passed: the peers' next collective is a vote
        self.planned: Planned | None = None
        self.writing: Writing | None = None
        self.index = committing.IndexBuilder(self)
        self.t0 = time.perf_counter()

    @property
    def checkpoint_dir(self) -> str:
        return self.target.name

    def note(self, stage: str, exc: BaseException, key: str | None = None) -> None:
        self.ballot.note(stage, exc, key)

    # ------------------------------------------------------------------ plan
    def plan(self) -> None:
        self.coord = dist.coordinator(self.process_group, self.options.collective_timeout_s, self.checkpoint_dir)
        # Defaults left None (io_threads, the pool, hashing threads) from this rank's share of its host.
        self.options = cpu.settle(self.options, self.coord)
        rank = self.coord.rank
        self.ballot = Ballot(self.coord, self._abort)
        mine = plan_locally(self.state, rank, target=self.target, options=self.options,
                            content_metadata=self.content_metadata, mode=self.mode)
        self.state = None
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
        self.awaits_vote = True
        save_id = messages[0].save_id
        self.coord.save_id = save_id
        if self.ballot.interrupt is not None:
            self.note("planning", self.ballot.interrupt)
            return
        try:
            rules = self.target.layout_rules(save_id)
            layout = lay_out_rank(agreement.plan, rank, one_item_per_file=rules.one_item_per_file, tag=rules.file_tag)
            self.planned = Planned(save_id, Prepared(save_id, messages[0].staging_dir), agreement.plan, rules, layout)
            self._start_writes(mine.local, mine.residences, mine.sources)
        except BaseException as exc:
            self.note("writing", exc)

    def _start_writes(self, local, residences, sources) -> None:
        opts, planned = self.options, self.planned
        pool = shared_pool(opts.staging_budget_bytes)
        allocations_before = pool.stats().allocations
        devices = {s.device.index for s in sources if s.device.type == "cuda"}
        if self.overlapped and opts.integrity_manifest and not pool_holds_every_chunk(planned.layout.items, pool):
            log.info("the save to %s returns once staged, not right after planning: with integrity_manifest the "
                     "staging pool (staging_budget_bytes) must hold the rank's saved bytes", self.checkpoint_dir)
            self.overlapped = False
        fence = record_producer_fence(devices) if devices and not self.overlapped else None  # the window fences
        routed = self.target.route_whole_files(local.whole_files)
        sink = self.target.writer_sink(planned.prepared, opts.sink_factory)
        work = RankWork(layout=planned.layout, sources=sources, residences=residences,
                        versions=[s._version for s in sources], object_payloads=local.object_payloads,
                        whole_files=dict(routed.to_writers))
        planned_bytes = {**{f.relative_path: f.size_bytes for f in planned.layout.files},
                         **{name: len(data) for name, data in work.whole_files.items()}}
        progress = Progress(sum(i.length_bytes for i in planned.layout.items), self.coord.rank,
                            opts.progress_interval_s)
        writer = RankWriter(
            work, sink.sink, Stager(pool, fence, grid=opts.checksums and opts.device_checksums), crc32=opts.zip_crc32,
            progress=progress, checksums=opts.checksums, lanes=opts.io_threads, checksum_threads=opts.checksum_threads,
            whole_writes=sink.whole_writes, nice=opts.writer_nice, recheck_host_sources=self.asynchronous,
            file_digests=opts.integrity_manifest,
        )
        self.writing = Writing(writer, sink, pool, allocations_before, planned_bytes, routed.to_publish,
                               t_started=time.perf_counter())
        self.ballot.on_note(writer.cancel)
        self.writing.started = True  # before start(): an interrupt inside it must still join
        if self.overlapped:  # every source through the copy window; every gate waits for it
            writer.window = build_window(planned.layout.items, residences, sources, work.versions,
                                         name=self.checkpoint_dir, rank=self.coord.rank,
                                         timeout_s=opts.collective_timeout_s, page_locked=pool.pinned)
            writer.overlap = WindowStaging(writer.window, pool, copy_start=self.copy_start,
                                           in_file_order=opts.integrity_manifest,
                                           grid=opts.checksums and opts.device_checksums and not opts.integrity_manifest)
        elif self.asynchronous:  # the next optimizer step waits until the host sources are written
            writer.window = open_host_gate(planned.layout.items, residences, sources, work.versions,
                                           name=self.checkpoint_dir, rank=self.coord.rank,
                                           timeout_s=opts.collective_timeout_s)
        writer.start()
        if writer.overlap is not None:  # a Ctrl-C at the window's opening: the save fails, the caller sees it
            writer.overlap.raise_interrupt()

    @property
    def window(self):
        """The copy window (or an async save's host gate) of this save, once its writers exist."""
        return None if self.writing is None else self.writing.writer.window

    def _writers_started(self) -> bool:
        return self.writing is not None and self.writing.started

    def wait_staged(self) -> float:
        """For an asynchronous save: wait until every device byte is in host memory; the seconds
        since the save began. On a failure here (an interrupt) nobody else will finish this job:
        vote it now, and raise."""
        try:
            if self.ballot.failure is None and self._writers_started():
                self.writing.writer.wait_staged()
        except BaseException as exc:
            self.note("writing", exc)
            self.finish()
            raise
        return time.perf_counter() - self.t0

    def in_background(self):
        """This save's handle once its device bytes are staged (`async_save`'s return), or at once
        where it returns right after planning."""
        from .handle import SaveHandle

        if self.ballot.interrupt is not None:  # interrupted in this call: raised as itself, as `save` would
            self.finish()
        if self.overlapped:
            return SaveHandle(self, time.perf_counter() - self.t0)
        return SaveHandle(self, self.wait_staged())

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
        if not self._writers_started():
            return None
        if self.ballot.failure is None:
            try:
                self.writing.writer.wait_staged()  # the index is built after the device copies are issued
                self.index.build_early(self.coord.rank)
            except BaseException as exc:
                self.note("writing", exc)
        while True:
            try:
                stats = self.writing.writer.join()
            except ItemWriteFailed as exc:
                self.note("writing", exc.cause, exc.key)
                return None
            except BaseException as exc:  # an interrupt while waiting: the writers stop, then join again
                self.note("writing", exc)
                continue
            if self.ballot.failure is None:
                try:  # the staging area is still this save's, with every planned file whole
                    self.target.check_staged(self.planned.prepared, self.writing.planned_bytes)
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
                committing.commit(self, [r for r in reports if r is not None])
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
        return self._result(stats, t_commit, stall_s)

    def _result(self, stats, t_commit: float, stall_s: float | None) -> SaveResult:
        t_end = time.perf_counter()
        total = t_end - self.t0
        writing = self.writing
        result = SaveResult(
            checkpoint_dir=self.checkpoint_dir,
            rank=self.coord.rank,
            world_size=self.coord.world_size,
            payload_bytes=stats.payload_bytes,
            file_bytes=stats.file_bytes,
            total_file_bytes=self.index.total_file_bytes(),
            bytes_by_residence=stats.bytes_by_residence,
            files=stats.files,
            items=len(self.planned.layout.items),
            timings=SaveTimings(
                plan_s=writing.t_started - self.t0,
                stall_s=total if stall_s is None else stall_s,
                write_s=stats.written_s,
                commit_s=t_end - t_commit,
                total_s=total,
            ),
            staging_pool_allocations=writing.pool.stats().allocations - writing.pool_allocations_before,
            # what this rank used where the options left them to the defaults (`cpu.settle`)
            extra={"io_threads": self.options.io_threads, "staging_budget_bytes": self.options.staging_budget_bytes,
                   "checksum_threads": self.options.checksum_threads},
        )
        log_saved(result)
        return result

    def _abort(self) -> None:
        self.target.abort()
