"""Experiment (GPU machine): does host memory on transparent huge pages move the copies and
writes of a staging save?

The staging pool and the write ceiling's source are ordinary pageable allocations, on 4 KiB
pages where THP is `madvise` (the H200 host's setting): the kernel's copy of each write walks
one page-table entry per 4 KiB of the source, and the driver pins and maps the pool 4 KiB at a
time. Here each buffer is made both ways (``4k``: torch.empty; ``thp``: an anonymous mapping
with MADV_HUGEPAGE, `safe_ckpt_lab.diag.thp.host_buffer`), and every case runs for both, rounds
interleaved so drift hits all alike:
- ``write_K``: the write ceiling (16 threads pwrite 64 MiB pieces + fsync) from a source of kind K;
- ``d2h_K``: the state's GPU tensors copied back to back into a registered buffer of kind K;
- ``beside_K``: ``write_K`` while ``d2h_K`` runs beside it (what a staging save must do at once);
- ``safe_sync_K`` / ``safe_async_K``: `safe_ckpt.save` / `async_save` (bench peers, 16 writers)
  with the process-wide staging pool of kind K (both pools allocated up front, swapped in).
Each buffer's share on huge pages (AnonHugePages of its mapping) is printed first; the last
``thp`` save is loaded back with stock Megatron and compared bit-exact.
Measured (H200, 2026-12-02, results/diagnostics_2026-12-01_02.txt, section
h200_diag_thp_tmpfs_2026-12-02.txt, 5 rounds): no gain.
Every buffer of either kind was wholly on its kind of page; write 0.398 / 0.412 s (4k / thp
medians), device-to-host 0.168 / 0.169 s, writes beside the copy 0.448 / 0.488 s, sync saves
0.412 / 0.459 s, async 0.447 / 0.400 s, all within the run's spread; the pool stays on 4 KiB pages.
Prints one JSON line per case (median, min, max seconds; GB/s of the median). Usage:
  python benchmarks/diag/diag_thp.py --target /dev/shm/safe_ckpt_thp --gib 8.6 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from safe_ckpt_lab.bench import peers  # noqa: E402
from safe_ckpt_lab.bench.run import _init_dist  # noqa: E402
from safe_ckpt_lab.bench.ceilings import copy_to_host, write_seconds  # noqa: E402
from safe_ckpt_lab.bench.measure import mapping_of  # noqa: E402
from safe_ckpt_lab.bench.state import build  # noqa: E402
from safe_ckpt.staging import pool as poolmod  # noqa: E402
from safe_ckpt_lab.diag import thp  # noqa: E402

KINDS = {"4k": False, "thp": True}


def huge_share(t: torch.Tensor) -> float:
    """The share of ``t``'s bytes that sit on huge pages (its mapping's AnonHugePages / Size)."""
    fields = mapping_of(t.data_ptr())
    return int(fields["AnonHugePages"].split()[0]) / int(fields["Size"].split()[0])


def random_buffer(nbytes: int, huge: bool, seed: int) -> torch.Tensor:
    buf = thp.host_buffer(nbytes, huge)
    buf.random_(generator=torch.Generator().manual_seed(seed))
    return buf


def registered(nbytes: int, huge: bool) -> poolmod.Lease:
    pool = thp.pool(-(-nbytes // 4096) * 4096, pinned=True, huge_pages=huge)
    return pool.lease(nbytes)


def timed_copy(tensors, dst: torch.Tensor, stream) -> float:
    t0 = time.perf_counter()
    copy_to_host(tensors, dst, stream)
    return time.perf_counter() - t0


def beside(target, nbytes, threads, source, tensors, dst, stream) -> float:
    box: dict = {}
    side = threading.Thread(target=lambda: box.setdefault("s", timed_copy(tensors, dst, stream)))
    side.start()
    write_s = write_seconds(target, nbytes, threads, 1, memoryview(source.numpy()))
    side.join()
    return max(write_s, box["s"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="/dev/shm/safe_ckpt_thp")
    ap.add_argument("--gib", type=float, default=8.6)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--cases", default="write,d2h,beside,safe_sync,safe_async")
    args = ap.parse_args()
    cases = args.cases.split(",")
    _init_dist()  # stock Megatron's load in the round trip wants a process group, as in the bench
    state = build("anchor", args.gib)
    tensors = [t for t in state.plain.values() if isinstance(t, torch.Tensor) and t.is_cuda]
    nbytes = state.nbytes
    budget = max(2 << 30, state.device_bytes + (256 << 20))
    stream = torch.cuda.Stream()
    sources = {k: random_buffer(nbytes, h, 5) for k, h in KINDS.items()}
    dsts = {k: registered(state.device_bytes, h) for k, h in KINDS.items()}
    pools = {k: thp.pool(budget, pinned=True, huge_pages=h) for k, h in KINDS.items()}
    for p in pools.values():
        p.preallocate()
    for k in KINDS:
        copy_to_host(tensors, dsts[k].tensor, stream)  # first copies map the buffers, untimed
        print(json.dumps({"huge_share": k, "source": round(huge_share(sources[k]), 3),
                          "d2h_buffer": round(huge_share(dsts[k].tensor), 3),
                          "pool": round(huge_share(pools[k]._buffer), 3)}), flush=True)
    times: dict[str, list[float]] = {}
    stalls: dict[str, list[float]] = {}
    shutil.rmtree(args.target, ignore_errors=True)
    os.makedirs(args.target)
    for rnd in range(args.reps):
        for k in (KINDS if rnd % 2 == 0 else list(KINDS)[::-1]):
            src = memoryview(sources[k].numpy())
            if "write" in cases:
                times.setdefault(f"write_{k}", []).append(write_seconds(args.target, nbytes, args.threads, 1, src))
            if "d2h" in cases:
                times.setdefault(f"d2h_{k}", []).append(timed_copy(tensors, dsts[k].tensor, stream))
            if "beside" in cases:
                times.setdefault(f"beside_{k}", []).append(
                    beside(args.target, nbytes, args.threads, sources[k], tensors, dsts[k].tensor, stream))
            poolmod._shared["pool"] = pools[k]
            for mode in ("safe_sync", "safe_async"):
                if mode in cases:
                    row = peers.resolve(mode)(state, f"{args.target}/{mode}_{k}", args.threads, budget)
                    times.setdefault(f"{mode}_{k}", []).append(row["total_s"])
                    stalls.setdefault(f"{mode}_{k}", []).append(row["stall_s"])
                    print(json.dumps({"run_of": f"{mode}_{k}", "round": rnd, "total_s": round(row["total_s"], 4),
                                      "stall_s": round(row["stall_s"], 4)}), flush=True)
                    shutil.rmtree(f"{args.target}/{mode}_{k}", ignore_errors=True)
    for case, ts in times.items():
        n = state.device_bytes if case.startswith("d2h") else nbytes
        med = statistics.median(ts)
        line = {"case": case, "median_s": round(med, 4), "min_s": round(min(ts), 4), "max_s": round(max(ts), 4),
                "gbps": round(n / med / 1e9, 2), "runs": [round(t, 4) for t in ts]}
        if case in stalls:
            line["stall_median_s"] = round(statistics.median(stalls[case]), 4)
        print(json.dumps(line), flush=True)
    if "safe_sync" in cases:
        from safe_ckpt_lab.bench import verify

        poolmod._shared["pool"] = pools["thp"]
        entry = verify.across_ranks(state, f"{args.target}/verify_thp",
                                    lambda st, p: peers.resolve("safe_sync")(st, p, args.threads, budget),
                                    lambda mine: [mine], 0, peers.Unavailable)
        print(json.dumps({"verify_thp": entry}, default=str), flush=True)
    shutil.rmtree(args.target, ignore_errors=True)


if __name__ == "__main__":
    main()
