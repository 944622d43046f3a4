"""The machine's ceilings, measured in the same run as the savers.

- ``d2h``: device-to-host copy into one reused pinned buffer (GB/s);
- ``write``: N threads `pwrite` 64 MiB pieces of an in-memory buffer into N files and
  fsync them (GB/s): the best any saver can do to that target. The source holds as many
  distinct bytes as the state (`source_buffer`), as a save reads them; N is each of the
  run's thread counts and the best counts;
- ``memcpy``: host-to-host copy (GB/s).
Each is the fastest of ``reps`` runs (a ceiling is the best the machine did). Must not: leave files behind.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import torch


def d2h_gbps(nbytes: int, reps: int = 3) -> float | None:
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / min(times) / 1e9


def write_gbps(target: str, nbytes: int, threads: int, reps: int = 3) -> float:
    return nbytes // threads * threads / write_seconds(target, nbytes, threads, reps) / 1e9


def thread_counts(saver_threads: int) -> list[int]:
    """The saver's own thread count and one writer per core (up to 32): the best is the ceiling."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return sorted({saver_threads, min(32, cores)})


def source_buffer(nbytes: int, limit_bytes: int = 32 << 30) -> memoryview:
    """Seeded random bytes to write from, as many as the state (up to ``limit_bytes``)."""
    buf = torch.empty(min(nbytes, limit_bytes), dtype=torch.uint8)
    buf.random_(generator=torch.Generator().manual_seed(5))
    return memoryview(buf.numpy())


def write_seconds(target: str, nbytes: int, threads: int, reps: int = 3, source: memoryview | None = None) -> float:
    """Fastest of ``reps`` runs of writing ``nbytes`` with ``threads`` threads + fsync, from
    ``source`` (default: a 1 GiB buffer, read over and over)."""
    mv = source if source is not None else source_buffer(min(nbytes, 1 << 30))
    per = nbytes // threads
    piece = 64 << 20
    times = []
    for rep in range(reps):
        d = os.path.join(target, f".ceiling_{rep}")
        os.makedirs(d, exist_ok=True)

        def work(i):
            fd = os.open(os.path.join(d, f"f{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                off = 0
                while off < per:
                    n = min(piece, per - off)
                    start = (i * per + off) % (len(mv) - n + 1)
                    off += os.pwrite(fd, mv[start:start + n], off)
                os.fsync(fd)
            finally:
                os.close(fd)

        times.append(run_lanes(work, threads))
        shutil.rmtree(d, ignore_errors=True)
    return min(times)


def run_lanes(work, threads: int) -> float:
    """Wall seconds of ``work(i)`` for i in range(threads), each on its own thread, all at once."""
    t0 = time.perf_counter()
    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def memcpy_gbps(nbytes: int = 1 << 30, reps: int = 3) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8).random_()
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return nbytes / min(times) / 1e9
