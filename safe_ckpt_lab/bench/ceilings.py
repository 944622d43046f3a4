"""The machine's ceilings, measured in the same run as the savers.

- ``d2h``: device-to-host copy into one reused pinned buffer (GB/s);
- ``write``: N threads `pwrite` 64 MiB pieces of an in-memory buffer into N files and
  fsync them (GB/s): the best any saver can do to that target. The source holds as many
  distinct bytes as the state (`source_buffer`), as a save reads them; N is each of the
  run's thread counts and the best counts;
- ``write beside d2h``: the same writes while the state's GPU bytes are copied
  device-to-host into a pinned buffer beside them (`write_beside_copy`): a staging save
  must do both at once, and on a page-cache target both draw on host memory bandwidth;
- ``memcpy``: host-to-host copy (GB/s).
Each is the fastest of ``reps`` runs (a ceiling is the best the machine did). Must not: leave files behind.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Callable

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


def thread_counts(saver_threads: int, ranks_on_host: int = 1) -> list[int]:
    """The saver's own thread count and one writer per core of this rank's share of the host
    (up to 32; ``ranks_on_host`` ranks write at once): the best is the ceiling."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return sorted({saver_threads, max(1, min(32, cores // max(1, ranks_on_host)))})


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


@dataclass(frozen=True)
class BesideCopy:
    """One run of the write ceiling with a copy beside it: the writers' wall seconds and the
    copy's own seconds in that run."""

    write_s: float
    copy_s: float

    @property
    def seconds(self) -> float:
        return max(self.write_s, self.copy_s)


def write_beside_copy(target: str, nbytes: int, threads: int, copy: Callable[[], None], reps: int = 3,
                      source: memoryview | None = None) -> BesideCopy:
    """The fastest of ``reps`` runs of `write_seconds`' writes with ``copy()`` (which returns
    once its bytes have landed) started on another thread just before them."""
    runs = []
    for _ in range(reps):
        box: dict = {}

        def run_copy() -> None:
            t0 = time.perf_counter()
            try:
                copy()
                box["s"] = time.perf_counter() - t0
            except BaseException as exc:  # raised below, on the caller's thread
                box["error"] = exc

        side = threading.Thread(target=run_copy, name="ceiling-copy")
        side.start()
        try:
            write_s = write_seconds(target, nbytes, threads, 1, source)
        finally:
            side.join()
        if "error" in box:
            raise RuntimeError(f"the copy beside the write ceiling failed: {box['error']!r}") from box["error"]
        runs.append(BesideCopy(write_s, box["s"]))
    return min(runs, key=lambda r: r.seconds)


_PAGE_BYTES = 1 << 16  # at least the pool's lease alignment


class DeviceToHostCopy:
    """Copies the given CUDA tensors (all on one device) back to back into one page-locked
    buffer, reused by every call, on a side stream ordered after the stream that was current
    on the building thread, and waits for them; callable from any thread. The first copy,
    which pays for mapping the buffer, is made here, untimed. `close()` gives the buffer back
    (a `PinnedPool` of exactly the bytes: torch's pinned cache would round 9.23 GB up to 16 GiB)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        from safe_ckpt.staging.pool import PinnedPool

        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        device = tensors[0].device
        if any(t.device != device for t in tensors):
            raise ValueError(f"tensors on several devices: {sorted({str(t.device) for t in tensors})}")
        self.tensors = tensors
        self._pool = PinnedPool(-(-max(1, nbytes) // _PAGE_BYTES) * _PAGE_BYTES, pinned=True)  # whole leases
        self._lease = self._pool.lease(nbytes)
        self.buffer = self._lease.tensor
        self._after = torch.cuda.current_stream(device)  # the producers' stream, not the calling thread's
        self._stream = torch.cuda.Stream(device=device)
        self()

    def __call__(self) -> None:
        self._stream.wait_stream(self._after)
        copy_to_host(self.tensors, self.buffer, self._stream)

    def close(self) -> None:
        self.buffer = None
        self._lease.release()
        self._pool.release()


def device_to_host_copier(tensors) -> DeviceToHostCopy | None:
    """A `DeviceToHostCopy` of every CUDA tensor among ``tensors``; None if none is on a GPU."""
    cuda = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda]
    return DeviceToHostCopy(cuda) if cuda else None


def copy_to_host(tensors, dst: torch.Tensor, stream) -> None:
    """Copy the contiguous CUDA ``tensors`` back to back into the pinned bytes ``dst`` on
    ``stream``, and wait for them."""
    offset = 0
    with torch.cuda.stream(stream):
        for t in tensors:
            n = t.numel() * t.element_size()
            dst[offset:offset + n].copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
            offset += n
    stream.synchronize()


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
