"""A node's save measured as N ranks of one host: what each rank had and did, not only the slowest.

One job: the per-rank parts of a run on N ranks that share a host (and, on the one-GPU machine,
its GPU): the writer threads the stock peers and the ceilings get (`peer_threads`), the
source bytes of the write ceilings held once per host (`host_source`), every rank's share of
device-to-host bandwidth while all ranks copy at once (`d2h_share`), and a row's outcome
gathered from every rank (`gather_result`). Collectives go through the ``everyone`` /
``barrier`` callables the caller passes, so each rank reaches the same ones whatever fails.
Must not: time a saver, or keep a buffer alive past the call that needs it (the caller closes
the source).
"""

from __future__ import annotations

import mmap
import os
import socket
import statistics
import time
from dataclasses import dataclass

import torch

# A row's fields recorded for every rank, in rank order (the row's own value is the slowest
# rank's): what the per-rank goals are checked on, and what the library resolved on each rank.
BY_RANK = ("stall_s", "total_s", "extra_rss_bytes", "pool_allocations", "io_threads", "staging_budget_bytes",
           "checksum_threads")

_SHM = "/dev/shm"
_BLOCK_BYTES = 64 << 20


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_key() -> str:
    """Equal on every rank of one machine (its kernel's boot id, else its hostname)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return "boot:" + f.read().strip()
    except OSError:
        return "host:" + socket.gethostname()


def local_ranks(everyone) -> int:
    """How many ranks of the run share this rank's host (this one included)."""
    mine = host_key()
    return sum(1 for k in everyone(mine) if k == mine)


