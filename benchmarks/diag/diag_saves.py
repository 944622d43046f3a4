"""diag_ttd's safe_ckpt saves: one `safe_ckpt.save` / `async_save` with module constants patched
for its duration (`patched_save`), with every writer lane timed (`traced_save`) or with its fixed
costs timed (`phased_save`). Must not: leave a patch in place past the save it wraps, or time
anything but that save.
"""

from __future__ import annotations

import functools
import json
import shutil
import statistics
import threading
import time

import torch

import safe_ckpt
from safe_ckpt.staging.pool import shared_pool
from safe_ckpt_lab.diag.writeback import WritebackSink


STALLS: dict[str, list[float]] = {}  # case -> async_save's return times
CASE = [""]


def _sums_inline(stage):
    def patched(self, *a, **k):
        k["defer_sums"] = False
        return stage(self, *a, **k)
    return patched


def patched_save(state, target: str, budget: int, mode: str, piece_bytes: int | None = None,
          grid_min_bytes: int | None = None, early_min_bytes: int | None = None, files_per_writer: int | None = None,
          torch_copies: bool = False, inline_sums: bool = False, trace: bool = False,
          blocking_events: bool = False, nice: int | None = None, pythread_s: float | None = None,
          writeback_bytes: int | None = None, rate_gbps: float | None = None,
          devpace_gbps: float | None = None, **opts) -> float:
    """One save with module constants patched for its duration (None: the shipped value):
    ``torch_copies``: copies through Tensor.copy_, not the CUDA driver; ``inline_sums``: grid sums
    enqueued with each copy even while the writers wait; ``nice``: the writers' nice increment
    (cpu.WRITER_NICE_INCREMENT); ``pythread_s``: another Python thread beside the save, waking
    this often to read /proc/self/statm (what the bench's RSS sampler did, and a training
    process's own threads do); ``writeback_bytes``: the kernel's writeback started every that
    many bytes a file gets (`safe_ckpt_lab.diag.writeback.WritebackSink` as the save's
    ``sink_factory``; 0 or None: left to fsync, as the library does);
    ``rate_gbps``: the device copies paced to this rate (`_paced`); ``devpace_gbps``: the same
    paced on the device (`_devpaced`)."""
    from safe_ckpt.host import cpu
    from safe_ckpt import cuda_driver
    from safe_ckpt.write import item_writes, pipeline
    from safe_ckpt.saving import job as save_job
    from safe_ckpt.staging import stager

    patches = [(item_writes, "FUSED_PIECE_BYTES", piece_bytes), (stager, "GRID_MIN_PAYLOAD_BYTES", grid_min_bytes),
               (pipeline, "EARLY_WRITERS_MIN_CHUNK_BYTES", early_min_bytes),
               (save_job, "FILES_PER_WRITER", files_per_writer),
               (torch.cuda, "Event", functools.partial(torch.cuda.Event, blocking=True) if blocking_events else None),
               (cpu, "WRITER_NICE_INCREMENT", nice),
               (cuda_driver, "copies_available", (lambda: False) if torch_copies else None),
               (stager.Stager, "stage", _sums_inline(stager.Stager.stage) if inline_sums else None),
               (stager.Stager, "_enqueue_copy", _paced(stager.Stager._enqueue_copy, rate_gbps) if rate_gbps
                else _devpaced(stager.Stager._enqueue_copy, devpace_gbps) if devpace_gbps else None)]
    if writeback_bytes:
        fsync = opts.get("fsync", True)
        opts["sink_factory"] = lambda root: WritebackSink(root, fsync, writeback_bytes)
    saved = [(module, name, getattr(module, name)) for module, name, value in patches if value is not None]
    for module, name, value in patches:
        if value is not None:
            setattr(module, name, value)
    stop, beside = threading.Event(), None
    try:
        if pythread_s:
            beside = threading.Thread(target=_wake_often, args=(stop, pythread_s), daemon=True)
            beside.start()
        if trace:
            return traced_save(state, target, budget, mode, **opts)
        return _safe_once(state, target, budget, mode, **opts)
    finally:
        stop.set()
        if beside is not None:
            beside.join()
        for module, name, value in saved:
            setattr(module, name, value)


