"""CPU benchmark: the training thread's time in an overlapped save's call and in its window's opening.

An async save with ``return_after="planned"`` returns right after planning; its copy window opens
at the next trigger (`staging.gates.open_deferred`, the drop-in's next ``zero_grad``). Both run in
the training thread. This saves one bench state (`safe_ckpt_lab.bench.state`, default the
qwen3-4b-dp8 preset shrunk with its 1217 shards kept) ``--reps`` times in one process, as training
does (the same sharded state dict each time, built fresh by its factory), and times, per save, the
call (`saving.start(..., copy_start="deferred").in_background()`) and the opening, each waiting for
the previous save to end first (untimed). Reports medians and min-max of the saves after the
first (the first plans from scratch) and, with ``--profile PREFIX``, a cProfile of every timed
call and opening (PREFIX_call.txt, PREFIX_open.txt). ``--gloo`` runs it in a one-rank gloo group,
as a Megatron process would (the plan messages are pickled through the collective).
Usage: PYTHONPATH=$PWD python benchmarks/diag/call_overhead.py [--gib 0.05] [--reps 30] [--gloo]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import tempfile
import time


def _stats(xs: list[float]) -> dict:
    return {"median_ms": 1e3 * statistics.median(xs), "min_ms": 1e3 * min(xs), "max_ms": 1e3 * max(xs), "n": len(xs)}


def _dump(profile: cProfile.Profile, path: str) -> None:
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)
    with open(path, "w") as f:
        f.write(text.getvalue())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-4b-dp8")
    p.add_argument("--gib", type=float, default=0.05)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--target", default="/dev/shm/safe_ckpt_call")
    p.add_argument("--gloo", action="store_true", help="in a one-rank gloo group")
    p.add_argument("--profile", default="", help="write PREFIX_call.txt and PREFIX_open.txt")
    p.add_argument("--out", default="", help="write the numbers to this JSON file")
    args = p.parse_args()

    import torch

    import safe_ckpt
    from safe_ckpt import saving
    from safe_ckpt.staging import gates
    from safe_ckpt_lab.bench.state import build

    if args.gloo:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    state = build(args.preset, gib=args.gib, keep_shards=True)
    opts = safe_ckpt.SaveOptions(return_after="planned", fsync=False, progress_interval_s=0, io_threads=2)
    profiles = {"call": cProfile.Profile(), "open": cProfile.Profile()} if args.profile else {}
    calls, opens = [], []
    root = tempfile.mkdtemp(dir=os.path.dirname(args.target.rstrip("/")) or ".",
                            prefix=os.path.basename(args.target.rstrip("/")) + "_")
    try:
        for k in range(args.reps + 1):
            sharded = state.make_sharded()
            path = os.path.join(root, f"s{k}")
            prof_call, prof_open = (profiles["call"], profiles["open"]) if profiles and k else (None, None)
            t0 = time.perf_counter()
            if prof_call is not None:
                prof_call.enable()
            handle = saving.start(sharded, path, options=opts, asynchronous=True,
                                  copy_start="deferred").in_background()
            if prof_call is not None:
                prof_call.disable()
            t1 = time.perf_counter()
            if prof_open is not None:
                prof_open.enable()
            gates.open_deferred()
            if prof_open is not None:
                prof_open.disable()
            t2 = time.perf_counter()
            handle.wait()
            shutil.rmtree(path, ignore_errors=True)
            if k:
                calls.append(t1 - t0)
                opens.append(t2 - t1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {"state": state.description, "gloo": args.gloo, "call": _stats(calls), "open": _stats(opens),
           "stall": _stats([a + b for a, b in zip(calls, opens)])}
    for name, prof in profiles.items():
        _dump(prof, f"{args.profile}_{name}.txt")
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
