"""Where a save of GPU-resident state loses time against the write ceiling (GPU machine).

On the H200 the anchor state (9.23 GB on the GPU) reached 71-74 % of the tmpfs write
ceiling while host-resident state reached 91-93 %. This measures, in one process and on
one state, what the machine itself allows and what safe_ckpt does, so the gap can be
attributed:
- ``write_T``: T threads write the state's bytes from pinned memory (64 MiB pieces) + fsync;
- ``write_hash_beside``: 8 writers, each piece checksummed on another thread meanwhile (safe_ckpt's way);
- ``write_hash_fused``: 8 writers, each 4 MiB piece checksummed then written by the same thread;
- ``d2h``: the device-to-host copy of every shard into the pinned pool;
- ``d2h_beside_write``: that copy while 8 threads write a separate host copy of the bytes;
- ``pipe_chunk`` / ``pipe_piece``: the minimal staging pipeline (D2H on one stream, 8 lanes
  wait for each copy and write it), per chunk and per 32 MiB piece issued round robin over lanes;
  ``pipe_chunk_sum`` / ``_zip`` / ``_zip_sum``: per chunk, with a host checksum, a torch.save
  container, or both (what each adds for states of many small chunks such as qwen3-4b-dp8);
- ``safe_*``: `safe_ckpt.save` / `async_save` with the defaults and with options changed
  (``io16``: 16 writer threads, ``sumN``: N checksum threads, 0 = in the writers, ``chunkN``: N MiB chunks,
  ``hostsum``: device checksums off, every byte hashed on the host; ``gridminN``: device checksums
  only for chunks of N MiB or more; ``poolN``: an N MiB staging pool, so copies are paced to the writes).
Prints one JSON line per case (median, min, max of --reps). Usage:
python benchmarks/diag_ttd.py [--preset anchor] [--gib 8.6] [--target /dev/shm/safe_ckpt_diag]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import safe_ckpt
from safe_ckpt.bench.state import build
from safe_ckpt.integrity import checksum_of
from safe_ckpt.staging.pool import shared_pool
from safe_ckpt.staging.stager import host_memoryview

MiB = 1 << 20


def _fresh(target: str) -> str:
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    return target


def _spans(nbytes: int, parts: int) -> list[range]:
    per = -(-nbytes // parts)
    return [range(i * per, min(nbytes, (i + 1) * per)) for i in range(parts)]


def _write_lanes(target: str, mv: memoryview, threads: int, piece: int, hash_mode: str | None = None,
                 reuse_bytes: int = 0) -> float:
    """``reuse_bytes``: read every piece from the first that many bytes (the old ceiling's 1 GiB buffer)."""
    d = _fresh(target)
    hasher = ThreadPoolExecutor(threads) if hash_mode == "beside" else None

    def lane(i: int, span: range) -> None:
        fd = os.open(os.path.join(d, f"f{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for off in range(span.start, span.stop, piece):
                n = min(piece, span.stop - off)
                src = off % (reuse_bytes - n + 1) if reuse_bytes else off
                buf = mv[src:src + n]
                pending = hasher.submit(checksum_of, [buf]) if hasher else None
                if hash_mode == "fused":
                    checksum_of([buf])
                os.pwrite(fd, buf, off - span.start)
                if pending:
                    pending.result()
            os.fsync(fd)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=lane, args=(i, s)) for i, s in enumerate(_spans(len(mv), threads))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    if hasher:
        hasher.shutdown()
    shutil.rmtree(d, ignore_errors=True)
    return dt


def _d2h(sources: list[torch.Tensor], pinned: torch.Tensor, stream) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    off = 0
    with torch.cuda.stream(stream):
        for s in sources:
            n = s.numel() * s.element_size()
            pinned[off:off + n].copy_(s.view(-1).view(torch.uint8), non_blocking=True)
            off += n
    stream.synchronize()
    return time.perf_counter() - t0


def _pipeline(target: str, sources: list[torch.Tensor], pinned: torch.Tensor, stream, lanes: int,
              piece: int | None, checksum: bool = False, container: bool = False) -> float:
    """Chunks of <= 256 MiB dealt round robin to lanes; copies issued per chunk (piece=None)
    or per piece, round robin over the lanes' current chunks; each lane writes as copies land.
    ``checksum``: each lane hashes what it writes (xxh3) just before writing it; ``container``:
    each write gets a freshly built torch.save prefix and suffix around it, in one pwritev
    (what safe_ckpt adds per item, without its bookkeeping)."""
    from safe_ckpt.encoding import torchzip

    chunks, off = [], 0
    for s in sources:
        flat = s.view(-1).view(torch.uint8)
        for start in range(0, flat.numel(), 256 * MiB):
            part = flat[start:start + 256 * MiB]
            chunks.append((part, off))
            off += part.numel()
    per_lane = [chunks[i::lanes] for i in range(lanes)]
    work = [[] for _ in range(lanes)]  # lane -> [(event, host view, file offset)]
    d = _fresh(target)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        step = piece or 256 * MiB
        cursors = [[(c, o, 0) for c, o in lane] for lane in per_lane]
        file_off = [0] * lanes
        while any(cursors):
            for lane in range(lanes):
                if not cursors[lane]:
                    continue
                part, off, done = cursors[lane][0]
                n = min(step, part.numel() - done)
                host = pinned[off + done:off + done + n]
                host.copy_(part[done:done + n], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
                work[lane].append((ev, host_memoryview(host), file_off[lane]))
                file_off[lane] += n
                if done + n >= part.numel():
                    cursors[lane].pop(0)
                else:
                    cursors[lane][0] = (part, off, done + n)

    def lane_fn(i: int) -> None:
        fd = os.open(os.path.join(d, f"f{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            extra = 0
            for ev, mv, fo in work[i]:
                ev.synchronize()
                if checksum:
                    checksum_of([mv])
                if container:
                    c = torchzip.tensor_container(torch.uint8, (len(mv),))
                    os.pwritev(fd, [c.prefix, mv, c.suffix()], fo + extra)
                    extra += c.total_bytes - len(mv)
                else:
                    os.pwrite(fd, mv, fo)
            os.fsync(fd)
        finally:
            os.close(fd)

    ts = [threading.Thread(target=lane_fn, args=(i,)) for i in range(lanes)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    shutil.rmtree(d, ignore_errors=True)
    return dt


def _safe(state, target: str, budget: int, mode: str, piece_bytes: int | None = None,
          grid_min_bytes: int | None = None, **opts) -> float:
    from safe_ckpt import pipeline
    from safe_ckpt.staging import stager

    default_piece, default_grid_min = pipeline.FUSED_PIECE_BYTES, stager.GRID_MIN_PAYLOAD_BYTES
    if piece_bytes:
        pipeline.FUSED_PIECE_BYTES = piece_bytes
    if grid_min_bytes:
        stager.GRID_MIN_PAYLOAD_BYTES = grid_min_bytes
    try:
        return _safe_once(state, target, budget, mode, **opts)
    finally:
        pipeline.FUSED_PIECE_BYTES, stager.GRID_MIN_PAYLOAD_BYTES = default_piece, default_grid_min


def _safe_once(state, target: str, budget: int, mode: str, **opts) -> float:
    shutil.rmtree(target, ignore_errors=True)
    options = safe_ckpt.SaveOptions(staging_budget_bytes=budget, **opts)
    shared_pool(budget).preallocate()  # a case with another budget replaced the pool: register it untimed
    t0 = time.perf_counter()
    if mode == "sync":
        safe_ckpt.save(state.make_sharded(), target, options=options)
    else:
        safe_ckpt.async_save(state.make_sharded(), target, options=options).wait()
    dt = time.perf_counter() - t0
    shutil.rmtree(target, ignore_errors=True)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="anchor")
    ap.add_argument("--gib", type=lambda v: float(v) if v else None, default=8.6, help="empty: the preset's own size")
    ap.add_argument("--target", default="/dev/shm/safe_ckpt_diag")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated cases to run, NAME* for a prefix (default: all)")
    args = ap.parse_args()
    state = build(args.preset, args.gib, "gpu")
    cuda = torch.cuda.is_available()
    sources = [t for t in state.plain.values() if t.is_cuda or not cuda]
    nbytes = sum(t.numel() * t.element_size() for t in sources)
    budget = nbytes + 256 * MiB
    pool = shared_pool(budget)
    pool.preallocate()
    pinned = pool._buffer  # the diagnostic borrows the pool's buffer between saves
    stream = torch.cuda.Stream() if cuda else None
    if cuda:
        _d2h(sources, pinned, stream)
    else:  # CPU: only the write and safe_* cases, to try the script
        off = 0
        for s in sources:
            n = s.numel() * s.element_size()
            pinned[off:off + n].copy_(s.reshape(-1).view(torch.uint8))
            off += n
    mv = host_memoryview(pinned[:nbytes])
    pageable = pinned[:nbytes].clone()
    pmv = host_memoryview(pageable)
    print(json.dumps({"state": state.description, "bytes": nbytes, "cores": os.cpu_count()}), flush=True)

    def d2h_beside_write() -> float:
        box = {}
        writer = threading.Thread(target=lambda: box.setdefault("w", _write_lanes(args.target, pmv, 8, 64 * MiB)))
        t0 = time.perf_counter()
        writer.start()
        box["d"] = _d2h(sources, pinned, stream)
        writer.join()
        print(json.dumps({"case": "d2h_beside_write_detail", "d2h_s": box["d"], "write_s": box["w"]}), flush=True)
        return time.perf_counter() - t0

    cases = {
        "write_8": lambda: _write_lanes(args.target, mv, 8, 64 * MiB),
        "write_12": lambda: _write_lanes(args.target, mv, 12, 64 * MiB),
        "write_16": lambda: _write_lanes(args.target, mv, 16, 64 * MiB),
        "write_8_pageable": lambda: _write_lanes(args.target, pmv, 8, 64 * MiB),
        "write_hash_beside": lambda: _write_lanes(args.target, mv, 8, 64 * MiB, "beside"),
        "write_hash_fused": lambda: _write_lanes(args.target, mv, 8, 4 * MiB, "fused"),
        "write_8_4mib": lambda: _write_lanes(args.target, mv, 8, 4 * MiB),
        "write_8_reused1g": lambda: _write_lanes(args.target, mv, 8, 64 * MiB, reuse_bytes=1 << 30),
        "write_16_reused1g": lambda: _write_lanes(args.target, mv, 16, 64 * MiB, reuse_bytes=1 << 30),
        "d2h": lambda: _d2h(sources, pinned, stream),
        "d2h_beside_write": d2h_beside_write,
        "pipe_chunk": lambda: _pipeline(args.target, sources, pinned, stream, 8, None),
        "pipe_chunk_sum": lambda: _pipeline(args.target, sources, pinned, stream, 8, None, checksum=True),
        "pipe_chunk_zip": lambda: _pipeline(args.target, sources, pinned, stream, 8, None, container=True),
        "pipe_chunk_zip_sum": lambda: _pipeline(args.target, sources, pinned, stream, 8, None, checksum=True,
                                                container=True),
        "pipe_piece": lambda: _pipeline(args.target, sources, pinned, stream, 8, 32 * MiB),
        "pipe16_piece": lambda: _pipeline(args.target, sources, pinned, stream, 16, 32 * MiB),
        "safe_sync": lambda: _safe(state, args.target, budget, "sync"),
        "safe_async": lambda: _safe(state, args.target, budget, "async"),
        "safe_sync_nosum": lambda: _safe(state, args.target, budget, "sync", checksums=False),
        "safe_sync_io16": lambda: _safe(state, args.target, budget, "sync", io_threads=16),
        "safe_sync_chunk256": lambda: _safe(state, args.target, budget, "sync", chunk_bytes=256 * MiB),
        "safe_sync_io16_chunk256": lambda: _safe(state, args.target, budget, "sync", io_threads=16, chunk_bytes=256 * MiB),
        "safe_sync_io16_chunk32": lambda: _safe(state, args.target, budget, "sync", io_threads=16, chunk_bytes=32 * MiB),
        "safe_sync_io16_nosum": lambda: _safe(state, args.target, budget, "sync", io_threads=16, checksums=False),
        "safe_sync_io16_hostsum": lambda: _safe(state, args.target, budget, "sync", io_threads=16,
                                                device_checksums=False),
        "safe_sync_hostsum": lambda: _safe(state, args.target, budget, "sync", device_checksums=False),
        **{f"safe_sync_gridmin{m}m": (lambda m=m: _safe(state, args.target, budget, "sync", grid_min_bytes=m * MiB))
           for m in (1, 4, 8, 16, 32)},
        "safe_async_io16_hostsum": lambda: _safe(state, args.target, budget, "async", io_threads=16,
                                                 device_checksums=False),
        "safe_async_io16": lambda: _safe(state, args.target, budget, "async", io_threads=16),
        # A small pool paces the device-to-host copies to the writers: the bytes a writer reads
        # may still be in the last-level cache the copy wrote them through.
        **{f"safe_sync_io16_pool{m}m": (lambda m=m: _safe(state, args.target, m * MiB, "sync", io_threads=16))
           for m in (256, 1024)},
        "safe_sync_io16_sum0": lambda: _safe(state, args.target, budget, "sync", io_threads=16, checksum_threads=0),
        "safe_sync_io16_sum0_p1m": lambda: _safe(state, args.target, budget, "sync", MiB, io_threads=16,
                                                 checksum_threads=0),
        "safe_sync_io16_sum0_p4m": lambda: _safe(state, args.target, budget, "sync", 4 * MiB, io_threads=16,
                                                 checksum_threads=0),
        "safe_sync_io16_sum4": lambda: _safe(state, args.target, budget, "sync", io_threads=16, checksum_threads=4),
        "safe_sync_io16_sum16": lambda: _safe(state, args.target, budget, "sync", io_threads=16, checksum_threads=16),
        "safe_sync_io12_sum4": lambda: _safe(state, args.target, budget, "sync", io_threads=12, checksum_threads=4),
        "safe_sync_sum0": lambda: _safe(state, args.target, budget, "sync", checksum_threads=0),
    }
    only = [p for p in args.only.split(",") if p]
    selected = {k: f for k, f in cases.items()
                if (not only or any(k == p or (p.endswith("*") and k.startswith(p[:-1])) for p in only))
                and (cuda or not k.startswith(("d2h", "pipe")))}
    runs = {k: [] for k in selected}
    for _ in range(args.reps):  # rounds interleave the cases, so drift hits all alike
        for name, fn in selected.items():
            runs[name].append(fn())
    for name, times in runs.items():
        print(json.dumps({"case": name, "median_s": statistics.median(times), "min_s": min(times),
                          "max_s": max(times), "gbps_median": nbytes / statistics.median(times) / 1e9}), flush=True)
    shutil.rmtree(args.target, ignore_errors=True)


if __name__ == "__main__":
    main()
