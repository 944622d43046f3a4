"""What one all-gather of a plan-sized message costs at N ranks on this host, alone.

The planning exchange at 8 ranks held every rank of the H200 host 0.6-0.9 s against ~30 ms of
CPU on its saving thread. This times the gather alone, by message size and world size: torch's
`all_gather_object` on the default (gloo) group and on a second gloo group made with
`new_group` (as safe_ckpt's cached group is), and safe_ckpt's own gather of pickled objects as
int64 words (`dist._all_gather_objects`) on that second group. Beside each case's wall time, the
CPU seconds of the process's threads other than the caller's (gloo's worker threads, and any
OpenMP team they start, which takes their name). Payloads are seeded random bytes. Each case:
a barrier, then the operation, timed per rank; medians over the repetitions after the first;
the slowest rank's. With every rank entering together, neither gather showed the cost on the
H200 host (80 KB at 8 ranks: 5.6-6.3 ms and 2.7 ms); it showed inside the planning, with the
ranks a few ms apart and busy beside it (benchmarks/plan_exchange.py and its report,
benchmarks/results/plan_exchange_8ranks_qwen3-4b-dp8_2026-12-04.md).

    PYTHONPATH=. python benchmarks/diag/gather_probe.py --ranks 2 8 --reps 15

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES_BYTES = (8, 80 << 10, 800 << 10)


def _payload(rank: int, size_bytes: int) -> bytes:
    return random.Random(rank * 7919 + size_bytes).randbytes(size_bytes)


def _other_threads_cpu_s() -> float:
    """CPU seconds of this process's threads other than the calling one (Linux)."""
    me = threading.get_native_id()
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _cases(rank: int, world: int, reps: int) -> dict:
    from safe_ckpt.coord import dist as safe_dist

    second = dist.new_group(backend="gloo")
    out = {}
    for size in SIZES_BYTES:
        payload = _payload(rank, size)

        def torch_object(group):
            got = [None] * world
            dist.all_gather_object(got, payload, group=group)
            return got

        cases = {"all_gather_object_default_group": lambda: torch_object(None),
                 "all_gather_object_new_group": lambda: torch_object(second),
                 "safe_ckpt_gather_new_group": lambda: safe_dist._all_gather_objects(payload, second, world)}
        for name, fn in cases.items():
            walls, others = [], []
            for _ in range(reps):
                dist.barrier()
                c0, t0 = _other_threads_cpu_s(), time.perf_counter()
                got = fn()
                walls.append(time.perf_counter() - t0)
                others.append(_other_threads_cpu_s() - c0)
                assert got[rank] == payload and all(len(g) == size for g in got)
            out[f"{name}_{size}B_s"] = statistics.median(walls[1:])
            out[f"{name}_{size}B_other_threads_cpu_s"] = statistics.median(others[1:])
    return out


def _rank(rank: int, world: int, init: str, args, queue) -> None:
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        result = _cases(rank, world, args.reps)
        dist.barrier()  # rank 0 serves the TCPStore: it leaves last
        queue.put((rank, result))
        dist.destroy_process_group()
    except BaseException as exc:
        queue.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, world, init, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    errors = {r: v["error"] for r, v in results.items() if "error" in v}
    if errors:
        return {"errors": errors}
    return {k: max(results[r][k] for r in range(world)) for k in results[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    runs = {}
    for world in args.ranks:
        t0 = time.perf_counter()
        runs[f"{world}ranks"] = {"slowest_rank_median": run(world, args), "wall_s": time.perf_counter() - t0}
        print(f"{world} ranks: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(json.dumps({"cpus_usable": len(os.sched_getaffinity(0)), "load_avg": os.getloadavg(),
                      "python": sys.version.split()[0], "torch": torch.__version__, "reps": args.reps,
                      "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
