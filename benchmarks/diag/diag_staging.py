"""Where an asynchronous save of many small GPU shards spends its stall (GPU machine).

The qwen3-4b-dp8 preset (~1200 per-parameter optimizer pieces) stalled ~0.9 s against an
ideal of 0.13 s on the H200, while the anchor preset (20 large shards) stalls at the ideal.
This times, on one state: the staging loop alone (lease + device-to-host copy + event per
chunk, no writers), then `async_save` with the default options and with one factor changed
at a time (checksums off, one writer lane, blocking-sync events). Prints one JSON line per
measurement. Usage: python benchmarks/diag/diag_staging.py [--preset qwen3-4b-dp8] [--target DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time

import torch

import safe_ckpt
from safe_ckpt_lab.bench.state import build
from safe_ckpt.staging import stager as stager_mod
from safe_ckpt.staging.pool import shared_pool


def _stage_only(state, pool) -> dict:
    tensors = [t for t in state.plain.values() if t.is_cuda]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    st = stager_mod.Stager(pool)
    staged = [st.stage(t) for t in tensors]
    t1 = time.perf_counter()
    st.wait_copies()
    t2 = time.perf_counter()
    for s in staged:
        s.release()
    return {"chunks": len(tensors), "issue_s": t1 - t0, "staged_s": t2 - t0, "bytes": st.device_bytes}


def _async(state, target, **opts) -> dict:
    shutil.rmtree(target, ignore_errors=True)
    options = safe_ckpt.SaveOptions(staging_budget_bytes=state.device_bytes + (256 << 20), **opts)
    t0 = time.perf_counter()
    handle = safe_ckpt.async_save(state.make_sharded(), target, options=options)
    t1 = time.perf_counter()
    result = handle.wait()
    return {"stall_s": t1 - t0, "total_s": time.perf_counter() - t0, "write_s": result.timings.write_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-4b-dp8")
    ap.add_argument("--gib", type=float, default=None)
    ap.add_argument("--target", default="/dev/shm/safe_ckpt_diag")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    state = build(args.preset, args.gib, "gpu")
    pool = shared_pool(state.device_bytes + (256 << 20))
    pool.preallocate()
    print(json.dumps({"state": state.description}), flush=True)
    for _ in range(args.reps):
        print(json.dumps({"case": "stage_only", **_stage_only(state, pool)}), flush=True)
    plain_event = torch.cuda.Event
    cases = [("default", {}, False), ("no_checksums", {"checksums": False}, False),
             ("one_lane", {"io_threads": 1}, False), ("blocking_events", {}, True)]
    for name, opts, blocking in cases:
        stager_mod.torch.cuda.Event = (lambda **kw: plain_event(blocking=True, **kw)) if blocking else plain_event
        runs = [_async(state, args.target, **opts) for _ in range(args.reps)]
        stager_mod.torch.cuda.Event = plain_event
        print(json.dumps({"case": name, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}), flush=True)
    shutil.rmtree(args.target, ignore_errors=True)


if __name__ == "__main__":
    main()
