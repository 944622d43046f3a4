"""`save` and `async_save`: the collective entry points.

Call order on every rank (each step after a collective sees the same data everywhere):
  1. plan: collect shards and objects, classify residences, rank 0 creates the
     staging directory; exchange the rank plans; validate (same verdict everywhere);
  2. write: stage and write this rank's items into the staging directory, fsync;
  3. vote: every rank reports success or its failure; any failure fails all ranks;
  4. commit: rank 0 writes `.metadata` and `metadata.json`, publishes atomically;
  5. vote: every rank learns whether the checkpoint is visible.
`async_save` returns after step 2's staging of device memory; a background thread
runs the rest. One save runs at a time per process; a new one waits for the last.

Must not: contain stage logic (that lives in plan/residence/staging/encoding/sinks/commit).
"""

from __future__ import annotations

import json
import logging
import os
import time

from . import commit, compat, dist, gcfreeze, residence
from .encoding.layout import lay_out, lay_out_rank
from .encoding.metadata import METADATA_FILE, build_metadata, metadata_bytes
from .errors import CheckpointError, RankFailure, WriteError, failure_from_exception, problems_error
from .integrity import MANIFEST_FILE, checksum_of, manifest_bytes
from .version import __version__
from .options import SaveOptions
from .pipeline import ItemWriteFailed, RankWork, RankWriter
from .plan import GlobalPlan, LocalState, Problem, build_global_plan, collect, rank_plan
from .plan.message import PlanMessage, layout_options, option_mismatches
from .progress import Progress, human_bytes
from .results import SaveResult, SaveTimings
from . import kvcommit
from .sinks.posix import PosixSink
from .sinks.tensorstore import KvTarget, deadlines_for, is_kvstore_url, open_sink
from .staging.pool import shared_pool
from .handle import SaveHandle, wait_for_previous
from .staging.stager import Stager, record_producer_fence

log = logging.getLogger("safe_ckpt")
CONFIG_FILE = "metadata.json"
# Files of equal bytes per writer thread: with two, a writer whose file another writer holds
# still finds one free (one file is never written by two threads at once: see staging.dispatch).
FILES_PER_WRITER = 2


