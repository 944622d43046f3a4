"""Load benchmark: `safe_ckpt.load` against stock Megatron load, DCP load and a plain read ceiling.

What it measures, in one run on one host (N ranks joined by gloo, one process each; on a GPU
host every rank's templates live on the GPU it is given, `--share-gpu` puts all on device 0):
- the state of `safe_ckpt_lab.bench.state` (presets `anchor`, 8.6 GiB at full size, 20 shards, and
  `qwen3-4b-dp8`, one of 8 data-parallel ranks of Qwen3-4B, 1217 shards), saved once by
  safe_ckpt into `--target`, then loaded into fresh templates of the same layout (`empty_like`
  of every shard: GPU tensors on a GPU host, else host memory, pinned with `--pin`) by
  - `safe`: `safe_ckpt.load` (checksums verified), `safe_nosum` (verify_checksums=False), and
    `safe_torchcopy` (a diagnostic: every host-to-device copy through torch's `copy_`, not the driver),
    `safe_switch` (a diagnostic: the interpreter's switch interval at 0.2 ms, not 5 ms);
  - `stock`: `megatron.core.dist_checkpointing.load` with its default strategy;
  - `dcp`: `torch.distributed.checkpoint.load` of the same shards as Megatron translates them
    (its `mcore_to_pyt_state_dict` and `MCoreLoadPlanner`), without Megatron's other steps;
  - `ceiling`: the same threads `preadv`-ing every byte of this rank's files into one reused
    host buffer (no parsing, no device copy): what reading alone takes;
  - `ceiling_gpu` (GPU hosts): the same threads reading the same 8 MiB ranges into two pinned
    buffers each, in turn, each copied to its place in one GPU byte tensor on the thread's own
    stream while the next range is read: what reading into GPU memory takes (no parsing, no
    checksums);
- with `--cold`, the checkpoint's pages leave the page cache before every timed run (what stays cached is
  counted with mincore and reported): all of it
  through `/proc/sys/vm/drop_caches` where the process may write it (root, writable /proc/sys),
  else each file with `posix_fadvise(DONTNEED)` (after a sync); the report names which one ran,
  or that neither could (pages of a tmpfs cannot be dropped: there it is always warm);
  otherwise the page cache is warm after the first run;
- each run's time is the slowest rank's (a barrier before, device synchronize and barrier
  after), and each rank's own time is kept too (per-rank medians in the report); every load is
  compared bit for bit with the saved tensors (a mismatch fails the run);
- the report names the machine (host, GPU, CPU, cores, memory), the commit (`--commit`, else
  `git rev-parse`), the target's filesystem, and gives medians with [min-max] and ratios to the
  read ceiling, stock Megatron load and DCP load.
Methods run in turn within a round (`--reps` rounds), so drifts hit all alike.

Run (from the repository root):
    python benchmarks/load_bench.py --gib 1.5 --target /dev/shm/lb           # CPU, 1 rank
    python benchmarks/load_bench.py --preset qwen3-4b-dp8 --ranks 8 --share-gpu --target /dev/shm/lb
    python benchmarks/load_bench.py --preset qwen3-4b-dp8 --gib 0.5 --keep-shards --target /dev/shm/lb  # small host
    python benchmarks/load_bench.py --gib 8.6 --cold --target /var/tmp/lb                   # disk, cache dropped
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
import subprocess
import sys
import tempfile
import threading
import time

import torch

METHODS = ("ceiling", "ceiling_gpu", "safe", "safe_nosum", "safe_torchcopy", "safe_switch", "stock", "dcp")
PIECE = 8 << 20


def _evict(path: str) -> bool:
    ok = True
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            fd = os.open(full, os.O_RDONLY)
            try:
                os.fdatasync(fd)  # dirty pages are not dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                ok = False
            finally:
                os.close(fd)
    return ok


def _drop_cache(path: str, fs: str) -> str:
    """Drop the checkpoint's pages from the page cache; returns how (or why not)."""
    if fs == "tmpfs":
        return "none (tmpfs)"
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        return "fadvise" if _evict(path) else "none (fadvise failed)"


