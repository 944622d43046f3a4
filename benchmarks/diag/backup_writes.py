"""Where a save from torch_memory_saver's CPU backup loses time on tmpfs: the same write loop as
the write ceiling (`safe_ckpt_lab.bench.ceilings.write_seconds`: one file per thread, 64 MiB pwrites,
fsync), run from different host memory, and a trace of the save's own item writes.

- `source_of(kind, nbytes)`: seeded random bytes in pageable memory (``pageable``, the ceiling's
  own source), in memory from ``cudaHostAlloc`` (``hostalloc``: what torch_memory_saver's pinned
  CPU backup and torch's pinned tensors are), or in pageable memory page-locked with
  ``cudaHostRegister`` (``registered``: what safe_ckpt's staging pool is);
- `write_views_seconds`: the ceiling's loop over a list of buffers (the backup's own bytes);
- `WriteTrace`: each item write's thread, start, end and bytes during one save;
- `tweaked_asleep_saves`: `benchmarks/slime_loop_bench.py`'s asleep save again with one setting
  changed each (its `--tweaks`), and the loops above between them.

Must not: be imported by the library.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import threading
import time

import torch

from safe_ckpt_lab.bench.ceilings import run_lanes


def source_of(kind: str, nbytes: int):
    """(uint8 tensor of ``nbytes`` seeded random bytes in ``kind`` memory, a function that frees it)."""
    if kind == "hostalloc":
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    else:
        buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.random_(generator=torch.Generator().manual_seed(5))
    if kind == "registered":
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {int(err)}")

    box = {"buf": buf}  # free() drops this reference; the caller drops its own first

    def free():
        held = box.pop("buf")
        if kind == "registered":
            torch.cuda.cudart().cudaHostUnregister(held.data_ptr())
        del held
        if kind == "hostalloc":  # the block goes back to torch's pinned cache: empty it
            torch.cuda.synchronize()
            torch._C._host_emptyCache()

    return buf, free


def write_views_seconds(target: str, views: list, threads: int, piece_bytes: int = 64 << 20) -> float:
    """Write every byte of ``views`` (buffers) with ``threads`` threads, one file each, in
    ``piece_bytes`` pwrites, then fsync: the threads take equal runs of the concatenated bytes."""
    flat = [memoryview(v).cast("B") for v in views]
    total = sum(len(v) for v in flat)
    per = -(-total // threads)
    runs: list[list] = [[] for _ in range(threads)]  # per thread: its (view, start, end) pieces
    lane, room = 0, per
    for v in flat:
        pos = 0
        while pos < len(v):
            take = min(len(v) - pos, room)
            runs[lane].append((v, pos, pos + take))
            pos += take
            room -= take
            if room == 0 and lane < threads - 1:
                lane, room = lane + 1, per
    d = os.path.join(target, ".backup_writes")
    os.makedirs(d, exist_ok=True)

    def work(i):
        fd = os.open(os.path.join(d, f"f{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            off = 0
            for v, start, end in runs[i]:
                while start < end:
                    n = min(piece_bytes, end - start)
                    off += os.pwrite(fd, v[start:start + n], off)
                    start += n
            os.fsync(fd)
        finally:
            os.close(fd)

    try:
        return run_lanes(work, threads)
    finally:
        shutil.rmtree(d, ignore_errors=True)


class WriteTrace:
    """While entered, every `ItemWrites.write` of a save is timed: thread, start, end, bytes."""

    def __init__(self) -> None:
        self.rows: list = []
        self._lock = threading.Lock()

    def __enter__(self):
        from safe_ckpt.write import item_writes

        self._cls = item_writes.ItemWrites
        self._orig = self._cls.write
        trace = self

        def write(writes, handle, item, buffers, recheck=False):
            t0 = time.perf_counter()
            try:
                return trace._orig(writes, handle, item, buffers, recheck)
            finally:
                with trace._lock:
                    trace.rows.append((threading.get_ident(), t0, time.perf_counter(), item.length_bytes,
                                       item.relative_path))

        self._cls.write = write
        return self

    def __exit__(self, *exc):
        self._cls.write = self._orig

    def summary(self) -> dict:
        if not self.rows:
            return {}
        start = min(r[1] for r in self.rows)
        end = max(r[2] for r in self.rows)
        by_thread: dict = {}
        for tid, t0, t1, n, _ in self.rows:
            busy = by_thread.setdefault(tid, [0.0, 0, t0, t1])
            busy[0] += t1 - t0
            busy[1] += n
            busy[2], busy[3] = min(busy[2], t0), max(busy[3], t1)
        busy_s = [b[0] for b in by_thread.values()]
        rates = [b[1] / b[0] / 1e9 for b in by_thread.values() if b[0] > 0]
        sizes = sorted(r[3] for r in self.rows)
        return {
            "items": len(self.rows), "files": len({r[4] for r in self.rows}), "threads": len(by_thread),
            "span_s": end - start, "bytes": sum(sizes), "largest_item_bytes": sizes[-1],
            "median_item_bytes": statistics.median(sizes),
            "busy_s_min_median_max": [min(busy_s), statistics.median(busy_s), max(busy_s)],
            "first_start_s_max": max(b[2] for b in by_thread.values()) - start,
            "last_end_s_min": min(b[3] for b in by_thread.values()) - start,
            "thread_gbps_min_median_max": [min(rates), statistics.median(rates), max(rates)],
        }


def _piece_bytes(part: str) -> int:
    """``pieceNk`` -> N KiB (N >= 4), else 0."""
    digits = part[5:-1] if part.startswith("piece") and part.endswith("k") else ""
    return int(digits) << 10 if digits.isdigit() and int(digits) >= 4 else 0


def tweaked_asleep_saves(names: list, args, save, save_dir, ceiling=None) -> list:
    """The asleep save again with one setting changed each (no rollout beside it), in order:
    ``threads16``: 16 writers; ``nice0``: writers at the caller's priority; ``no_recheck``: the
    backup hashed once, not again after it is written; ``nosum``: no checksums recorded (the
    backup is still hashed twice unless ``no_recheck`` too: ``nosum+no_recheck`` hashes
    nothing); ``pieceNk``: the backup hashed and written in pieces of N KiB (where hashing a
    piece leaves it in the core's cache for its write); ``ceiling``: the write ceiling into the
    same target, measured here (``ceiling()``); ``trace``: the default save with its item writes
    traced, keeping the tensors whose backups it read for ``ceil_backup*``; ``ceil_*``: see
    `backup_writes_ceiling`. Every name is checked before the first save."""
    import dataclasses

    from safe_ckpt.write import item_writes, pipeline
    from safe_ckpt.megatron import training

    settings = {"default", "threads16", "nice0", "no_recheck", "nosum"}
    ceilings = {"ceiling", "ceil_pageable", "ceil_hostalloc", "ceil_registered", "ceil_backup", "ceil_backup2m"}
    for i, name in enumerate(names):  # every name checked before the first save spends GPU time
        if name in ceilings or name == "trace":
            if name.startswith("ceil_backup") and "trace" not in names[:i]:
                raise SystemExit(f"unknown tweak order: {name} needs a `trace` before it")
            continue
        bad = [p for p in name.split("+") if p not in settings and not _piece_bytes(p)]
        if bad:
            raise SystemExit(f"unknown tweak {bad[0]!r} in {name!r}")
    rows = []
    queried: list = []  # the device tensors whose backups the traced save read
    for name in names:
        if name == "ceiling" or name.startswith("ceil_"):
            rows.append({"tweak": name, "ceiling": ceiling() if name == "ceiling" else
                         backup_writes_ceiling(name[5:], ceiling, queried)})
            print("tweak", json.dumps(rows[-1]), flush=True)
            continue
        if name == "trace":
            from safe_ckpt.residence import classify as residence

            real = residence._cpu_backup
            residence._cpu_backup = lambda t, _real=real: (queried.append(t), _real(t))[1]
            try:
                with WriteTrace() as trace:
                    row = save()
            finally:
                residence._cpu_backup = real
            shutil.rmtree(save_dir, ignore_errors=True)
            rows.append({"tweak": name, "durable_s": row["durable_s"], "timings": row["timings"],
                         "trace": trace.summary()})
            print("tweak", json.dumps(rows[-1]), flush=True)
            continue
        saved = (getattr(args, "safe_ckpt_io_threads", None), getattr(args, "safe_ckpt_writer_nice", None),
                 pipeline.RECHECKED_RESIDENCES, item_writes.FUSED_PIECE_BYTES, training.options_from_args)
        try:
            for part in name.split("+"):  # "nosum+no_recheck": both at once
                if part == "threads16":
                    args.safe_ckpt_io_threads = 16
                elif part == "nice0":
                    args.safe_ckpt_writer_nice = 0
                elif part == "no_recheck":
                    pipeline.RECHECKED_RESIDENCES = tuple(r for r in saved[2] if r != "offload_backup")
                elif part == "nosum":
                    training.options_from_args = lambda a, _f=saved[4]: dataclasses.replace(_f(a), checksums=False)
                elif _piece_bytes(part):
                    item_writes.FUSED_PIECE_BYTES = _piece_bytes(part)
            row = save()
        finally:
            (args.safe_ckpt_io_threads, args.safe_ckpt_writer_nice, pipeline.RECHECKED_RESIDENCES,
             item_writes.FUSED_PIECE_BYTES, training.options_from_args) = saved
        shutil.rmtree(save_dir, ignore_errors=True)
        rows.append({"tweak": name, "durable_s": row["durable_s"], "timings": row["timings"]})
        print("tweak", json.dumps(rows[-1]), flush=True)
    return rows


def backup_writes_ceiling(kind: str, ceiling, queried: list) -> dict:
    """The write ceiling's loop (`write_views_seconds`) from other memory: ``hostalloc``,
    ``registered`` or ``pageable`` bytes as many as the state, or ``backup`` / ``backup2m``: the
    CPU backup of the tensors the traced save read (asleep now, so their backups exist), in 64 / 2
    MiB pieces. Threads: the ceiling's best (``ceiling()``'s record)."""
    from safe_ckpt.residence import classify as residence

    best = ceiling()
    target, threads, nbytes = best["target"], best["threads"], best["bytes"]
    if kind.startswith("backup"):
        if not queried:
            raise SystemExit(f"ceil_{kind} needs a `trace` tweak before it (the tensors whose backups to write)")
        seen, views, strided = set(), [], 0
        for t in queried:
            key = (t.data_ptr(), t.numel() * t.element_size())
            if key in seen or not key[1]:
                continue
            seen.add(key)
            b = residence._cpu_backup(t)
            if b is None:
                continue
            if not b.is_contiguous():  # a copy would be new pageable memory, not the backup
                strided += 1
                continue
            views.append(b.view(-1).view(torch.uint8).numpy())
        piece = 2 << 20 if kind == "backup2m" else 64 << 20
        s = write_views_seconds(target, views, threads, piece)
        out = {"seconds": s, "threads": threads, "bytes": sum(v.nbytes for v in views), "ceiling_s": best["seconds"],
               "strided_views_left_out": strided}
        del views
        return out
    buf, free = source_of(kind, nbytes)
    try:
        s = write_views_seconds(target, [buf.numpy()], threads)
    finally:
        del buf
        free()
    return {"seconds": s, "threads": threads, "bytes": nbytes, "ceiling_s": best["seconds"]}
