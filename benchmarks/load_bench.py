"""Load benchmark: `safe_ckpt.load` against stock Megatron load, DCP load and a plain read ceiling.

What it measures, in one run on one host (N ranks joined by gloo, one process each; on a GPU
host every rank's templates live on the GPU it is given, `--share-gpu` puts all on device 0):
- the state of `safe_ckpt_lab.bench.state` (presets `anchor`, 8.6 GiB at full size, 20 shards, and
  `qwen3-4b-dp8`, one of 8 data-parallel ranks of Qwen3-4B, 1217 shards), saved once by
  safe_ckpt into `--target`, then loaded into fresh templates of the same layout (`empty_like`
  of every shard: GPU tensors on a GPU host, else host memory, pinned with `--pin`) by
  - `safe`: `safe_ckpt.load` (checksums verified), and `safe_nosum` (verify_checksums=False);
  - `stock`: `megatron.core.dist_checkpointing.load` with its default strategy;
  - `dcp`: `torch.distributed.checkpoint.load` of the same shards as Megatron translates them
    (its `mcore_to_pyt_state_dict` and `MCoreLoadPlanner`), without Megatron's other steps;
  - `ceiling`: the same threads `preadv`-ing every byte of this rank's files into one reused
    host buffer (no parsing, no device copy): what reading alone takes;
- with `--cold`, each file of the checkpoint is evicted from the page cache
  (`posix_fadvise(DONTNEED)`, no privileges needed; pages of a tmpfs cannot be evicted) before
  every timed run; otherwise the page cache is warm after the first run;
- each run's time is the slowest rank's (a barrier before, device synchronize and barrier
  after); every load is compared bit for bit with the saved tensors (a mismatch fails the run).
Methods run in turn within a round (`--reps` rounds), so drifts hit all alike.

Run (from the repository root):
    python benchmarks/load_bench.py --gib 1.5 --target /dev/shm/lb           # CPU, 1 rank
    python benchmarks/load_bench.py --preset qwen3-4b-dp8 --ranks 8 --share-gpu --target /dev/shm/lb
Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time

import torch

METHODS = ("ceiling", "safe", "safe_nosum", "stock", "dcp")


def _evict(path: str) -> bool:
    ok = True
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            fd = os.open(full, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                ok = False
            finally:
                os.close(fd)
    return ok


def _ceiling(path: str, rank: int, threads: int) -> int:
    """Read every byte of this rank's files with ``threads`` threads, 8 MiB at a time."""
    files = [os.path.join(path, n) for n in sorted(os.listdir(path)) if n.startswith(f"__{rank}_")]
    pieces = []
    for f in files:
        size = os.path.getsize(f)
        pieces += [(f, at, min(8 << 20, size - at)) for at in range(0, size, 8 << 20)]
    lock, nxt, total = threading.Lock(), [0], [0]

    def work():
        buf = bytearray(8 << 20)
        fds = {}
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(pieces):
                break
            f, at, n = pieces[i]
            fd = fds.get(f) or fds.setdefault(f, os.open(f, os.O_RDONLY))
            got = os.preadv(fd, [memoryview(buf)[:n]], at)
            with lock:
                total[0] += got
        for fd in fds.values():
            os.close(fd)

    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return total[0]


def _dcp_load(template: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    flat, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(extract_sharded_base(template)[0])
    pyt = mcore_torch.mcore_to_pyt_state_dict(flat, True)
    dcp.load(pyt, storage_reader=dcp.FileSystemReader(path), planner=mcore_torch.MCoreLoadPlanner())


def _rank(rank: int, world: int, init_file: str, args, out_queue) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        out_queue.put((rank, "ok", _measure(rank, world, args)))
    except BaseException as exc:
        import traceback

        out_queue.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1) from exc
    finally:
        dist.destroy_process_group()