class _Job:
    """One save on one rank, from plan to published checkpoint."""

    def __init__(self, sharded_state_dict, checkpoint_dir, process_group, options, content_metadata,
                 sharded_only: bool = False, post_commit=None):
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
        self.area: commit.StagingArea | None = None
        self.gc_hold = gcfreeze.Hold(False)  # start() puts the save's hold here
        self._prebuilt: dict | None = None  # rank 0's small files, built while the writers write
        self.t0 = time.perf_counter()

    # ------------------------------------------------------------------ plan
    def _classify(self, local):
        allow_backup = self.options.unmapped_policy == "cpu_backup"
        residences, sources, problems = [], [], []
        for d in local.shards:
            try:
                c = residence.classify(d.source, allow_cpu_backup=allow_backup)
            except Exception as exc:
                c = residence.Classified(residence.Residence.INVALID.value, f"cannot be classified: {exc}")
            residences.append(c.residence)
            sources.append(d.source if c.source is None else c.source)
            if c.residence == residence.Residence.CUDA_UNMAPPED.value:
                msg = f"{c.detail}; {residence.UNMAPPED_REMEDY}"
                problems.append(Problem("ResidenceError", d.key, (local.rank,), msg))
            elif c.residence == residence.Residence.INVALID.value:
                problems.append(Problem("ValidationError", d.key, (local.rank,), c.detail))
        return residences, sources, problems

    def plan(self) -> None:
        self.coord = dist.coordinator(self.process_group, self.options.collective_timeout_s)
        rank = self.coord.rank
        try:
            local = collect(self.state, rank, self.content_metadata, with_common=not self.sharded_only)
            residences, sources, problems = self._classify(local)
        except Exception as exc:  # a bug must still reach the exchange, or peers would wait
            log.exception("safe_ckpt: rank %d failed while planning", rank)
            local = LocalState(rank, [], [], {}, [])
            residences, sources = [], []
            problems = [Problem("CheckpointError", "<planning>", (rank,), f"{type(exc).__name__}: {exc}")]
        self.state = None  # the job keeps only the sources it needs
        save_id = None
        if self.kv and self.sharded_only:
            problems.append(Problem("ValidationError", "<target>", (rank,),
                                    "the Megatron strategy writes local directories only, not kvstores"))
        elif self.kv:
            try:
                self.kv_sink = open_sink(KvTarget(self.checkpoint_dir, self.options.kvstore_spec),
                                         deadlines_for(self.options))
            except Exception as exc:
                problems.append(Problem("WriteError", "<target>", (rank,), f"{type(exc).__name__}: {exc}"))
        if rank == 0:
            save_id = commit.new_save_id()
            try:
                replace = "any" if self.sharded_only else self.options.replace
                if self.kv_sink is not None:
                    kvcommit.check_target(self.kv_sink, replace)
                elif not self.kv:
                    self.area = commit.prepare(self.checkpoint_dir, save_id, replace)
            except Exception as exc:
                kind = "WriteError" if isinstance(exc, WriteError) else "CommitError"  # e.g. a store not answering
                problems.append(Problem(kind, "<target>", (0,), f"{type(exc).__name__}: {exc}"))
        message = PlanMessage(
            rank_plan(local, residences, problems), self.area.staging_dir if self.area else None, save_id,
            layout_options(self.options.chunk_bytes, self.options.io_threads),
        )
        try:
            messages = self.coord.exchange("planning", message)
        except CheckpointError:
            self._abort()
            raise
        global_plan = option_mismatches(messages) or build_global_plan(
            [m.plan for m in messages], self.options.chunk_bytes, FILES_PER_WRITER * self.options.io_threads)
        if not isinstance(global_plan, GlobalPlan):
            self._abort()
            raise problems_error("planning", global_plan)
        self.global_plan = global_plan
        self.staging_dir = messages[0].staging_dir
        self.save_id = messages[0].save_id
        self.layout = lay_out_rank(global_plan, rank, **self._layout_kwargs())
        self._start_writes(local, residences, sources)

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
        payload = sum(i.length_bytes for i in self.layout.items)
        progress = Progress(payload, self.coord.rank, opts.progress_interval_s)
        self.writer = RankWriter(
            work, sink, Stager(self.pool, fence, grid=opts.checksums and opts.device_checksums), crc32=opts.zip_crc32,
            progress=progress, checksums=opts.checksums, lanes=opts.io_threads, checksum_threads=opts.checksum_threads,
            whole_writes=self.kv, nice=opts.writer_nice,
        )
        self.t_planned = time.perf_counter()  # plan_s ends where write_s begins
        if not self.kv and not os.path.isdir(self.staging_dir):
            self._write_failure = RankFailure(
                self.coord.rank, "writing", "WriteError",
                f"staging directory {self.staging_dir} is not visible here: all ranks must share the filesystem",
            )
            return
        self._write_failure = None
        self.writer.start()

    def wait_staged(self) -> float:
        try:
            if self._write_failure is None:
                self.writer.wait_staged()
        except BaseException:  # no handle will finish this job: do not leave the collector frozen
            self.gc_hold.release()
            raise
        return time.perf_counter() - self.t0

    # ---------------------------------------------------------------- finish
    def finish(self, stall_s: float | None = None) -> SaveResult:
        try:
            return self._finish(stall_s)
        finally:
            self.gc_hold.release()

    def _finish(self, stall_s: float | None) -> SaveResult:
        rank = self.coord.rank
        failure, stats = self._write_failure, None
        if failure is None:
            try:
                self._prepare_commit()
                stats = self.writer.join()
            except ItemWriteFailed as exc:
                failure = failure_from_exception(rank, "writing", exc.cause, exc.key)
            except BaseException as exc:
                failure = failure_from_exception(rank, "writing", exc)
        try:
            reports = self.coord.vote("writing", failure, stats.checksums if stats is not None else None)
        except CheckpointError:
            self._abort()
            raise
        t_commit = time.perf_counter()
        failure = None
        if rank == 0:
            try:
                self._commit([c for report in reports for c in (report or [])])
            except BaseException as exc:
                failure = failure_from_exception(rank, "commit", exc)
                self._abort()
        self.coord.vote("commit", failure)
        if self.post_commit is not None:
            self.post_commit(self.coord)
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
        )
        self._log_summary(result)
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
        small = {METADATA_FILE: metadata_bytes(build_metadata(self.global_plan, self._all_layouts(),
                                                               self.checkpoint_dir, self.save_id))}
        if not self.sharded_only:
            small[CONFIG_FILE] = json.dumps(compat.checkpointing_config_dict()).encode()
        small.update(self.whole_files)  # kvstore: the common state goes in with the commit
        return small

    def _prepare_commit(self) -> None:
        """Rank 0 builds the small files while its writers write: the caller's thread would only
        wait in `join` (on an H200, 2.5-6 ms of a 0.36 s save's commit). It waits for the device
        copies to be issued and landed first, so that it does not hold the GIL while the stager
        issues them. A failure here is left for `_commit` to meet again, in the commit stage."""
        if self.coord.rank != 0:
            return
        self.writer.wait_staged()
        try:
            self._prebuilt = self._small_files()
        except Exception as exc:
            log.debug("safe_ckpt: building the index early failed (%s); the commit builds it again", exc)

    def _commit(self, checksums: list) -> None:
        """Rank 0, after every rank's files are durable: index, config, manifest, publish."""
        layouts = self._all_layouts()
        small = self._prebuilt or self._small_files()
        if self.options.checksums:
            whole = {c.relative_path: c.checksum for c in checksums if c.offset_bytes == 0 and c.fqn == c.relative_path}
            whole.update({name: checksum_of([data]) for name, data in small.items()})
            items = [c for c in checksums if c.relative_path not in whole]
            small = {MANIFEST_FILE: manifest_bytes(items, whole, save_id=self.save_id,
                                                   world_size=self.coord.world_size, version=__version__),
                     **small}
        if self.kv:
            kvcommit.publish(self.sink, small, {f.relative_path for lay in layouts for f in lay.files})
            return
        for name, data in small.items():  # `.metadata` last: without it nothing here is a checkpoint
            if name != METADATA_FILE:
                self.sink.write_file(name, data)
        self.sink.write_file(METADATA_FILE, small[METADATA_FILE])
        self.sink.sync_root()
        if self.sharded_only:
            commit.publish_into(self.area, last=METADATA_FILE, fsync=self.options.fsync)
        else:
            commit.publish(self.area, fsync=self.options.fsync)
        self.area = None

    def _abort(self) -> None:
        if self.area is not None:
            commit.abort(self.area)
            self.area = None
        if self.kv_sink is not None and getattr(self, "save_id", None) and self.coord.rank == 0:
            kvcommit.abort(self.kv_sink, kvcommit.new_file_tag(self.save_id))

    def _log_summary(self, r: SaveResult) -> None:
        t = r.timings
        level = logging.INFO if r.rank == 0 else logging.DEBUG
        log.log(
            level,
            "safe_ckpt: saved %s: %s on %d rank(s) in %.2f s (%.2f GB/s), stall %.2f s; rank %d: %s",
            r.checkpoint_dir, human_bytes(r.total_file_bytes), r.world_size, t.total_s,
            r.throughput_bytes_per_s / 1e9, t.stall_s, r.rank,
            ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(r.bytes_by_residence.items())) or "nothing",
        )