def _resident_fraction(path: str) -> float | None:
    """The share of the checkpoint's file pages in the page cache now (mincore), None where it cannot tell."""
    import ctypes
    import mmap

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                                 ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    except (OSError, AttributeError):
        return None
    page, resident, total = mmap.PAGESIZE, 0, 0
    for name in os.listdir(path):
        full = os.path.join(path, name)
        size = os.path.getsize(full) if os.path.isfile(full) else 0
        if size == 0:
            continue
        fd = os.open(full, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            pages = (size + page - 1) // page
            vec = ctypes.create_string_buffer(pages)
            ok = libc.mincore(ctypes.c_void_p(addr), size, vec) == 0
            libc.munmap(ctypes.c_void_p(addr), size)
            if not ok:
                return None
            resident += sum(b & 1 for b in vec.raw)
            total += pages
        finally:
            os.close(fd)
    return resident / total if total else None


def _filesystem(path: str) -> str:
    """The type of the filesystem ``path`` lies on (the longest mount point above it)."""
    real, best, kind = os.path.realpath(path), "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) \
                        and len(parts[1]) >= len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def _ranges(path: str, rank: int) -> list:
    """(file, offset, length, place in the rank's bytes) of every 8 MiB range of this rank's files."""
    files = [os.path.join(path, n) for n in sorted(os.listdir(path)) if n.startswith(f"__{rank}_")]
    pieces, place = [], 0
    for f in files:
        size = os.path.getsize(f)
        pieces += [(f, at, min(PIECE, size - at), place + at) for at in range(0, size, PIECE)]
        place += size
    return pieces


def _ceiling(pieces: list, threads: int, gpu=None) -> int:
    """Read every range with ``threads`` threads; with ``gpu`` (per-thread pairs of pinned buffers and
    one GPU byte tensor), each range through a pinned buffer into its place on the GPU."""
    lock, nxt, total = threading.Lock(), [0], [0]

    def work(k: int):
        bufs = [bytearray(PIECE)] if gpu is None else gpu["pinned"][k]
        stream = None
        if gpu is not None:  # a new thread's current device is device 0: name the destination's
            torch.cuda.set_device(gpu["dest"].device)
            stream = torch.cuda.Stream(device=gpu["dest"].device)
        events, turn, fds = [None, None], 0, {}
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(pieces):
                break
            f, at, n, place = pieces[i]
            fd = fds.get(f) or fds.setdefault(f, os.open(f, os.O_RDONLY))
            if gpu is None:
                got = os.preadv(fd, [memoryview(bufs[0])[:n]], at)
            else:
                if events[turn] is not None:
                    events[turn].synchronize()
                buf = bufs[turn]
                got = os.preadv(fd, [memoryview(buf.numpy())[:n]], at)
                with torch.cuda.stream(stream):
                    gpu["dest"][place:place + n].copy_(buf[:n], non_blocking=True)
                    events[turn] = torch.cuda.Event()
                    events[turn].record(stream)
                turn ^= 1
            with lock:
                total[0] += got
        if stream is not None:
            stream.synchronize()
        for fd in fds.values():
            os.close(fd)

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
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


def _without_driver_copies(load):
    """``load()`` with every host-to-device copy issued through torch's ``copy_`` (a diagnostic)."""
    from safe_ckpt import cuda_driver

    stock = cuda_driver.htod_copies_available
    cuda_driver.htod_copies_available = lambda: False
    try:
        return load()
    finally:
        cuda_driver.htod_copies_available = stock


def _switching_often(load):
    """``load()`` with the interpreter's switch interval at 0.2 ms instead of 5 ms (a diagnostic: a
    thread back from a call that gave up the GIL waits at most that long before asking for it)."""
    stock = sys.getswitchinterval()
    sys.setswitchinterval(0.0002)
    try:
        return load()
    finally:
        sys.setswitchinterval(stock)


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
    opts_nosum = safe_ckpt.LoadOptions(io_threads=args.threads, verify_checksums=False, on_read=reports.append)
    pieces = _ranges(path, rank)
    gpu = None
    if cuda and "ceiling_gpu" in args.methods:
        gpu = {"pinned": [[torch.empty(PIECE, dtype=torch.uint8).pin_memory() for _ in range(2)]
                          for _ in range(args.threads)],
               "dest": torch.empty(max((p[3] + p[2] for p in pieces), default=0), dtype=torch.uint8, device="cuda")}
    runs = {
        "ceiling": lambda: _ceiling(pieces, args.threads),
        "ceiling_gpu": lambda: _ceiling(pieces, args.threads, gpu),
        "safe": lambda: safe_ckpt.load(sharded(), path, opts),
        "safe_nosum": lambda: safe_ckpt.load(sharded(), path, opts_nosum),
        "safe_torchcopy": lambda: _without_driver_copies(lambda: safe_ckpt.load(sharded(), path, opts)),
        "safe_switch": lambda: _switching_often(lambda: safe_ckpt.load(sharded(), path, opts)),
        "stock": lambda: dist_checkpointing.load(sharded(), path),
        "dcp": lambda: _dcp_load(sharded(), path),
    }
    methods = [m for m in args.methods.split(",") if m and (m != "ceiling_gpu" or cuda)]
    rows = []
    check()
    fs = _filesystem(path)
    for rep in range(args.reps):
        for m in methods:
            evicted = None
            if args.cold:
                dist.barrier()
                if rank == 0:
                    evicted = _drop_cache(path, fs)
                    left = _resident_fraction(path)  # what the drop left cached (mincore)
                    evicted += f", {left:.1%} still cached" if left is not None else ", residency unknown"
            dist.barrier()
            t0 = time.perf_counter()
            runs[m]()
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            slowest = torch.tensor([seconds], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            bad = 0 if m.startswith("ceiling") else check()
            bad_all = torch.tensor([bad])
            dist.all_reduce(bad_all)
            if int(bad_all) and rank == 0:
                raise SystemExit(f"{m}: {int(bad_all)} tensors differ from what was saved")
            last = reports[-1] if m.startswith("safe") and reports else None
            read_s = last.seconds if last else None  # this rank's reads alone
            rows.append({"rep": rep, "method": m, "seconds": float(slowest), "rank_seconds": seconds,
                         "read_seconds": read_s, "evicted": evicted, "mismatched": int(bad_all),
                         "thread_s": _thread_seconds(last) if last else None})
    if args.profile and "safe" in methods:  # after the timed rounds: one more load, profiled, not timed
        from safe_ckpt_lab.diag.load_profile import profiled

        out = args.out or os.path.join("benchmarks", "results", f"load_{socket.gethostname()}_{datetime.date.today()}")
        with profiled(f"{out}.rank{rank}.profile.txt"):
            runs["safe"]()
        if cuda:
            torch.cuda.synchronize()
        if check():
            raise SystemExit("safe (profiled): tensors differ from what was saved")
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return {"rows": rows, "bytes": state.nbytes, "description": state.description, "filesystem": fs,
            "report": reports[-1].__dict__ if reports else None}


THREAD_KEYS = ("read_s", "wait_s", "hash_s", "copy_s", "other_s", "cpu_s", "check_s")


def _thread_seconds(report) -> dict:
    """Where the reader threads' time went, summed over them; ``other_s``: the rest of threads x read
    phase (Python between the calls, waiting for the GIL, thread start and end)."""
    out = {k: getattr(report, k, 0.0) for k in ("read_s", "wait_s", "hash_s", "copy_s")}
    out["other_s"] = max(0.0, report.threads * report.seconds - sum(out.values()))
    out["cpu_s"] = getattr(report, "cpu_s", 0.0)  # of all the above: on a CPU (not waiting for the GIL or the device)
    out["check_s"] = getattr(report, "check_s", 0.0)  # the calling thread, after the threads: the device sums compared
    return out


def _span(xs: list) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def _table(results: dict, world: int) -> str:
    """Slowest-rank medians [min-max] with ratios; with several ranks, each rank's own medians too."""
    by = {}
    for r in results[0]["rows"]:
        by.setdefault(r["method"], []).append(r["seconds"])
    total = sum(results[k]["bytes"] for k in results)
    med = {m: statistics.median(v) for m, v in by.items()}

    def ratio(m, ref, fmt):
        return fmt(med[ref] / med[m]) if ref in med else "-"

    lines = ["| method | median [min-max] s | GB/s (median) | of ceiling | of GPU ceiling | vs stock | vs DCP |",
             "|---|---|---|---|---|---|---|"]
    for m in METHODS:
        if m in by:
            lines.append(f"| {m} | {_span(by[m])} | {total / med[m] / 1e9:.2f} | {ratio(m, 'ceiling', '{:.0%}'.format)} "
                         f"| {ratio(m, 'ceiling_gpu', '{:.0%}'.format)} "
                         f"| {ratio(m, 'stock', '{:.2f}x'.format)} | {ratio(m, 'dcp', '{:.2f}x'.format)} |")
    for m in ("safe", "safe_nosum", "safe_torchcopy", "safe_switch"):
        spent = [r["thread_s"] for r in results[0]["rows"] if r["method"] == m and r.get("thread_s")]
        phase = [r["read_seconds"] for r in results[0]["rows"] if r["method"] == m and r.get("read_seconds")]
        if spent:
            lines.append(f"\n{m}, rank 0, read phase {_span(phase)} s of the load; thread seconds (summed over its "
                         f"threads; median over rounds): " + ", ".join(
                f"{k[:-2]} {statistics.median(x.get(k, 0.0) for x in spent):.3f}" for k in THREAD_KEYS))
    if world > 1:
        lines += ["", f"Each rank's own time (median over rounds), {world} ranks: median [min-max] across ranks "
                      f"(a load is collective: its ranks end together; safe_ckpt's read phase alone is per rank), "
                      f"and the aggregate over all ranks' bytes by the slowest rank's time above.", "",
                  "| method | per-rank median s [min-max across ranks] | read phase s [min-max across ranks] "
                  "| per-rank GB/s (median rank) | aggregate GB/s |",
                  "|---|---|---|---|---|"]
        for m in METHODS:
            if m not in by:
                continue
            per = [statistics.median(r["rank_seconds"] for r in results[k]["rows"] if r["method"] == m)
                   for k in sorted(results)]
            reads = [[r["read_seconds"] for r in results[k]["rows"] if r["method"] == m and r.get("read_seconds")]
                     for k in sorted(results)]
            read = _span([statistics.median(x) for x in reads]) if all(reads) else "-"
            lines.append(f"| {m} | {_span(per)} | {read} | {results[0]['bytes'] / statistics.median(per) / 1e9:.2f} | "
                         f"{total / med[m] / 1e9:.2f} |")
    return "\n".join(lines)


def _machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, " if torch.cuda.is_available() else "no GPU, "
    try:
        from importlib.metadata import version
        mcore = version("megatron-core")
    except Exception:
        mcore = "?"
    return (f"Host {socket.gethostname()}: {gpu}{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM; torch "
            f"{torch.__version__}, megatron-core {mcore}, Python {platform.python_version()}")


def _commit(given: str | None) -> str:
    if given:
        return given
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=os.path.dirname(os.path.abspath(__file__)))
        if out.returncode == 0:
            return out.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown (no git here: pass --commit)"


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
    p.add_argument("--commit", default=None, help="the commit measured, for the report (default: git rev-parse)")
    p.add_argument("--profile", action="store_true",
                   help="after the rounds, one more safe load under cProfile (calling and reader threads): "
                        "<out>.rank<N>.profile.txt")
    p.add_argument("--out", default=None, help="output prefix (default benchmarks/results/load_<host>_<date>)")
    args = p.parse_args()
    unknown = [m for m in args.methods.split(",") if m and m not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)}")

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
    cache = "warm page cache"
    if args.cold:
        used = sorted({r["evicted"].split(",")[0] for r in result["rows"] if r["evicted"]})
        left = [float(r["evicted"].split(", ")[1].split("%")[0]) for r in result["rows"]
                if r["evicted"] and "% still cached" in r["evicted"]]
        seen = f"; at most {max(left):.1f} % of its pages still cached after a drop (mincore)" if left else ""
        cache = f"page cache dropped before every run ({', '.join(used) or 'not run'}{seen})"
    head = (f"# Load: {result['description']}, {args.ranks} rank(s){' sharing one GPU' if args.share_gpu else ''}, "
            f"{args.threads} threads per rank, {cache}, target {args.target} ({result['filesystem']})\n\n"
            f"{_machine()}; {datetime.date.today()}; commit {_commit(args.commit)}; {args.reps} rounds; times are "
            f"the slowest rank's; every load bit-exact. Median [min-max] over the rounds; ratios of medians.\n")
    table = _table(results, args.ranks)
    report = result.get("report")
    tail = (f"\nsafe_ckpt's last read on rank 0: {report['items']} items, {report['verified']} checksums verified, "
            f"{report['decoded']} decoded by torch.load, {report['threads']} threads.\n") if report else ""
    text = head + "\n" + table + "\n" + tail
    print(text)
    out = args.out or os.path.join("benchmarks", "results", f"load_{socket.gethostname()}_{datetime.date.today()}")
    with open(out + ".json", "w") as f:
        json.dump({"args": vars(args), "machine": _machine(), "commit": _commit(args.commit),
                   "result": result, "ranks": {str(k): v["rows"] for k, v in results.items()}}, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