def _measure(rank: int, world: int, args) -> dict:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    import safe_ckpt
    from safe_ckpt_lab.bench.state import build

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0 if args.share_gpu else rank % torch.cuda.device_count())
    state = build(args.preset, args.gib, "gpu", rank, world, seed=args.seed, keep_shards=args.keep_shards)
    path = os.path.join(args.target, "ckpt")
    safe_ckpt.save(state.make_sharded(), path, options=safe_ckpt.SaveOptions(io_threads=args.threads))
    originals = {k: v.data for k, v in state.make_sharded().items() if isinstance(v, ShardedTensor)}
    templates = {k: torch.empty_like(t) for k, t in originals.items()}
    if args.pin and not cuda:
        raise SystemExit("--pin needs CUDA")
    if args.pin:
        templates = {k: t.cpu().pin_memory() for k, t in templates.items()}

    def sharded():
        out = state.make_sharded()
        for k, v in out.items():
            if isinstance(v, ShardedTensor):
                v.data = templates[k]
        return out

    def check() -> int:
        bad = sum(not torch.equal(templates[k].reshape(-1).view(torch.uint8),
                                  originals[k].to(templates[k].device).reshape(-1).view(torch.uint8))
                  for k in originals)
        for t in templates.values():
            t.reshape(-1).view(torch.uint8).fill_(0xA5)  # the next load must write every byte again
        return bad

    reports: list = []
    opts = safe_ckpt.LoadOptions(io_threads=args.threads, on_read=reports.append)
    opts_nosum = safe_ckpt.LoadOptions(io_threads=args.threads, verify_checksums=False)
    runs = {
        "ceiling": lambda: _ceiling(path, rank, args.threads),
        "safe": lambda: safe_ckpt.load(sharded(), path, opts),
        "safe_nosum": lambda: safe_ckpt.load(sharded(), path, opts_nosum),
        "stock": lambda: dist_checkpointing.load(sharded(), path),
        "dcp": lambda: _dcp_load(sharded(), path),
    }
    methods = [m for m in args.methods.split(",") if m]
    rows = []
    check()
    for rep in range(args.reps):
        for m in methods:
            evicted = None
            if args.cold:
                dist.barrier()
                if rank == 0:
                    evicted = _evict(path)
            dist.barrier()
            t0 = time.perf_counter()
            runs[m]()
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            slowest = torch.tensor([seconds], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            bad = 0 if m == "ceiling" else check()
            bad_all = torch.tensor([bad])
            dist.all_reduce(bad_all)
            if int(bad_all) and rank == 0:
                raise SystemExit(f"{m}: {int(bad_all)} tensors differ from what was saved")
            rows.append({"rep": rep, "method": m, "seconds": float(slowest), "rank_seconds": seconds,
                         "evicted": evicted, "mismatched": int(bad_all)})
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return {"rows": rows, "bytes": state.nbytes, "description": state.description,
            "report": reports[-1].__dict__ if reports else None}


def _table(result: dict, world: int) -> str:
    by = {}
    for r in result["rows"]:
        by.setdefault(r["method"], []).append(r["seconds"])
    total = result["bytes"] * world
    ceiling = statistics.median(by["ceiling"]) if "ceiling" in by else None
    stock = statistics.median(by["stock"]) if "stock" in by else None
    lines = ["| method | median s | best s | GB/s (median) | of ceiling | vs stock |", "|---|---|---|---|---|---|"]
    for m in METHODS:
        if m not in by:
            continue
        med = statistics.median(by[m])
        lines.append(f"| {m} | {med:.3f} | {min(by[m]):.3f} | {total / med / 1e9:.2f} | "
                     f"{f'{ceiling / med:.0%}' if ceiling else '-'} | {f'{stock / med:.2f}x' if stock else '-'} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="anchor", choices=("anchor", "qwen3-4b-dp8"))
    p.add_argument("--gib", type=float, default=None, help="state size per rank (default: the preset's)")
    p.add_argument("--keep-shards", action="store_true",
                   help="with --gib, keep the preset's shard count (smaller shards) instead of fewer shards")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--share-gpu", action="store_true", help="every rank on GPU 0")
    p.add_argument("--pin", action="store_true", help="pinned host templates (GPU host only)")
    p.add_argument("--target", required=True, help="directory the checkpoint is saved into (removed after)")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cold", action="store_true", help="evict the checkpoint's files from the page cache first")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output prefix (default benchmarks/results/load_<host>_<date>)")
    args = p.parse_args()

    import torch.multiprocessing as mp

    os.makedirs(args.target, exist_ok=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, args.ranks, os.path.join(tmp, "store"), args, q))
                 for r in range(args.ranks)]
        for pr in procs:
            pr.start()
        results = {}
        while len(results) < args.ranks:
            rank, status, value = q.get()
            if status != "ok":
                print(f"rank {rank} failed:\n{value}", file=sys.stderr)
                for pr in procs:
                    pr.kill()
                raise SystemExit(1)
            results[rank] = value
        for pr in procs:
            pr.join()
    result = results[0]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    head = (f"# Load: {result['description']}, {args.ranks} rank(s), {args.threads} threads, "
            f"{'cold' if args.cold else 'warm'} page cache, target {args.target}\n\n"
            f"Host {socket.gethostname()} ({device}, {os.cpu_count()} cores), torch {torch.__version__}, "
            f"{datetime.date.today()}; {args.reps} rounds; times are the slowest rank's; every load bit-exact.\n")
    table = _table(result, args.ranks)
    report = result.get("report")
    tail = (f"\nsafe_ckpt's last read on rank 0: {report['items']} items, {report['verified']} checksums verified, "
            f"{report['decoded']} decoded by torch.load, {report['threads']} threads.\n") if report else ""
    text = head + "\n" + table + "\n" + tail
    print(text)
    out = args.out or os.path.join("benchmarks", "results", f"load_{socket.gethostname()}_{datetime.date.today()}")
    with open(out + ".json", "w") as f:
        json.dump({"args": vars(args), "result": result}, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