def _paced(enqueue, rate_gbps: float):
    """Stager._enqueue_copy that waits until the bytes issued before it would have taken at
    ``rate_gbps`` since this stager's first copy: a save's copies spread over its writes."""
    def paced(self, chunk, *a, **k):
        now = time.perf_counter()
        t0 = self.__dict__.setdefault("_pace_t0", now)
        due = t0 + self.device_bytes / (rate_gbps * 1e9)
        if due > now:
            time.sleep(due - now)
        return enqueue(self, chunk, *a, **k)
    return paced


D2H_GBPS = 52.0  # the H200's pinned copy rate, for the spin that pads each copy up to a paced one
_CYCLES_PER_S: list[float] = []


def _cycles_per_s() -> float:
    """The GPU's spin-kernel cycles per second, timed once with events."""
    if not _CYCLES_PER_S:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_S.append(50_000_000 / (start.elapsed_time(end) / 1e3))
    return _CYCLES_PER_S[0]


def _devpaced(enqueue, rate_gbps: float):
    """Stager._enqueue_copy preceded, on the same copy stream, by a spin kernel lasting what the
    previous chunk's bytes take at ``rate_gbps`` less what they take at D2H_GBPS: the copies are
    issued at once and land at about ``rate_gbps``. The spin goes in before the next copy, not
    right after this one, so that this chunk's grid sums (queued behind its copy on the same
    stream) are not held back with it: only the next chunk's bytes wait."""
    cycles_per_s = _cycles_per_s()

    def paced(self, chunk, *a, **k):
        pad_s = self.__dict__.pop("_pace_pad_s", 0.0)
        if pad_s > 0:
            with torch.cuda.stream(self._stream(chunk.device.index)):
                torch.cuda._sleep(int(pad_s * cycles_per_s))
        done = enqueue(self, chunk, *a, **k)
        nbytes = chunk.numel() * chunk.element_size()
        self._pace_pad_s = nbytes / (rate_gbps * 1e9) - nbytes / (D2H_GBPS * 1e9)
        return done
    return paced


def _wake_often(stop: threading.Event, period_s: float) -> None:
    while not stop.is_set():
        with open("/proc/self/statm") as f:
            f.read()
        time.sleep(period_s)


def _safe_once(state, target: str, budget: int, mode: str, **opts) -> float:
    shutil.rmtree(target, ignore_errors=True)
    options = safe_ckpt.SaveOptions(staging_budget_bytes=budget, **opts)
    shared_pool(budget).preallocate()  # a case with another budget replaced the pool: register it untimed
    t0 = time.perf_counter()
    if mode == "sync":
        safe_ckpt.save(state.make_sharded(), target, options=options)
    else:
        handle = safe_ckpt.async_save(state.make_sharded(), target, options=options)
        STALLS.setdefault(CASE[0], []).append(time.perf_counter() - t0)
        handle.wait()
    dt = time.perf_counter() - t0
    shutil.rmtree(target, ignore_errors=True)
    return dt