def start(sharded_state_dict: dict, checkpoint_dir, *, process_group=None, options: SaveOptions | None = None,
          content_metadata: dict | None = None, sharded_only: bool = False, post_commit=None) -> "_Job":
    """Plan and start writing (collective); for the adapters at the edges. The returned job
    is finished with `.finish()` or handed to `SaveHandle` after `.wait_staged()`."""
    wait_for_previous()
    hold = gcfreeze.Hold((options or SaveOptions()).gc_freeze)
    try:
        job = _Job(sharded_state_dict, checkpoint_dir, process_group, options, content_metadata,
                   sharded_only=sharded_only, post_commit=post_commit)
        job.gc_hold = hold
        job.plan()
    except BaseException:
        hold.release()
        raise
    return job


def save(sharded_state_dict: dict, checkpoint_dir, *, process_group=None, options: SaveOptions | None = None,
         content_metadata: dict | None = None) -> SaveResult:
    """Save a Megatron sharded state dict in the torch_dist layout. Collective.

    Every rank of ``process_group`` (default: all ranks, over a cached gloo group)
    calls it with its own shards. Returns once the checkpoint is published, or raises
    the same `CheckpointError` on every rank and leaves nothing a loader would take
    for a checkpoint.
    """
    return start(sharded_state_dict, checkpoint_dir, process_group=process_group, options=options,
                 content_metadata=content_metadata).finish()


def async_save(sharded_state_dict: dict, checkpoint_dir, *, process_group=None, options: SaveOptions | None = None,
               content_metadata: dict | None = None) -> SaveHandle:
    """Like `save`, but returns once every device-resident byte is staged in host memory.

    With a staging budget smaller than the device bytes, staging waits for earlier
    chunks to be written, so the return is later. Host tensors are written from their
    own memory afterwards: modifying one in place before the handle finishes fails the
    save with `SourceModifiedError` instead of committing torn data.
    """
    job = start(sharded_state_dict, checkpoint_dir, process_group=process_group, options=options,
                content_metadata=content_metadata)
    return SaveHandle(job, job.wait_staged())
