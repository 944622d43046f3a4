"""A fixed budget of pinned host memory, allocated once and leased out per chunk.

One job: hand out byte ranges of one long-lived buffer and take them back. The buffer
is allocated on the first lease (never per save), kept for the life of the process
(so `torch.cuda.empty_cache()` or emptying the pinned host cache does not touch it),
and given back only by `release()`. Without CUDA the buffer is ordinary host memory.

Must not: allocate per save, copy data, or know about chunks or files.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from ..errors import CheckpointError

log = logging.getLogger(__name__)
_ALIGN_BYTES = 4096


@dataclass(frozen=True)
class PoolStats:
    capacity_bytes: int
    allocated_bytes: int  # what the pool holds now (0 before first use / after release)
    allocations: int  # how many times the buffer was allocated over the pool's life
    leased_bytes: int
    peak_leased_bytes: int


class Lease:
    """A byte range of the pool; ``tensor`` is a uint8 view of it."""

    def __init__(self, pool: "PinnedPool", offset: int, nbytes: int, reserved: int) -> None:
        self.pool = pool
        self.offset = offset
        self.nbytes = nbytes
        self._reserved = reserved
        self.tensor = pool._buffer[offset:offset + nbytes]
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.tensor = None
            self.pool._free(self.offset, self._reserved)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class LeasePart:
    """One range of a lease shared by several chunks (`split`); the lease goes back to the pool
    once every part is released."""

    def __init__(self, shared: "_Shared", start: int, nbytes: int) -> None:
        self._shared = shared
        self.nbytes = nbytes
        self.tensor = shared.lease.tensor[start:start + nbytes]

    def release(self) -> None:
        self._shared.release(self)


class _Shared:
    def __init__(self, lease: Lease, parts: int) -> None:
        self.lease = lease
        self._left = parts
        self._lock = threading.Lock()

    def release(self, part: LeasePart) -> None:
        with self._lock:  # a part released twice, even by two threads at once, counts once
            if part.tensor is None:
                return
            part.tensor = None
            self._left -= 1
            last = self._left == 0
        if last:
            self.lease.release()


def split(lease: Lease, sizes: list[int]) -> list[LeasePart]:
    """Cut ``lease`` into parts of ``sizes`` bytes, each starting on the pool's alignment (the
    lease must hold ``sum(reserved_bytes(n))``): one lease for many small chunks, one pool
    lock taken instead of one a chunk."""
    shared = _Shared(lease, len(sizes))
    parts, at = [], 0
    for n in sizes:
        parts.append(LeasePart(shared, at, n))
        at += reserved_bytes(n)
    if at > lease.nbytes:
        raise ValueError(f"parts of {at} bytes do not fit a lease of {lease.nbytes}")
    return parts


class PinnedPool:
    """First-fit allocator over one buffer; `lease` blocks until enough room is free."""

    def __init__(self, capacity_bytes: int, pinned: bool | None = None) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self._cond = threading.Condition()
        self._buffer: torch.Tensor | None = None
        self._free_list: list[list[int]] = []  # [offset, size], sorted by offset
        self._leased = 0
        self._peak = 0
        self._allocations = 0
        self._registered = False

    def _host_buffer(self) -> torch.Tensor:
        """The memory the pool is made of, allocated once (a subclass may take it elsewhere)."""
        return host_buffer(self.capacity_bytes)

    def _ensure_buffer(self) -> None:
        if self._buffer is None:
            t0 = time.perf_counter()
            buffer = self._host_buffer()
            if self.pinned:
                # Page-lock our own allocation instead of asking torch's pinned cache, which
                # rounds sizes up to a power of two and is what `_host_emptyCache` empties.
                err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), self.capacity_bytes, 0)
                if int(err) != 0:
                    raise CheckpointError(f"cudaHostRegister of {self.capacity_bytes} bytes failed: error {int(err)}")
                self._registered = True
            self._buffer = buffer
            self._free_list = [[0, self.capacity_bytes]]
            self._allocations += 1
            log.info(
                "allocated %s staging pool of %.2f GiB in %.2f s: the staging budget, whatever this save stages; "
                "kept for later saves and loads (staging_budget_bytes sets it)",
                "pinned" if self.pinned else "host", self.capacity_bytes / 2**30, time.perf_counter() - t0,
            )

    def preallocate(self) -> None:
        """Allocate (and page-lock) the buffer now rather than in the first save."""
        with self._cond:
            self._ensure_buffer()

    def lease(self, nbytes: int, timeout_s: float | None = None, cancel: threading.Event | None = None,
              on_wait=None) -> Lease:
        """Block until ``nbytes`` are free; give up at ``timeout_s`` or once ``cancel`` is set.
        ``on_wait()`` runs once, outside the pool's lock, before the first wait."""
        reserved = reserved_bytes(nbytes)
        if reserved > self.capacity_bytes:
            raise CheckpointError(f"a chunk of {nbytes} bytes does not fit the staging pool of {self.capacity_bytes}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if on_wait is not None:
            with self._cond:
                self._ensure_buffer()
                lease = self._take(nbytes, reserved)
            if lease is not None:
                return lease
            on_wait()
        with self._cond:
            self._ensure_buffer()
            while True:
                lease = self._take(nbytes, reserved)
                if lease is not None:
                    return lease
                if cancel is not None and cancel.is_set():
                    raise CheckpointError("staging cancelled")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise CheckpointError(f"timed out waiting for {nbytes} bytes of staging memory")
                self._cond.wait(0.1 if remaining is None else min(remaining, 0.1))

    def _take(self, nbytes: int, reserved: int) -> Lease | None:
        """First fit; the caller holds the lock."""
        for entry in self._free_list:
            if entry[1] >= reserved:
                offset = entry[0]
                entry[0] += reserved
                entry[1] -= reserved
                if entry[1] == 0:
                    self._free_list.remove(entry)
                self._leased += reserved
                self._peak = max(self._peak, self._leased)
                return Lease(self, offset, nbytes, reserved)
        return None

    def _free(self, offset: int, size: int) -> None:
        with self._cond:
            self._leased -= size
            free = self._free_list
            free.append([offset, size])
            free.sort()
            merged: list[list[int]] = []
            for entry in free:
                if merged and merged[-1][0] + merged[-1][1] == entry[0]:
                    merged[-1][1] += entry[1]
                else:
                    merged.append(entry)
            self._free_list = merged
            self._cond.notify_all()

    def stats(self) -> PoolStats:
        with self._cond:
            return PoolStats(
                capacity_bytes=self.capacity_bytes,
                allocated_bytes=0 if self._buffer is None else self.capacity_bytes,
                allocations=self._allocations,
                leased_bytes=self._leased,
                peak_leased_bytes=self._peak,
            )

    def reset_peak(self) -> None:
        with self._cond:
            self._peak = self._leased

    def release(self) -> None:
        """Give the buffer back; the next lease allocates again."""
        with self._cond:
            if self._leased:
                raise CheckpointError("cannot release the staging pool while chunks are leased")
            if self._buffer is not None and self._registered:
                torch.cuda.cudart().cudaHostUnregister(self._buffer.data_ptr())
                self._registered = False
            self._buffer = None
            self._free_list = []


def host_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of pageable host memory as a uint8 tensor (the pool page-locks it itself)."""
    return torch.empty(nbytes, dtype=torch.uint8)


_shared_lock = threading.Lock()
_shared: dict[str, PinnedPool] = {}


def reserved_bytes(nbytes: int) -> int:
    """What a lease of ``nbytes`` takes from a pool."""
    return max(_ALIGN_BYTES, -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES)


def shared_pool(capacity_bytes: int) -> PinnedPool:
    """The process-wide pool, created on first use; a different budget replaces it."""
    with _shared_lock:
        pool = _shared.get("pool")
        if pool is None or pool.capacity_bytes != capacity_bytes:
            if pool is not None:
                log.info("staging budget changed to %d bytes; replacing the pool", capacity_bytes)
                pool.release()
            pool = PinnedPool(capacity_bytes)
            _shared["pool"] = pool
        return pool


def prepare(capacity_bytes: int) -> PinnedPool:
    """Allocate the process-wide staging pool now (e.g. at startup), not in the first save."""
    pool = shared_pool(capacity_bytes)
    pool.preallocate()
    return pool


def release() -> None:
    """Free the process-wide staging pool (it is allocated again by the next save that needs it)."""
    with _shared_lock:
        pool = _shared.pop("pool", None)
    if pool is not None:
        pool.release()