def traced_save(state, target: str, budget: int, mode: str = "sync", **opts) -> float:
    """A save with every writer lane timed: when it first got an item, how long it waited
    for copies to land (`StagedChunk.ready`), how long it spent in its items, when it finished;
    when the staging thread had issued its last device copy or deferred sums (``last_issued_at_s``) and when they had all
    landed (``staging_done_at_s``). Prints one ``trace`` line."""
    from safe_ckpt.write import pipeline
    from safe_ckpt.staging import stager

    marks, lock = {}, threading.Lock()
    t_base = [0.0]

    def note(key, value, add=True):
        name = threading.current_thread().name
        with lock:
            row = marks.setdefault(name, {})
            row[key] = row.get(key, 0.0) + value if add else row.get(key, value)

    orig_ready, orig_item, orig_stage_all = stager.StagedChunk.ready, pipeline.RankWriter._write_item, \
        pipeline.RankWriter._stage_all
    orig_grid, orig_stage, orig_flush = stager.StagedChunk.grid, stager.Stager.stage, stager.Stager.flush_sums

    def issued():  # the latest issue: whether copies land late because they were issued late
        with lock:
            marks.setdefault("issue", {})["last_issued_at_s"] = time.perf_counter() - t_base[0]

    def stage_timed(self, chunk, *a, **kw):
        try:
            return orig_stage(self, chunk, *a, **kw)
        finally:
            if chunk.device.type != "cpu":
                issued()

    def flush_timed(self):
        had = bool(self._pending)
        try:
            return orig_flush(self)
        finally:
            if had:  # deferred sums' copies issued now
                issued()

    def timed(fn, key):
        def wrapper(self):
            t = time.perf_counter()
            try:
                return fn(self)
            finally:
                note(key, time.perf_counter() - t)
        return wrapper

    ready, grid = timed(orig_ready, "ready_wait_s"), timed(orig_grid, "grid_wait_s")

    def write_item(self, handle, item, staged):
        t = time.perf_counter()
        note("first_item_at_s", t - t_base[0], add=False)
        try:
            return orig_item(self, handle, item, staged)
        finally:
            now = time.perf_counter()
            note("items_s", now - t)
            with lock:
                marks[threading.current_thread().name]["last_item_done_at_s"] = now - t_base[0]

    def stage_all(self):
        try:
            return orig_stage_all(self)
        finally:
            note("staging_done_at_s", time.perf_counter() - t_base[0], add=False)

    stager.StagedChunk.ready, pipeline.RankWriter._write_item, pipeline.RankWriter._stage_all = \
        ready, write_item, stage_all
    stager.StagedChunk.grid, stager.Stager.stage, stager.Stager.flush_sums = grid, stage_timed, flush_timed
    try:
        shutil.rmtree(target, ignore_errors=True)
        options = safe_ckpt.SaveOptions(staging_budget_bytes=budget, **opts)
        shared_pool(budget).preallocate()
        t_base[0] = time.perf_counter()
        stall = None
        if mode == "sync":
            result = safe_ckpt.save(state.make_sharded(), target, options=options)
        else:
            handle = safe_ckpt.async_save(state.make_sharded(), target, options=options)
            stall = time.perf_counter() - t_base[0]
            STALLS.setdefault(CASE[0], []).append(stall)  # the case's row reports it like an untraced one's
            result = handle.wait()
        dt = time.perf_counter() - t_base[0]
    finally:
        stager.StagedChunk.ready, pipeline.RankWriter._write_item, pipeline.RankWriter._stage_all = \
            orig_ready, orig_item, orig_stage_all
        stager.StagedChunk.grid, stager.Stager.stage, stager.Stager.flush_sums = orig_grid, orig_stage, orig_flush
        shutil.rmtree(target, ignore_errors=True)
    lanes = {k: v for k, v in marks.items() if k.startswith("safe_ckpt-write")}
    stage = marks.get("safe_ckpt-stage", {})

    def spread(key):
        vals = sorted(v.get(key, 0.0) for v in lanes.values())
        return [round(vals[0], 4), round(statistics.median(vals), 4), round(vals[-1], 4)] if vals else None

    t = result.timings
    print(json.dumps({"case": "trace", "of": CASE[0], "opts": dict(opts), "total_s": round(dt, 4),
                      "stall_s": None if stall is None else round(stall, 4),
                      "plan_s": round(t.plan_s, 4), "write_s": round(t.write_s, 4), "commit_s": round(t.commit_s, 4),
                      "lanes": len(lanes), "staging_done_at_s": round(stage.get("staging_done_at_s", 0.0), 4),
                      "last_issued_at_s": round(marks.get("issue", {}).get("last_issued_at_s", 0.0), 4),
                      "stager_ready_wait_s": round(stage.get("ready_wait_s", 0.0), 4),
                      "lane_first_item_at_s": spread("first_item_at_s"), "lane_ready_wait_s": spread("ready_wait_s"),
                      "lane_grid_wait_s": spread("grid_wait_s"),
                      "lane_items_s": spread("items_s"), "lane_done_at_s": spread("last_item_done_at_s")}),
          flush=True)
    return dt


