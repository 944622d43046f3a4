"""`save` and `async_save`: the collective entry points.

Call order on every rank (each step after a collective sees the same data everywhere):
  1. plan: collect shards and objects, classify residences, rank 0 creates the
     staging directory; exchange the rank plans; agree on the global plan (`agreement`:
     the same verdict everywhere; a refused plan takes one more exchange to word its errors);
  2. write: stage and write this rank's items into the staging directory, fsync;
  3. vote: every rank reports success or its failure; any failure fails all ranks;
  4. commit: rank 0 writes `.metadata` and `metadata.json`, publishes atomically;
  5. vote: every rank learns whether the checkpoint is visible;
  6. with a ``post_commit`` step (the tracker file): that step, then a last vote.
`async_save` returns after step 2's staging of device memory; a background thread
runs the rest.

Failures: whatever a rank meets between two collectives (an exception in its planning,
a sink factory that raises, a writer's error, an exception in ``post_commit``) goes to
the next collective, always a vote (`ballot`): every rank raises the same
`CheckpointError` once all have reached it, rank 0 removes the staging directory, and
the group stays in step. A `KeyboardInterrupt` or `SystemExit` is handled the same way
(writers cancelled and joined, nothing published) and re-raised as itself on its rank.
Once the checkpoint is in place (`commit.publish` swapped or renamed it) the save finishes:
an interrupt arriving from then on (a SIGINT is held through the publish and the
``post_commit`` step) is re-raised on its rank only after the checkpoint is durable and the
tracker written, with a log line saying so; the other ranks succeed.

Concurrency: one save runs at a time per process (`slot`), sync and async alike, from
any thread: a later save waits for the earlier one to end (its handle to finish), at
most `SaveOptions.collective_timeout_s`, then fails on that rank with a
`CoordinationError`. Every collective carries the save's name and step (`dist`), so
ranks that start saves in different orders (each process taking them one at a time)
fail those saves on every rank with a `CoordinationError` naming both saves, and
publish nothing of them; saves started in the same order on every rank all succeed.

Must not: contain stage logic (that lives in plan/residence/staging/encoding/sinks/commit).
"""

from __future__ import annotations

import logging
import os
import time

from . import commit, commit_files, cpu, dist, endpoints, gcfreeze, slot
from .encoding.layout import lay_out, lay_out_rank
from .encoding.metadata import METADATA_FILE
from .errors import CheckpointError, problems_error
from .options import SaveOptions
from .pipeline import ItemWriteFailed, RankWork, RankWriter
from .ballot import Ballot
from .local_plan import plan_locally
from .agreement import agree
from .progress import Progress, log_saved
from .results import SaveResult, SaveTimings
from . import kvcommit
from .sinks.posix import PosixSink
from .sinks.tensorstore import is_kvstore_url
from .staging.host_gate import open_host_gate
from .staging.pool import shared_pool
from .handle import SaveHandle
from .interrupts import Deferred
from .staging.stager import Stager, record_producer_fence

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
        self.area: commit.StagingArea | None = None
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
        if self.asynchronous:  # the next optimizer step waits until the host sources are written
            writer.window = open_host_gate(self.layout.items, residences, sources, work.versions,
                                           name=self.checkpoint_dir, rank=self.coord.rank,
                                           timeout_s=opts.collective_timeout_s)
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
                    commit.check_staged(self.staging_dir, self.save_id, self.planned_bytes)
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
        while its writers write: the caller's thread would only
        wait in `join` (on an H200, 2.5-6 ms of a 0.36 s save's commit). It waits for the device
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
                commit.publish_into(self.area, last=METADATA_FILE, fsync=self.options.fsync, interrupts=deferred)
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


def start(sharded_state_dict: dict, checkpoint_dir, *, process_group=None, options: SaveOptions | None = None,
          content_metadata: dict | None = None, sharded_only: bool = False, post_commit=None,
          asynchronous: bool = False) -> "_Job":
    """Plan and start writing (collective); for the adapters at the edges. The returned job
    is finished with `.finish()`, or (``asynchronous``) handed to `SaveHandle` after
    `.wait_staged()`. Waits for this process's previous save to end first (see above)."""
    # An `s3://` URL goes where the environment's AWS_ENDPOINT_URL_S3 says, as on the command line.
    checkpoint_dir, options = endpoints.save_target(checkpoint_dir, options or SaveOptions())
    job = _Job(sharded_state_dict, checkpoint_dir, process_group, options, content_metadata,
               sharded_only=sharded_only, post_commit=post_commit, asynchronous=asynchronous)
    job.slot = slot.acquire(job.checkpoint_dir, options.collective_timeout_s)
    try:
        job.gc_hold = gcfreeze.Hold(options.gc_freeze)
        job.plan()
    except BaseException as exc:
        if job.awaits_vote:  # the peers wait in the writing vote: tell them, then raise
            job.note("writing", exc)
            job.finish()
        job.release()
        raise
    return job


def save(sharded_state_dict: dict, checkpoint_dir, *, process_group=None, options: SaveOptions | None = None,
         content_metadata: dict | None = None) -> SaveResult:
    """Save a Megatron sharded state dict in the torch_dist layout. Collective.

    Every rank of ``process_group`` (default: all ranks, over a cached gloo group)
    calls it with its own shards. Returns once the checkpoint is published, or raises
    the same `CheckpointError` on every rank and leaves nothing a loader would take
    for a checkpoint (a rank interrupted by `KeyboardInterrupt` or `SystemExit` raises
    that instead, once its writers have stopped and its peers were told).
    """
    return start(sharded_state_dict, checkpoint_dir, process_group=process_group, options=options,
                 content_metadata=content_metadata).finish()


def async_save(sharded_state_dict: dict, checkpoint_dir, *, process_group=None, options: SaveOptions | None = None,
               content_metadata: dict | None = None) -> SaveHandle:
    """Like `save`, but returns once every device-resident byte is staged in host memory.

    With a staging budget smaller than the device bytes, staging waits for earlier
    chunks to be written, so the return is later. Host tensors are written from their
    own memory afterwards. Until they are, every torch optimizer step in the process waits in
    a step pre-hook (as does `safe_ckpt.staging.gates.before_update()`, for loops that change
    host tensors outside an optimizer step), so the next step never mixes into the checkpoint,
    even one that moves no version counter (a fused CPU AdamW, as `--optimizer-cpu-offload`
    runs); past `collective_timeout_s` the save is abandoned (`StagingTimeoutError`) and the
    step goes on. Other writes to host tensors must wait for the handle. What is detected (the save then fails with `SourceModifiedError` naming the key and
    rank, and publishes nothing):
    - an in-place operation on the saved tensor object itself (``w.add_(1)``), at any
      time before its last chunk is written (the tensor's version counter moved);
    - any change to a contiguous chunk's bytes, by whatever means (``w.data.fill_()``,
      a numpy view, another process through shared memory), made while that chunk is
      being written: its bytes are hashed before the write and again after it.
    Not detected: a change through ``.data`` or a view that does not share the version
    counter, made wholly before a chunk's write begins or after it ends (the checkpoint
    then holds, for that tensor, a mix of values from before and after the change), and
    changes to the few non-contiguous host chunks that are copied to the staging pool
    before their write. Device-resident tensors are copied before `async_save` returns
    and may change freely afterwards.
    """
    job = start(sharded_state_dict, checkpoint_dir, process_group=process_group, options=options,
                content_metadata=content_metadata, asynchronous=True)
    return SaveHandle(job, job.wait_staged())
