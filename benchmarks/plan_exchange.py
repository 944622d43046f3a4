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
import json
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PHASES = ("collect", "classify", "exchange", "build_global_plan", "lay_out_rank")


def qwen_state(rank: int, world: int) -> dict:
    """The qwen3-4b-dp8 preset's sharded state for ``rank`` of ``world``, contents untouched."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    from safe_ckpt.bench import state as bench_state

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
        from safe_ckpt import agreement, local_plan, saving
        from safe_ckpt.encoding.layout import lay_out
        from safe_ckpt.encoding.metadata import build_metadata, metadata_bytes

        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        state = qwen_state(rank, world)
        options = safe_ckpt.SaveOptions(io_threads=args.io_threads, chunk_bytes=args.chunk_mib << 20,
                                        collective_timeout_s=args.collective_timeout_s,
                                        staging_budget_bytes=args.chunk_mib << 20, progress_interval_s=0)
        timer = _Timer()
        for name, owner, attr in (("collect", local_plan, "collect"),
                                  ("build_global_plan", agreement, "build_global_plan"),
                                  ("lay_out_rank", saving, "lay_out_rank"),
                                  ("classify", local_plan, "_classify")):
            setattr(owner, attr, timer.wrap(name, getattr(owner, attr)))
        sizes: dict = {}
        exchange = saving.dist.Coordinator.exchange

        def timed_exchange(self, stage, obj):
            if stage == "planning":
                sizes["message_bytes"] = len(pickle.dumps(obj))
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    return exchange(self, stage, obj)
                finally:  # wall: includes the wait for the slowest rank to arrive
                    timer.add("exchange", time.perf_counter() - t0, time.thread_time() - c0)
            return exchange(self, stage, obj)

        saving.dist.Coordinator.exchange = timed_exchange
        saving._Job._start_writes = lambda self, *a: setattr(self, "t_planned", time.perf_counter())
        rows, chunks = [], 0
        for rep in range(args.reps):
            timer.times = {}
            dist.barrier()
            c0 = time.thread_time()
            job = saving.start(state, target, options=options)  # the entry a save takes, collector hold included
            row = {"plan_s": job.t_planned - job.t0, "plan_cpu_s": time.thread_time() - c0, **timer.times}
            chunks = len(job.global_plan.chunks_of(rank))
            t0, c0 = time.perf_counter(), time.thread_time()
            layouts = lay_out(job.global_plan)  # every rank, for total_file_bytes; built while the writers write
            row["all_layouts_s"], row["all_layouts_cpu_s"] = time.perf_counter() - t0, time.thread_time() - c0
            if rank == 0:  # and rank 0's index
                t0, c0 = time.perf_counter(), time.thread_time()
                metadata_bytes(build_metadata(job.global_plan, layouts, target, job.save_id))
                row["index_s"], row["index_cpu_s"] = time.perf_counter() - t0, time.thread_time() - c0
            job._abort()
            job.release()  # the gc hold and the process's save slot, as a finished save would
            rows.append(row)
            dist.barrier()
        keep = rows[1:] if len(rows) > 1 else rows
        medians = {k: statistics.median(r.get(k, 0.0) for r in keep) for k in rows[0]}
        out_queue.put((rank, {"first": rows[0], "median": medians, "reps": len(keep),
                              "chunks": chunks, "shards": sum(1 for v in state.values() if hasattr(v, "local_shape")),
                              **sizes}))
        dist.destroy_process_group()
    except BaseException as exc:
        import traceback

        out_queue.put((rank, {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}))


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
    args = ap.parse_args()
    host = {**machine(), "load_avg_at_start": os.getloadavg(), "calibration_cpu_s_at_start": calibration_cpu_s()}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, args.ranks, os.path.join(tmp, "store"), os.path.join(tmp, "ck"),
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
    summary = {k: max(r["median"].get(k, 0.0) for r in per_rank) for k in per_rank[0]["median"]}
    host.update(load_avg_at_end=os.getloadavg(), calibration_cpu_s_at_end=calibration_cpu_s())
    print(json.dumps({"label": args.label, "machine": host, "ranks": args.ranks, "io_threads": args.io_threads,
                      "chunk_bytes": args.chunk_mib << 20, "slowest_rank_median_s": summary,
                      "per_rank": per_rank}, indent=1))


if __name__ == "__main__":
    main()