def phased_save(state, target: str, budget: int, mode: str = "sync", **opts) -> float:
    """A save with its fixed costs timed: each planning and commit step (when it first started,
    from the call, and its seconds over all calls) and when the first copy was issued, the first
    item handed to a writer and the first item written. Prints one ``phases`` line."""
    from safe_ckpt.plan import agreement
    from safe_ckpt.encoding import small_files as commit_files
    from safe_ckpt.coord import dist
    from safe_ckpt.host import gcfreeze
    from safe_ckpt.saving import local_plan
    from safe_ckpt.write import pipeline
    from safe_ckpt.saving import committing, job as save_job
    from safe_ckpt.targets.directory import prepare as dir_prepare, publish as dir_publish
    from safe_ckpt.coord import slot
    from safe_ckpt.sinks import posix
    from safe_ckpt.staging import dispatch, stager

    rows, lock, t_base, saved = {}, threading.Lock(), [0.0], []

    def wrap(owner, attr, name):
        fn = getattr(owner, attr)
        saved.append((owner, attr, fn))

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                now = time.perf_counter()
                with lock:
                    row = rows.setdefault(name, {"first_at_s": round(t - t_base[0], 4), "s": 0.0, "calls": 0})
                    row["s"] += now - t
                    row["calls"] += 1
                    row.setdefault("first_done_at_s", round(now - t_base[0], 4))
        setattr(owner, attr, timed)

    for owner, attr, name in [
        (slot, "acquire", "slot.acquire"), (gcfreeze, "Hold", "gc_hold"),
        (local_plan, "collect", "collect"), (local_plan, "_classify", "classify"),
        (dir_prepare, "prepare", "commit.prepare"), (local_plan, "rank_plan", "rank_plan"),
        (dist.Coordinator, "exchange", "exchange"), (agreement, "build_global_plan", "build_global_plan"),
        (save_job, "lay_out_rank", "lay_out_rank"), (save_job, "shared_pool", "shared_pool"),
        (save_job, "record_producer_fence", "producer_fence"), (save_job, "Stager", "Stager()"),
        (save_job, "RankWriter", "RankWriter()"), (pipeline.RankWriter, "start", "writer.start"),
        (pipeline.RankWriter, "_interleaved", "interleaved"), (stager.Stager, "_stream", "stager._stream"),
        (stager.Stager, "stage", "stager.stage"), (dispatch.Dispatch, "put", "dispatch.put"),
        (pipeline.RankWriter, "_write_item", "write_item"), (pipeline.RankWriter, "join", "writer.join"),
        (dist.Coordinator, "vote", "vote"), (committing, "commit", "commit"),
        (commit_files, "build_metadata", "build_metadata"), (commit_files, "metadata_bytes", "metadata_bytes"),
        (commit_files.compat, "checkpointing_config_dict", "config_dict"),
        (commit_files, "manifest_bytes", "manifest_bytes"),
        (committing.IndexBuilder, "layouts", "all_layouts"), (posix.PosixSink, "write_file", "sink.write_file"),
        (posix.PosixSink, "sync_root", "sink.sync_root"), (dir_publish, "publish", "commit.publish"),
        (save_job, "log_saved", "log_summary"),
    ]:
        wrap(owner, attr, name)
    try:
        shutil.rmtree(target, ignore_errors=True)
        options = safe_ckpt.SaveOptions(staging_budget_bytes=budget, **opts)
        shared_pool(budget).preallocate()
        t_base[0] = time.perf_counter()
        if mode == "sync":
            result = safe_ckpt.save(state.make_sharded(), target, options=options)
        else:
            result = safe_ckpt.async_save(state.make_sharded(), target, options=options).wait()
        dt = time.perf_counter() - t_base[0]
    finally:
        for owner, attr, fn in reversed(saved):
            setattr(owner, attr, fn)
        shutil.rmtree(target, ignore_errors=True)
    t = result.timings
    phases = {k: {**v, "s": round(v["s"], 4)} for k, v in sorted(rows.items(), key=lambda kv: kv[1]["first_at_s"])}
    print(json.dumps({"case": "phases", "of": CASE[0], "total_s": round(dt, 4), "plan_s": round(t.plan_s, 4),
                      "write_s": round(t.write_s, 4), "commit_s": round(t.commit_s, 4), "phases": phases}), flush=True)
    return dt