def peer_threads(threads: int, ranks_on_host: int, host_cores: int | None = None) -> int:
    """Writer threads of the stock peers and the ceilings: ``threads``, or where it is 0 (the
    safe_ckpt peers on the library's defaults) this rank's share of the host's cores."""
    if threads > 0:
        return threads
    return max(1, (host_cores or cores()) // max(1, ranks_on_host))


@dataclass
class HostSource:
    """Seeded distinct bytes the write ceilings write from. ``shared``: one copy per host that
    every rank of the host maps (N ranks hold one rank's bytes, not N times them)."""

    view: memoryview
    shared: bool
    _mapping: mmap.mmap | None = None
    _tensor: torch.Tensor | None = None

    def close(self) -> None:
        view, self.view = self.view, None
        self._tensor = None
        if view is not None:
            view.release()
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:  # a slice still held somewhere: unmapped when it goes
                pass
            self._mapping = None


def fill(dst: torch.Tensor, seed: int = 5, block_bytes: int = _BLOCK_BYTES) -> None:
    """Distinct bytes, fast: one seeded random block, each later block the same shifted by its
    index (CPU random fill runs at well under 1 GB/s; a ceiling needs bytes that differ, not
    fresh entropy)."""
    base = torch.empty(min(block_bytes, dst.numel()), dtype=torch.uint8)
    base.random_(generator=torch.Generator().manual_seed(seed))
    for k, start in enumerate(range(0, dst.numel(), block_bytes)):
        view = dst[start:start + block_bytes]
        torch.add(base[:view.numel()], k & 255, out=view)
        if k >> 8:
            view.bitwise_xor_((k >> 8) & 255)


def _private(nbytes: int) -> HostSource:
    t = torch.empty(nbytes, dtype=torch.uint8)
    fill(t)
    return HostSource(memoryview(t.numpy()), False, None, t)


def host_source(nbytes: int, rank: int, everyone, barrier, limit_bytes: int = 32 << 30) -> HostSource:
    """The write ceilings' source: ``nbytes`` (this rank's state; up to ``limit_bytes``) on
    every rank. The lowest rank of each host writes the largest of its host's sizes into a
    /dev/shm file, every rank of the host maps it, and the file is unlinked once all have, or
    as soon as anything fails on the way. Where /dev/shm cannot be used (too small: its pages
    are reserved before the fill, so that fails as ENOSPC, not as SIGBUS in the fill), each
    rank builds its own buffer, as a single rank does. A run killed between the file's
    creation and its unlink (during the fill, or while the other ranks map it) leaves
    ``/dev/shm/safe_ckpt_bench_source_<pid>_<microseconds>`` holding up to ``limit_bytes`` of
    memory until it is removed by hand; once unlinked, the memory goes with the last mapping."""
    mine = host_key()
    peers = everyone({"host": mine, "rank": rank, "bytes": min(nbytes, limit_bytes)})
    local = [p for p in peers if p["host"] == mine]
    creator = min(p["rank"] for p in local)
    size = max(1, max(p["bytes"] for p in local))
    if len(local) == 1 or not os.path.isdir(_SHM):
        everyone(None)
        everyone(None)
        return _private(min(nbytes, limit_bytes))
    path, note, mapping, created = None, None, None, False
    try:
        if rank == creator:
            path = os.path.join(_SHM, f"safe_ckpt_bench_source_{os.getpid()}_{int(time.time() * 1e6)}")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                created = True
                try:
                    # ftruncate reserves nothing on tmpfs: a full /dev/shm would only show in the fill
                    os.posix_fallocate(fd, 0, size)
                    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(fd)
                t = torch.frombuffer(mapping, dtype=torch.uint8)
                fill(t)
                del t
            except OSError as exc:  # e.g. /dev/shm too small: every rank falls back alike
                note = f"{type(exc).__name__}: {exc}"
        made = everyone({"host": mine, "path": path, "note": note})
        mine_made = next(m for m in made if m["host"] == mine and m["path"])
        failed = any(m["note"] for m in made)
        if not failed and rank != creator:
            try:
                fd = os.open(mine_made["path"], os.O_RDONLY)
                try:
                    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
                finally:
                    os.close(fd)
            except OSError as exc:
                note = f"{type(exc).__name__}: {exc}"
        failed = any(everyone(note))  # every rank has mapped it (or one could not)
    finally:
        if created:
            try:
                os.unlink(path)
            except OSError:
                pass
    if failed:
        if mapping is not None:
            mapping.close()
        return _private(min(nbytes, limit_bytes))
    return HostSource(memoryview(mapping)[:min(nbytes, limit_bytes)], True, mapping)


def d2h_share(copy, device_bytes: int, everyone, barrier, reps: int = 3) -> dict:
    """Every rank copies its GPU bytes device-to-host into its own pinned buffer at the same
    moment (``copy()``, after a barrier; None: this rank has no GPU bytes), ``reps`` times;
    each rank's median seconds and its share of the bandwidth (GB/s), in rank order, and the
    aggregate (all ranks' bytes over the slowest rank's median). ``gbps`` is None for a rank
    without GPU bytes."""
    times = []
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        if copy is not None:
            copy()
        times.append(time.perf_counter() - t0)
    mine = statistics.median(times) if copy is not None else None
    gathered = everyone({"s": mine, "bytes": device_bytes if copy is not None else 0})
    seconds = [g["s"] for g in gathered]
    gbps = [None if g["s"] is None or not g["s"] else g["bytes"] / g["s"] / 1e9 for g in gathered]
    measured = [s for s in seconds if s]
    return {"gbps": gbps, "seconds": seconds, "device_bytes": [g["bytes"] for g in gathered], "reps": reps,
            "aggregate_gbps": sum(g["bytes"] for g in gathered) / max(measured) / 1e9 if measured else None}


def gather_result(result: dict | None, error: str | None, everyone) -> dict:
    """One row's outcome on every rank, the same dict everywhere: each numeric field the
    slowest (largest) rank's, ``by_rank`` the per-rank values of `BY_RANK`, or ``error`` (the
    first failing rank's message) where any rank failed."""
    gathered = everyone({"result": result, "error": error})
    errors = [(r, g["error"]) for r, g in enumerate(gathered) if g["error"] is not None]
    if errors:
        out = {"error": errors[0][1]}
        if len(gathered) > 1:
            out["error_ranks"] = [r for r, _ in errors]
        return out
    results = [g["result"] for g in gathered]
    out = {}
    for key, value in results[0].items():
        vals = [r.get(key) for r in results if isinstance(r.get(key), (int, float))]
        out[key] = max(vals) if vals else value
    out["by_rank"] = {k: [r.get(k) for r in results] for k in BY_RANK if any(k in r for r in results)}
    return out
