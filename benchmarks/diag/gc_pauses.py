"""Garbage-collector pauses during a save of many items, with and without `gc_freeze`.

A save allocates tens of Python objects per stored item; in a process holding torch and
megatron-core (and, in training, far more), the generation-2 collections that triggers
walk the whole heap. This saves the same state of ``--items`` host tensors (seeded random,
256 KiB each by default) to ``--target`` ``--reps`` times per setting, alternating, and
reports per setting the median save time and every collector pause above 5 ms (measured
with `gc.callbacks`). Usage: python benchmarks/diag/gc_pauses.py [--items 2000] [--target /dev/shm/x]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import time

import torch

import safe_ckpt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--numel", type=int, default=64 * 1024)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--target", default="/dev/shm/safe_ckpt_gc")
    args = ap.parse_args()
    from megatron.core.dist_checkpointing import ShardedTensor

    g = torch.Generator().manual_seed(0)
    state = {f"p{i}": ShardedTensor.from_rank_offsets(f"p{i}", torch.randn(args.numel, generator=g))
             for i in range(args.items)}
    events: list = []
    gc.callbacks.append(lambda phase, info: events.append((phase, info["generation"], time.perf_counter())))
    runs = {True: [], False: []}
    for rep in range(args.reps):
        for freeze in (False, True) if rep % 2 == 0 else (True, False):
            shutil.rmtree(args.target, ignore_errors=True)
            opts = safe_ckpt.SaveOptions(io_threads=2, progress_interval_s=0, gc_freeze=freeze)
            events.clear()
            t0 = time.perf_counter()
            safe_ckpt.save(state, args.target, options=opts)
            total = time.perf_counter() - t0
            pauses = [(gen, (b - a) * 1e3) for (_, gen, a), (_, _, b) in zip(events[::2], events[1::2])]
            runs[freeze].append({"total_s": total, "collections": len(pauses),
                                 "pauses_over_5ms": [(gen, round(ms, 1)) for gen, ms in pauses if ms > 5]})
    shutil.rmtree(args.target, ignore_errors=True)
    print(json.dumps({"machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
                      f"Python {platform.python_version()}, torch {torch.__version__}",
                      "items": args.items, "item_bytes": args.numel * 4, "target": args.target}))
    for freeze, rows in runs.items():
        print(json.dumps({"gc_freeze": freeze, "median_total_s": round(statistics.median(r["total_s"] for r in rows), 3),
                          "max_total_s": round(max(r["total_s"] for r in rows), 3),
                          "saves_with_pause_over_5ms": sum(bool(r["pauses_over_5ms"]) for r in rows),
                          "runs": rows}))


if __name__ == "__main__":
    main()
