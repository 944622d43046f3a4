"""CPU benchmark: what each stored item costs, for states of many small tensors.

A distributed-optimizer rank holds hundreds to thousands of per-parameter pieces (1217 for
the qwen3-4b-dp8 preset), so per-item costs (planning, the torch.save container, the write
call, the checksum, the index and manifest) add up where the bytes are few. This saves one
state of ``--items`` host tensors of about ``--numel`` fp32 elements each (seeded random;
``--distinct`` gives every item its own length, as optimizer pieces have) to ``--target``
``--reps`` times, interleaving three runs per round in one process (repeated saves, as
training makes them):
- ``safe_ckpt``: `safe_ckpt.save` (its plan / write / commit split is reported too);
- ``dcp``: stock `torch.distributed.checkpoint.save` with `FileSystemWriter(thread_count=T,
  sync_files=True)` over the same tensors (the peer);
- ``ceiling``: T threads write each item's bytes with one `pwrite` per item, then fsync (the
  floor for that many write calls).
Reports medians and min-max, per-item microseconds, and ratios to the peer and the ceiling.
The first safe_ckpt checkpoint is loaded back with stock DCP and compared bit for bit.
Usage: python benchmarks/diag/item_overhead.py [--items 2000] [--numel 4096] [--distinct] [--out PREFIX]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import time

import torch

import safe_ckpt
from safe_ckpt_lab.bench.ceilings import run_lanes


def _state(items: int, numel: int, distinct: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    g = torch.Generator().manual_seed(1234)
    return {f"opt.p{i}": ShardedTensor.from_rank_offsets(
        f"opt.p{i}", torch.randn(numel + (i if distinct else 0), generator=g)) for i in range(items)}


def _fresh(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    return path


def _safe(state: dict, path: str, threads: int) -> dict:
    opts = safe_ckpt.SaveOptions(io_threads=threads, progress_interval_s=0)
    t0 = time.perf_counter()
    r = safe_ckpt.save(state, _fresh(path), options=opts)
    total = time.perf_counter() - t0
    t = r.timings
    return {"total_s": total, "plan_s": t.plan_s, "write_s": t.write_s, "commit_s": t.commit_s}


def _dcp(flat: dict, path: str, threads: int) -> dict:
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    dcp.save(flat, storage_writer=dcp.FileSystemWriter(_fresh(path), thread_count=threads, sync_files=True),
             no_dist=True)
    return {"total_s": time.perf_counter() - t0}


def _ceiling(flat: dict, path: str, threads: int) -> dict:
    os.makedirs(_fresh(path))
    tensors = list(flat.values())

    def lane(k: int) -> None:
        fd = os.open(os.path.join(path, f"f{k}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            offset = 0
            for t in tensors[k::threads]:
                view = memoryview(t.numpy()).cast("B")
                os.pwrite(fd, view, offset)
                offset += len(view)
            os.fsync(fd)
        finally:
            os.close(fd)

    return {"total_s": run_lanes(lane, threads)}


def _check(path: str, flat: dict) -> None:
    import torch.distributed.checkpoint as dcp

    loaded = {k: torch.empty_like(v) for k, v in flat.items()}
    dcp.load(loaded, checkpoint_id=path, no_dist=True)
    bad = [k for k, v in flat.items() if not torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8))]
    if bad:
        raise SystemExit(f"safe_ckpt checkpoint differs from the state at {len(bad)} keys, e.g. {bad[:3]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--numel", type=int, default=4096)
    ap.add_argument("--distinct", action="store_true", help="every item its own length")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--target", default="/dev/shm/safe_ckpt_items")
    ap.add_argument("--out", default="", help="write PREFIX.json and PREFIX.md")
    args = ap.parse_args()

    state = _state(args.items, args.numel, args.distinct)
    flat = {k: v.data for k, v in state.items()}
    nbytes = sum(t.numel() * t.element_size() for t in flat.values())
    runs: dict[str, list[dict]] = {"safe_ckpt": [], "dcp": [], "ceiling": []}
    savers = {"safe_ckpt": lambda p: _safe(state, p, args.threads), "dcp": lambda p: _dcp(flat, p, args.threads),
              "ceiling": lambda p: _ceiling(flat, p, args.threads)}
    for rep in range(args.reps + 1):  # round 0 warms up (imports, pools, caches) and is not counted
        for name, run in savers.items():
            out = run(os.path.join(args.target, name))
            if rep == 0 and name == "safe_ckpt":
                _check(os.path.join(args.target, name), flat)
            if rep:
                runs[name].append(out)
    shutil.rmtree(args.target, ignore_errors=True)

    def med(name, key="total_s"):
        return statistics.median(r[key] for r in runs[name])

    rows = []
    for name in runs:
        times = [r["total_s"] for r in runs[name]]
        row = {"saver": name, "median_s": med(name), "min_s": min(times), "max_s": max(times),
               "us_per_item": med(name) / args.items * 1e6, "vs_dcp": med("dcp") / med(name),
               "vs_ceiling": med("ceiling") / med(name)}
        if name == "safe_ckpt":
            row.update({k: med(name, k) for k in ("plan_s", "write_s", "commit_s")})
        rows.append(row)
    meta = {"machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}, "
                       f"torch {torch.__version__}", "items": args.items, "numel": args.numel,
            "distinct": args.distinct, "bytes": nbytes, "threads": args.threads, "reps": args.reps,
            "target": args.target}
    print(json.dumps(meta))
    for row in rows:
        print(json.dumps(row))
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        lines = [f"# Per-item cost: {args.items} items of ~{args.numel} fp32 "
                 f"({'distinct lengths' if args.distinct else 'one shape'}), {nbytes / 1e6:.1f} MB, "
                 f"{args.threads} threads, {args.target}", "", meta["machine"] + f"; {args.reps} runs each, "
                 "interleaved, after one warm-up round (median, [min-max])", "",
                 "| saver | s | us per item | vs DCP | vs ceiling | plan / write / commit s |",
                 "|---|---|---|---|---|---|"]
        for r in rows:
            split = (f"{r['plan_s']:.3f} / {r['write_s']:.3f} / {r['commit_s']:.3f}" if "plan_s" in r else "")
            lines.append(f"| {r['saver']} | {r['median_s']:.3f} [{r['min_s']:.3f}-{r['max_s']:.3f}] | "
                         f"{r['us_per_item']:.0f} | {r['vs_dcp']:.2f}x | {100 * r['vs_ceiling']:.0f}% | {split} |")
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
