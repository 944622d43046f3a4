"""Where a save of GPU-resident state loses time against the write ceiling (GPU machine).

On the H200 the anchor state (9.23 GB on the GPU) reached 71-74 % of the tmpfs write
ceiling while host-resident state reached 91-93 %. This measures, in one process and on
one state, what the machine itself allows and what safe_ckpt does, so the gap can be
attributed:
- ``write_T``: T threads write the state's bytes from pinned memory (64 MiB pieces) + fsync;
  ``write_16_shiftN``: each file's bytes N bytes in, out of step with the source's pages;
  ``write_T_direct[_p8]``: the same with O_DIRECT for every whole 4 KiB block (8 MiB pieces), the tail buffered;
- ``write_hash_beside``: 8 writers, each piece checksummed on another thread meanwhile (safe_ckpt's way);
- ``write_hash_fused``: 8 writers, each 4 MiB piece checksummed then written by the same thread;
- ``d2h``: the device-to-host copy of every shard into the pinned pool;
- ``d2h_beside_write``: that copy while 8 threads write a separate host copy of the bytes (the
  writers' seconds; before 2026-12-02 these two cases' median_s also held removing the files: read
  their ``_detail`` lines' write_s in older result files);
- ``pipe_chunk`` / ``pipe_piece``: the minimal staging pipeline (D2H on one stream, 8 lanes
  wait for each copy and write it), per chunk and per 32 MiB piece issued round robin over lanes;
  ``pipe_chunk_sum`` / ``_zip`` / ``_zip_sum``: per chunk, with a host checksum, a torch.save
  container, or both (what each adds for states of many small chunks such as qwen3-4b-dp8);
  ``pipe16_p64*``: 16 lanes, 64 MiB pieces (safe_ckpt's chunks), bare, with device grid sums on
  the copy stream (``_grid``), a host checksum (``_sum``) or a container (``_zip``);
- ``d2h_beside_write16``: 16 threads write from pinned memory while the state is copied to another
  pinned buffer: the write ceiling under a staging save's memory traffic, without its data dependency;
  ``d2hR_beside_write16``: the same with the copy paced to R GB/s (issued 64 MiB at a time on a
  schedule), so its memory traffic is spread over the writes instead of front-loaded;
- ``ring16_sMm_nN``: 16 lanes, each copying its share on its own stream into N reused M MiB
  pinned slots and writing each as it lands (a ring small enough for the last-level cache);
  ``write_16_p1m[_reused32m]``: the writers in 1 MiB pieces, from distinct bytes / from one 32 MiB
  window (what reading the source from cache instead of memory is worth);
- ``*_trace``: the save with every writer lane timed (first item, waits for copies, time in items,
  finish, time in `StagedChunk.grid` waiting for device sums) and the staging thread's finish,
  printed as a ``trace`` line; ``*_phases``: the save's fixed costs, each planning and commit step
  timed (when it started, its seconds), printed as a ``phases`` line; ``nogc``: gc_freeze off;
  ``gated`` / ``early``: the writers wait for every device copy to be issued / start at once,
  whatever the chunk sizes; ``fpw1``: one file per writer instead of two; ``torchcopy``: copies
  through Tensor.copy_ instead of the CUDA driver; ``inline``: grid sums enqueued with each copy
  even while the writers wait; ``old``: both (the issue path before cuda_driver); ``nice5`` /
  ``nice10``: the writers 5 / 10 nicer than the caller (cpu.WRITER_NICE_INCREMENT);
  ``pythread``: another Python thread beside the save wakes every 2 ms (like a training process's);
  ``wb0`` / ``wbN``: the kernel's writeback left to fsync / started every N MiB a file gets
  (`safe_ckpt_lab.diag.writeback`; ``write_16_wb32``: the same for the ceiling's writers);
- ``safe_*``: `safe_ckpt.save` / `async_save` with the defaults and with options changed
  (``io16``: 16 writer threads, ``sumN``: N checksum threads, 0 = in the writers, ``chunkN``: N MiB chunks,
  ``hostsum``: device checksums off, every byte hashed on the host; ``gridminN``: device checksums
  only for chunks of N MiB or more; ``poolN``: an N MiB staging pool, so copies are paced to
  the writes; ``blocking``: CUDA events that block instead of spinning while a writer waits).
Prints a ``run_of`` line per save as it ends, then one JSON line per case (median, min, max of --reps). Usage:
python benchmarks/diag/diag_ttd.py [--preset anchor] [--gib 8.6] [--target /dev/shm/safe_ckpt_diag]
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from safe_ckpt_lab.bench.state import build
from safe_ckpt.integrity import checksum_of
from safe_ckpt_lab.diag.writeback import EarlyWriteback
from safe_ckpt.staging.pool import PinnedPool, shared_pool
from safe_ckpt.staging.views import host_memoryview

from diag_pipes import d2h as _d2h, fresh as _fresh, pipeline as _pipeline, pwrite_all as _pwrite_all, ring as _ring
from diag_saves import CASE, STALLS, patched_save, phased_save, traced_save  # beside this file

MiB = 1 << 20


def _spans(nbytes: int, parts: int, align: int = 1) -> list[range]:
    per = -(-nbytes // parts)
    per = -(-per // align) * align
    return [range(i * per, min(nbytes, (i + 1) * per)) for i in range(parts)]


def _write_lanes(target: str, mv: memoryview, threads: int, piece: int, hash_mode: str | None = None,
                 reuse_bytes: int = 0, shift_bytes: int = 0, writeback_bytes: int = 0,
                 direct: bool = False) -> float:
    """``direct``: O_DIRECT (bypassing the page cache) for every whole 4 KiB block of a file, its
    unaligned tail through the page cache, to see whether the disk takes bytes faster than the
    buffered write + fsync ceiling (the source is page-aligned pinned memory);
    ``writeback_bytes``: start the kernel's writeback of every that many written bytes
    (`safe_ckpt_lab.diag.writeback.EarlyWriteback`, as the ``wbN`` save cases do);
    ``reuse_bytes``: read every piece from the first that many bytes (the old ceiling's 1 GiB buffer);
    ``shift_bytes``: each file's bytes start that far in (a hole before them), so the page cache's
    pages and the source's are that far out of step (a packed torch_dist file's payloads are)."""
    d = _fresh(target)
    hasher = ThreadPoolExecutor(threads) if hash_mode == "beside" else None

    def lane(i: int, span: range) -> None:
        path = os.path.join(d, f"f{i}")
        if direct:
            return _direct_lane(path, mv, span, piece)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        early = EarlyWriteback(fd, path, writeback_bytes) if writeback_bytes else None
        try:
            for off in range(span.start, span.stop, piece):
                n = min(piece, span.stop - off)
                src = off % (reuse_bytes - n + 1) if reuse_bytes else off
                buf = mv[src:src + n]
                pending = hasher.submit(checksum_of, [buf]) if hasher else None
                if hash_mode == "fused":
                    checksum_of([buf])
                _pwrite_all(fd, buf, off - span.start + shift_bytes)
                if early is not None:
                    early.wrote(off - span.start + shift_bytes, n)
                if pending:
                    pending.result()
            os.fsync(fd)
        finally:
            os.close(fd)

    spans = _spans(len(mv), threads, align=DIRECT_ALIGN if direct else 1)
    errors: list[BaseException] = []

    def guarded(i: int, span: range) -> None:
        try:
            lane(i, span)
        except BaseException as e:  # a lane's failure must fail the case, not vanish with its thread
            errors.append(e)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=guarded, args=(i, s)) for i, s in enumerate(spans)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    if hasher:
        hasher.shutdown()
    shutil.rmtree(d, ignore_errors=True)
    if errors:
        raise errors[0]
    return dt


DIRECT_ALIGN = 4096


def _direct_lane(path: str, mv: memoryview, span: range, piece: int) -> None:
    whole = (len(span) // DIRECT_ALIGN) * DIRECT_ALIGN
    fd = None
    try:  # a filesystem without O_DIRECT (tmpfs before Linux 6.6) refuses the open itself
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        for off in range(0, whole, piece):
            n = min(piece, whole - off)
            _pwrite_all(fd, mv[span.start + off:span.start + off + n], off)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise OSError(e.errno, f"O_DIRECT write refused at {path}: the source must be page-aligned "
                                   "(the CUDA pinned buffer is; a CPU-only run's is not) and the "
                                   "filesystem must take O_DIRECT") from e
        raise
    finally:
        if fd is not None:
            os.close(fd)
    fd = os.open(path, os.O_WRONLY)
    try:
        if whole < len(span):
            _pwrite_all(fd, mv[span.start + whole:span.stop], whole)
        os.fsync(fd)
    finally:
        os.close(fd)


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
    # The pipe / d2h cases' own buffer: a case with another budget replaces (and unpins) the pool's.
    own = PinnedPool(budget)
    own.preallocate()
    pinned = own._buffer
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
    # O_DIRECT needs a page-aligned source; the pool's buffer is torch's (64-byte aligned) memory
    dmv = mv[(-pinned.data_ptr()) % DIRECT_ALIGN:]
    pageable = pinned[:nbytes].clone()
    pmv = host_memoryview(pageable)
    print(json.dumps({"state": state.description, "bytes": nbytes, "cores": os.cpu_count()}), flush=True)

    def d2h_beside_write() -> float:
        box = {}
        writer = threading.Thread(target=lambda: box.setdefault("w", _write_lanes(args.target, pmv, 8, 64 * MiB)))
        writer.start()
        box["d"] = _d2h(sources, pinned, stream)
        writer.join()
        print(json.dumps({"case": "d2h_beside_write_detail", "d2h_s": box["d"], "write_s": box["w"]}), flush=True)
        # the writers' own time: the join also waits for _write_lanes to remove its files
        return box["w"]

    ring = torch.empty(2 << 30, dtype=torch.uint8, pin_memory=True) if cuda else None

    def d2h_beside_write16(rate_gbps: float | None = None) -> float:
        """16 writers write the state's bytes from pinned memory while the state is copied
        device-to-host at full speed into another pinned buffer (a 2 GiB ring): the write
        ceiling under the memory traffic of a save's staging, without its data dependency."""
        box = {}
        writer = threading.Thread(target=lambda: box.setdefault("w", _write_lanes(args.target, mv, 16, 64 * MiB)))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        writer.start()
        with torch.cuda.stream(stream):
            at = issued = 0
            for s in sources:
                flat = s.view(-1).view(torch.uint8)
                for start in range(0, flat.numel(), 64 * MiB):
                    part = flat[start:start + 64 * MiB]
                    if at + part.numel() > ring.numel():
                        at = 0
                    if rate_gbps:
                        due = t0 + issued / (rate_gbps * 1e9)
                        now = time.perf_counter()
                        if due > now:
                            time.sleep(due - now)
                    issued += part.numel()
                    ring[at:at + part.numel()].copy_(part, non_blocking=True)
                    at += part.numel()
        stream.synchronize()
        box["d"] = time.perf_counter() - t0
        writer.join()
        print(json.dumps({"case": "d2h_beside_write16_detail", "rate_gbps": rate_gbps, "d2h_s": box["d"],
                          "write_s": box["w"]}), flush=True)
        return box["w"]  # as in d2h_beside_write: not the removal of the files after it

    def swapped_pool(fn):
        """The case with the shared pool's buffer and the pipe cases' own buffer exchanged (both
        pinned, same size): whether a save's speed follows the memory it stages through."""
        def run():
            pool._buffer, own._buffer = own._buffer, pool._buffer
            try:
                return fn()
            finally:
                pool._buffer, own._buffer = own._buffer, pool._buffer
        return run

    cases = {
        "pipe16_p64_poolbuf": lambda: _pipeline(args.target, sources, pool._buffer, stream, 16, 64 * MiB),
        "safe_sync_io16_ownbuf": swapped_pool(lambda: patched_save(state, args.target, budget, "sync", io_threads=16)),
        "write_8": lambda: _write_lanes(args.target, mv, 8, 64 * MiB),
        "write_12": lambda: _write_lanes(args.target, mv, 12, 64 * MiB),
        "write_16": lambda: _write_lanes(args.target, mv, 16, 64 * MiB),
        **{f"write_{n}_direct{'' if p == 64 else f'_p{p}'}": (
            lambda n=n, p=p: _write_lanes(args.target, dmv, n, p * MiB, direct=True))
           for n in (8, 16, 32) for p in (8, 64)},
        "write_16_wb32": lambda: _write_lanes(args.target, mv, 16, 64 * MiB, writeback_bytes=32 * MiB),
        **{f"write_16_shift{n}": (lambda n=n: _write_lanes(args.target, mv, 16, 64 * MiB, shift_bytes=n))
           for n in (1, 8, 64, 2048, 4096)},
        "write_8_pageable": lambda: _write_lanes(args.target, pmv, 8, 64 * MiB),
        "write_hash_beside": lambda: _write_lanes(args.target, mv, 8, 64 * MiB, "beside"),
        "write_hash_fused": lambda: _write_lanes(args.target, mv, 8, 4 * MiB, "fused"),
        "write_8_4mib": lambda: _write_lanes(args.target, mv, 8, 4 * MiB),
        "write_8_reused1g": lambda: _write_lanes(args.target, mv, 8, 64 * MiB, reuse_bytes=1 << 30),
        "write_16_reused1g": lambda: _write_lanes(args.target, mv, 16, 64 * MiB, reuse_bytes=1 << 30),
        "write_16_p1m": lambda: _write_lanes(args.target, mv, 16, MiB),
        "write_16_p1m_reused32m": lambda: _write_lanes(args.target, mv, 16, MiB, reuse_bytes=32 * MiB),
        **{f"ring16_s{m}m_n{n}": (lambda m=m, n=n: _ring(args.target, sources, ring, 16, m * MiB, n))
           for m, n in ((1, 2), (1, 4), (2, 2), (4, 2), (4, 4), (16, 2), (64, 2))},  # within the 2 GiB ring
        "d2h": lambda: _d2h(sources, pinned, stream),
        "d2h_beside_write": d2h_beside_write,
        "d2h_beside_write16": d2h_beside_write16,
        **{f"d2h{r}_beside_write16": (lambda r=r: d2h_beside_write16(r)) for r in (20, 25, 30, 35, 40)},
        "pipe_chunk": lambda: _pipeline(args.target, sources, pinned, stream, 8, None),
        "pipe_chunk_sum": lambda: _pipeline(args.target, sources, pinned, stream, 8, None, checksum=True),
        "pipe_chunk_zip": lambda: _pipeline(args.target, sources, pinned, stream, 8, None, container=True),
        "pipe_chunk_zip_sum": lambda: _pipeline(args.target, sources, pinned, stream, 8, None, checksum=True,
                                                container=True),
        "pipe_piece": lambda: _pipeline(args.target, sources, pinned, stream, 8, 32 * MiB),
        "pipe16_piece": lambda: _pipeline(args.target, sources, pinned, stream, 16, 32 * MiB),
        "pipe16_p64": lambda: _pipeline(args.target, sources, pinned, stream, 16, 64 * MiB),
        "pipe16_p64_grid": lambda: _pipeline(args.target, sources, pinned, stream, 16, 64 * MiB, grid=True),
        "pipe16_p64_sum": lambda: _pipeline(args.target, sources, pinned, stream, 16, 64 * MiB, checksum=True),
        "pipe16_p64_zip": lambda: _pipeline(args.target, sources, pinned, stream, 16, 64 * MiB, container=True),
        "safe_sync": lambda: patched_save(state, args.target, budget, "sync"),
        "safe_async": lambda: patched_save(state, args.target, budget, "async"),
        "safe_sync_nosum": lambda: patched_save(state, args.target, budget, "sync", checksums=False),
        "safe_sync_io16": lambda: patched_save(state, args.target, budget, "sync", io_threads=16),
        "safe_sync_chunk256": lambda: patched_save(state, args.target, budget, "sync", chunk_bytes=256 * MiB),
        "safe_sync_io16_chunk256": lambda: patched_save(state, args.target, budget, "sync", io_threads=16, chunk_bytes=256 * MiB),
        "safe_sync_io16_chunk32": lambda: patched_save(state, args.target, budget, "sync", io_threads=16, chunk_bytes=32 * MiB),
        "safe_sync_trace": lambda: traced_save(state, args.target, budget),
        "safe_sync_io16_trace": lambda: traced_save(state, args.target, budget, io_threads=16),
        "safe_sync_io16_phases": lambda: phased_save(state, args.target, budget, io_threads=16),
        "safe_async_io16_phases": lambda: phased_save(state, args.target, budget, "async", io_threads=16),
        "safe_sync_io16_nosum_trace": lambda: traced_save(state, args.target, budget, io_threads=16, checksums=False),
        "safe_sync_io16_blocking": lambda: patched_save(state, args.target, budget, "sync", io_threads=16,
                                                 blocking_events=True),
        "safe_sync_io16_fpw1": lambda: patched_save(state, args.target, budget, "sync", io_threads=16, files_per_writer=1),
        "safe_sync_early": lambda: patched_save(state, args.target, budget, "sync", early_min_bytes=1),
        "safe_sync_io16_early": lambda: patched_save(state, args.target, budget, "sync", io_threads=16, early_min_bytes=1),
        "safe_sync_io16_nogc": lambda: patched_save(state, args.target, budget, "sync", io_threads=16, gc_freeze=False),
        "safe_sync_io16_nosum": lambda: patched_save(state, args.target, budget, "sync", io_threads=16, checksums=False),
        "safe_sync_io16_hostsum": lambda: patched_save(state, args.target, budget, "sync", io_threads=16,
                                                device_checksums=False),
        "safe_sync_hostsum": lambda: patched_save(state, args.target, budget, "sync", device_checksums=False),
        **{f"safe_sync_gridmin{m}m": (lambda m=m: patched_save(state, args.target, budget, "sync", grid_min_bytes=m * MiB))
           for m in (1, 4, 8, 16, 32)},
        "safe_async_io16_hostsum": lambda: patched_save(state, args.target, budget, "async", io_threads=16,
                                                 device_checksums=False),
        "safe_async_io16": lambda: patched_save(state, args.target, budget, "async", io_threads=16),
        # A small pool paces the device-to-host copies to the writers: the bytes a writer reads
        # may still be in the last-level cache the copy wrote them through.
        **{f"safe_{mode}_io16_pool{m}m{suffix}": (
            lambda m=m, mode=mode, kw=kw: patched_save(state, args.target, m * MiB, mode, io_threads=16, **kw))
           for m in (256, 1024, 2048) for mode in ("sync", "async")
           for suffix, kw in (("", {}), ("_wb0", {"writeback_bytes": 0}), ("_wb32", {"writeback_bytes": 32 * MiB}),
                              ("_wb32_trace", {"writeback_bytes": 32 * MiB, "trace": True}))},
        "safe_sync_io16_sum0": lambda: patched_save(state, args.target, budget, "sync", io_threads=16, checksum_threads=0),
        "safe_sync_io16_sum0_p1m": lambda: patched_save(state, args.target, budget, "sync", MiB, io_threads=16,
                                                 checksum_threads=0),
        "safe_sync_io16_sum0_p4m": lambda: patched_save(state, args.target, budget, "sync", 4 * MiB, io_threads=16,
                                                 checksum_threads=0),
        "safe_sync_io16_sum4": lambda: patched_save(state, args.target, budget, "sync", io_threads=16, checksum_threads=4),
        "safe_sync_io16_sum16": lambda: patched_save(state, args.target, budget, "sync", io_threads=16, checksum_threads=16),
        "safe_sync_io12_sum4": lambda: patched_save(state, args.target, budget, "sync", io_threads=12, checksum_threads=4),
        "safe_sync_sum0": lambda: patched_save(state, args.target, budget, "sync", checksum_threads=0),
        # How the copies are issued (see cuda_driver / Stager.stage): "old" is both changes undone.
        **{f"safe_{mode}{io}{suffix}": (lambda mode=mode, kw=kw, io=io: patched_save(state, args.target, budget, mode,
                                                                              **kw, **({"io_threads": 16} if io else {})))
           for mode in ("sync", "async") for io in ("", "_io16")
           for suffix, kw in (("_torchcopy", {"torch_copies": True}), ("_inline", {"inline_sums": True}),
                              ("_old", {"torch_copies": True, "inline_sums": True}), ("_gated", {"early_min_bytes": 1 << 62}),
                              ("_nice5", {"nice": 5}), ("_nice10", {"nice": 10}),
                              ("_pythread", {"pythread_s": 0.002}),
                              ("_pythread_trace", {"pythread_s": 0.002, "trace": True}),
                              ("_wb0", {"writeback_bytes": 0}), ("_wb8", {"writeback_bytes": 8 * MiB}),
                              ("_wb32", {"writeback_bytes": 32 * MiB}), ("_wb128", {"writeback_bytes": 128 * MiB}),
                              ("_wb32_trace", {"writeback_bytes": 32 * MiB, "trace": True}),
                              ("_old_trace", {"torch_copies": True, "inline_sums": True, "trace": True}),
                              ("_new_trace", {"trace": True}),
                              *((f"_rate{r}", {"rate_gbps": r}) for r in (20, 25, 30, 35, 40)),
                              ("_rate30_trace", {"rate_gbps": 30, "trace": True}),
                              *((f"_devpace{r}", {"devpace_gbps": r}) for r in (30, 35, 40, 45)),
                              ("_devpace40_trace", {"devpace_gbps": 40, "trace": True}))},
    }
    only = [p for p in args.only.split(",") if p]
    selected = {k: f for k, f in cases.items()
                if (not only or any(k == p or (p.endswith("*") and k.startswith(p[:-1])) for p in only))
                and (cuda or not k.startswith(("d2h", "pipe", "ring")))}
    runs = {k: [] for k in selected}
    failed: dict[str, str] = {}
    for round_ in range(args.reps):  # rounds interleave the cases, so drift hits all alike
        for name, fn in selected.items():
            if name in failed:
                continue
            CASE[0] = name
            try:
                runs[name].append(fn())
            except Exception as exc:  # one case that cannot run here must not cost the others theirs
                failed[name] = f"{type(exc).__name__}: {exc}"
                print(json.dumps({"case": name, "error": failed[name]}), flush=True)
                continue
            # each run as it ends: a run stopped at a time limit still says what it measured
            stall = STALLS[name][-1] if len(STALLS.get(name, ())) == len(runs[name]) else None
            print(json.dumps({"run_of": name, "round": round_, "s": round(runs[name][-1], 4),
                              "stall_s": None if stall is None else round(stall, 4)}), flush=True)
    for name, times in runs.items():
        if not times:
            continue
        row = {"case": name, "median_s": statistics.median(times), "min_s": min(times),
               "max_s": max(times), "gbps_median": nbytes / statistics.median(times) / 1e9}
        if name in failed:
            row["error_in_a_later_round"] = failed[name]
        if STALLS.get(name):
            row.update(stall_median_s=statistics.median(STALLS[name]), stall_max_s=max(STALLS[name]))
        print(json.dumps(row), flush=True)
    shutil.rmtree(args.target, ignore_errors=True)


if __name__ == "__main__":
    main()
