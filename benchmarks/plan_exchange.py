"""The planning step of a save at N ranks, timed on the real code path, per rank.

Each of N processes (a gloo group over a FileStore, all on this host) builds the sharded
state of one data-parallel rank of the ``qwen3-4b-dp8`` bench preset (1217 shards per rank:
its 1/8 of Qwen3-4B's bf16 weights and its fp32 optimizer buckets cut into per-parameter
pieces), with its tensors allocated but never touched (`torch.empty`: planning reads shapes
and residences, never bytes, so N x 7 GB of address space costs no memory). Then, for each
repetition, every rank runs `saving.start` (a save's collector hold, then `_Job.plan`):
collect, residence classification, rank 0 preparing the staging directory, the plan
exchange, `build_global_plan`, this rank's `lay_out_rank`, up to where the writers would
start (the writers are not started; the staging directory is removed). Then what comes
later, while the writers write, timed apart: every rank's layout (`lay_out`, for
`total_file_bytes`) and rank 0's index (`build_metadata`). Wall and CPU seconds
(`time.thread_time`) of each phase: on a host with fewer cores than ranks the wall time holds
the waits for a core, the CPU time does not. Phases are timed by wrapping the functions
`saving` calls; medians over the repetitions after the first (which also holds the group's
one-time host report exchange).

    PYTHONPATH=. python benchmarks/plan_exchange.py --ranks 8 --reps 5 --io-threads 2

Prints one JSON document: the machine (with the CPU seconds of a fixed Python loop before and
after, to scale by), the options, per rank and phase the median seconds, and the pickled
size of one rank's plan message.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PHASES = ("collect", "classify", "exchange", "build_global_plan", "lay_out_rank")


def qwen_state(rank: int, world: int) -> dict:
    """The qwen3-4b-dp8 preset's sharded state for ``rank`` of ``world``, contents untouched."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    from safe_ckpt_lab.bench import state as bench_state

    pieces = [(key, n, torch.bfloat16) for key, n in bench_state._weights_spec("qwen3-4b-dp8", 1.0, 8)]
    prefix = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32)"
    buckets = []
    for b, sizes in enumerate(bench_state._bucket_pieces("qwen3-4b-dp8", 1.0, 8)):
        for name in ("param", "exp_avg", "exp_avg_sq"):
            buckets.append((f"{prefix}.bucket_idx_{b}.{name}", sizes))
    out = {}
    for key, n, dtype in pieces:
        t = torch.empty(n, dtype=dtype)
        out[f"{key}@{n * rank}"] = ShardedTensor(key, t, dtype, (n,), (n * world,), (n * rank,),
                                                 axis_fragmentations=None, replica_id=0)
    for key, sizes in buckets:
        local, off = sum(sizes), 0
        for size in sizes:
            t = torch.empty(size, dtype=torch.float32)
            out[f"{key}@{local * rank + off}"] = ShardedTensor(
                key, t, torch.float32, (size,), (local * world,), (local * rank + off,), axis_fragmentations=None,
                replica_id=0)
            off += size
    out["param_groups"] = ShardedObject("optimizer.param_groups", {"lr": 1e-4, "step": 4}, (world,), (rank,))
    out["iteration"] = 4
    return out


class _Sampler:
    """While ``active`` is set, where the main thread is, every ``interval_s``: the innermost
    frames' places, counted, and the longest gap between two samples (a gap well over the
    interval: the sampler could not run, the GIL held elsewhere or the process off its core)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.active = threading.Event()
        self.counts: dict = {}
        self.max_gap_s = 0.0
        self.main = threading.main_thread().ident
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        last = None
        while True:
            self.active.wait()
            now = time.perf_counter()
            if last is not None and now - last < 10 * self.interval_s + 0.5:
                self.max_gap_s = max(self.max_gap_s, now - last)
            last = now
            frame = sys._current_frames().get(self.main)
            places = []
            while frame is not None and len(places) < 4:
                places.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}:{frame.f_code.co_name}")
                frame = frame.f_back
            key = " < ".join(places)
            self.counts[key] = self.counts.get(key, 0) + 1
            time.sleep(self.interval_s)
            if not self.active.is_set():
                last = None

    def report(self) -> dict:
        top = sorted(self.counts.items(), key=lambda kv: -kv[1])[:8]
        return {"interval_s": self.interval_s, "max_gap_s": self.max_gap_s, "top": top}


class _Collections:
    """The cyclic collector's passes between `start` and `stop` (`gc.callbacks`): their seconds
    in all, the longest, and the generation-2 passes, told apart by whether the save's heap
    freeze (`gcfreeze`) was in place when they ran."""

    def __init__(self) -> None:
        self.active = False
        self.passes: list = []
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info) -> None:
        if not self.active:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            from safe_ckpt.host import gcfreeze

            self.passes.append((info.get("generation"), time.perf_counter() - self._t0,
                                gcfreeze.FREEZER.frozen_by_us))

    def start(self) -> None:
        self.passes, self.active = [], True

    def stop(self) -> dict:
        from safe_ckpt.host import gcfreeze

        self.active = False
        full = [(s, frozen) for g, s, frozen in self.passes if g == 2]
        return {"gc_s": sum(s for _, s, _ in self.passes), "gc_longest_s": max((s for _, s, _ in self.passes), default=0.0),
                "gc_full_passes": len(full), "gc_full_passes_unfrozen": sum(1 for _, f in full if not f),
                "gc_full_s_unfrozen": sum(s for s, f in full if not f),
                "heap_frozen_after_start": float(gcfreeze.FREEZER.frozen_by_us), "freeze_count": float(gc.get_freeze_count())}


class _Timer:
    """Wraps the functions `saving` calls so each call's seconds land in ``times``."""

    def __init__(self) -> None:
        self.times: dict = {}

    def wrap(self, name, fn):
        def timed(*a, **kw):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                self.add(name, time.perf_counter() - t0, time.thread_time() - c0)
        return timed

    def add(self, name, wall_s, cpu_s):
        self.times[name] = self.times.get(name, 0.0) + wall_s
        self.times[f"{name}_cpu"] = self.times.get(f"{name}_cpu", 0.0) + cpu_s


def _rank(rank: int, world: int, init_file: str, target: str, args, out_queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import safe_ckpt
        from safe_ckpt.plan import agreement
        from safe_ckpt.saving import local_plan
        from safe_ckpt import saving
        from safe_ckpt.saving import job as save_job
        from safe_ckpt.encoding.layout import lay_out
        from safe_ckpt.encoding.metadata import build_metadata, metadata_bytes

        dist.init_process_group("gloo", init_method=init_file, rank=rank, world_size=world)
        state = qwen_state(rank, world)
        options = safe_ckpt.SaveOptions(io_threads=args.io_threads, chunk_bytes=args.chunk_mib << 20,
                                        collective_timeout_s=args.collective_timeout_s,
                                        staging_budget_bytes=args.chunk_mib << 20, progress_interval_s=0)
        timer = _Timer()
        collections = _Collections()
        for name, owner, attr in (("collect", local_plan, "collect"),
                                  ("build_global_plan", agreement, "build_global_plan"),
                                  ("lay_out_rank", save_job, "lay_out_rank"),
                                  ("classify", local_plan, "_classify")):
            setattr(owner, attr, timer.wrap(name, getattr(owner, attr)))
        sizes: dict = {}
        exchange = save_job.dist.Coordinator.exchange

        gather = dist.all_gather_object
        sampler = _Sampler(args.sample_ms / 1e3) if args.sample_ms else None

        def timed_exchange(self, stage, obj):
            if stage == "planning":
                sizes["message_bytes"] = len(pickle.dumps(obj))
                timer.times["exchange_entered_at"] = time.time()  # one clock for every rank of this host
                tasks0 = _task_cpu()
                t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
                dist.all_gather_object = timer.wrap("all_gather_object", gather)
                if sampler is not None:
                    sampler.active.set()
                try:
                    return exchange(self, stage, obj)
                finally:  # wall: includes the wait for the slowest rank to arrive
                    if sampler is not None:
                        sampler.active.clear()
                    dist.all_gather_object = gather
                    timer.add("exchange", time.perf_counter() - t0, time.thread_time() - c0)
                    timer.times["exchange_process_cpu"] = time.process_time() - p0  # every thread's, gloo's too
                    for name, cpu_s in _task_cpu(tasks0).items():  # by thread name: which threads besides this one
                        timer.times[f"exchange_thread_cpu[{name}]"] = cpu_s
                    timer.times["exchange_left_at"] = time.time()
            return exchange(self, stage, obj)

        save_job.dist.Coordinator.exchange = timed_exchange
        planned_at = {}
        save_job.SaveJob._start_writes = lambda self, *a: planned_at.__setitem__("t", time.perf_counter())
        rows, chunks = [], 0
        for rep in range(args.reps):
            timer.times = {}
            dist.barrier()
            c0 = time.thread_time()
            collections.start()
            job = saving.start(state, target, options=options)  # the entry a save takes, collector hold included
            plan_cpu_s = time.thread_time() - c0
            timer.times.update(collections.stop())  # (which walks the frozen heap: after the timing)
            row = {"plan_s": planned_at["t"] - job.t0, "plan_cpu_s": plan_cpu_s, **timer.times}
            chunks = len(job.planned.global_plan.chunks_of(rank))
            t0, c0 = time.perf_counter(), time.thread_time()
            layouts = lay_out(job.planned.global_plan)  # every rank, for total_file_bytes; built while the writers write
            row["all_layouts_s"], row["all_layouts_cpu_s"] = time.perf_counter() - t0, time.thread_time() - c0
            if rank == 0:  # and rank 0's index
                t0, c0 = time.perf_counter(), time.thread_time()
                metadata_bytes(build_metadata(job.planned.global_plan, layouts, target, job.planned.save_id))
                row["index_s"], row["index_cpu_s"] = time.perf_counter() - t0, time.thread_time() - c0
            job._abort()
            job.release()  # the gc hold and the process's save slot, as a finished save would
            rows.append(row)
            dist.barrier()
        keep = rows[1:] if len(rows) > 1 else rows
        medians = {k: statistics.median(r.get(k, 0.0) for r in keep) for k in rows[0] if not k.endswith("_at")}
        out_queue.put((rank, {"first": rows[0], "median": medians, "reps": len(keep),
                              "exchange_at": [(r["exchange_entered_at"], r["exchange_left_at"]) for r in keep],
                              "by_rep": {k: [round(r.get(k, 0.0), 4) for r in keep]
                                         for k in ("plan_s", "plan_cpu_s", "exchange", "exchange_cpu", "gc_s", "gc_full_passes", "gc_full_passes_unfrozen", "gc_full_s_unfrozen", "heap_frozen_after_start", "freeze_count")},
                              **({"samples": sampler.report()} if sampler is not None else {}),
                              "chunks": chunks, "shards": sum(1 for v in state.values() if hasattr(v, "local_shape")),
                              **sizes}))
        dist.destroy_process_group()
    except BaseException as exc:
        import traceback

        out_queue.put((rank, {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}))


def _task_cpu(since: dict | None = None) -> dict:
    """CPU seconds of each of this process's threads (Linux), by thread id; with ``since``,
    the seconds each thread name spent since then."""
    tick = os.sysconf("SC_CLK_TCK")
    now = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        now[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    if since is None:
        return now
    out: dict = {}
    for tid, (name, cpu_s) in now.items():
        out[name] = out.get(name, 0.0) + cpu_s - since.get(tid, (name, 0.0))[1]
    return {k: v for k, v in out.items() if v > 0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine() -> dict:
    cpus = len(os.sched_getaffinity(0))
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    mem = next((int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal")), 0)
    return {"cpus_usable": cpus, "cpu_model": model, "memory_bytes": mem, "python": sys.version.split()[0],
            "torch": torch.__version__}


def calibration_cpu_s() -> float:
    """CPU seconds of a fixed pure-Python loop (best of 5): what this host's CPU time per unit of
    interpreted work is at the time of the run, so runs on other hosts or loads can be scaled."""
    best = float("inf")
    for _ in range(5):
        c0 = time.thread_time()
        acc = 0
        for i in range(1_000_000):
            acc += i & 7
        best = min(best, time.thread_time() - c0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--io-threads", type=int, default=2)
    ap.add_argument("--chunk-mib", type=int, default=64)
    ap.add_argument("--label", default="", help="what code ran (e.g. a commit), copied into the output")
    ap.add_argument("--collective-timeout-s", type=float, default=600.0,
                    help="SaveOptions.collective_timeout_s: how long a rank waits for its peers or its save slot")
    ap.add_argument("--store", choices=("file", "tcp"), default="file",
                    help="the job's store: a FileStore in a temporary directory, or a TCPStore on rank 0 (as torchrun)")
    ap.add_argument("--sample-ms", type=float, default=0.0,
                    help="sample where each rank's main thread is during the planning exchange, every so many ms")
    args = ap.parse_args()
    host = {**machine(), "load_avg_at_start": os.getloadavg(), "calibration_cpu_s_at_start": calibration_cpu_s()}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}" if args.store == "file" else f"tcp://127.0.0.1:{_free_port()}"
        procs = [ctx.Process(target=_rank, args=(r, args.ranks, init, os.path.join(tmp, "ck"),
                                                 args, queue)) for r in range(args.ranks)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    errors = {r: v for r, v in results.items() if "error" in v}
    if errors:
        raise SystemExit(json.dumps(errors, indent=1))
    per_rank = [results[r] for r in range(args.ranks)]
    # Per repetition: how far apart the ranks entered the exchange, and how long the last to
    # enter stayed in it (what the collective itself took once every rank was there).
    spans = list(zip(*(r["exchange_at"] for r in per_rank)))
    arrival = {"arrival_spread_s": [max(e for e, _ in rep) - min(e for e, _ in rep) for rep in spans],
               "after_last_arrival_s": [max(x for _, x in rep) - max(e for e, _ in rep) for rep in spans]}
    summary = {k: max(r["median"].get(k, 0.0) for r in per_rank) for k in per_rank[0]["median"]}
    host.update(load_avg_at_end=os.getloadavg(), calibration_cpu_s_at_end=calibration_cpu_s())
    print(json.dumps({"label": args.label, "machine": host, "ranks": args.ranks, "io_threads": args.io_threads,
                      "chunk_bytes": args.chunk_mib << 20, "store": args.store, "slowest_rank_median_s": summary,
                      "exchange_arrivals": arrival,
                      "per_rank": per_rank}, indent=1))


if __name__ == "__main__":
    main()
