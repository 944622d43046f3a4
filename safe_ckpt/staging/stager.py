"""Bring one chunk's bytes to host memory the writer can read, by the shortest way.

One job: for a chunk of a source tensor return a `StagedChunk` whose `ready()` gives a
memoryview of exactly the chunk's bytes:
- contiguous host chunk: the source's own memory, no copy;
- non-contiguous host chunk: copied into a pool lease (in the writer's thread);
- device chunk: copied device-to-host into a pool lease (through the CUDA driver where it
  can, `cuda_driver`) on a dedicated stream that first waits on an event recorded on the
  producer's stream when the save started; with grid sums asked for, a large contiguous
  chunk's row and column sums (see `integrity`) are computed on a second stream beside the
  copies and copied, on the copy stream behind the chunk's copy, beside the payload, so the
  host never reads the payload to checksum it; `grid()` waits for them.

Must not: allocate host memory per save, synchronize a whole device or stream, copy
anything host-to-device, or write files.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from .. import cuda_driver
from ..integrity import grid_bytes, grid_sums
from .pool import Lease, PinnedPool
from .views import host_memoryview, run_split, run_views

log = logging.getLogger(__name__)

# Smaller chunks are hashed on the host: below this, the kernel launches per chunk (GIL-bound
# on the issuing thread) cost more than hashing on the host.
GRID_MIN_PAYLOAD_BYTES = 8 << 20


def sums_offset(chunk: torch.Tensor, nbytes: int, capacity_bytes: int) -> int | None:
    """Where a device chunk's grid sums go in its lease (after the payload, 16-byte aligned), or None
    where the host must hash it: too small, not contiguous, not viewable as int32, or no room."""
    if not (chunk.is_contiguous() and nbytes >= GRID_MIN_PAYLOAD_BYTES and chunk.data_ptr() % 4 == 0
            and chunk.storage_offset() * chunk.element_size() % 4 == 0):
        return None
    at = -(-nbytes // 16) * 16
    return at if at + grid_bytes(nbytes) <= capacity_bytes - 4096 else None


class StagedChunk:
    """A chunk's payload on its way to host memory; `ready()`, then `grid()`, then `release()`."""

    def __init__(self, nbytes: int, *, keep: torch.Tensor, lease: Lease | None = None,
                 pending_copy: torch.Tensor | None = None, event=None,
                 runs: list[torch.Tensor] | None = None, sums_at: int = 0) -> None:
        self.nbytes = nbytes
        self._keep = keep  # the source stays alive until the bytes are written
        self._lease = lease
        self._pending_copy = pending_copy
        self._event = event
        self._runs = runs
        self._sums_at = sums_at
        self._sums = None  # on the device until the copy of them has landed
        self._sums_event = None
        self._sums_issued: threading.Event | None = None  # set once the sums are enqueued (or given up)

    def ready(self) -> list[memoryview]:
        """The payload as memoryviews, in order (several for a strided host chunk)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        if self._lease is None:
            if self._runs is not None:
                return [host_memoryview(run) for run in self._runs]
            return [host_memoryview(self._keep)]
        if self._pending_copy is not None:
            _typed(self._lease, self._pending_copy).copy_(self._pending_copy)
            self._pending_copy = None
        return [host_memoryview(self._lease.tensor[:self.nbytes])]

    @property
    def from_source_memory(self) -> bool:
        """The payload is read from the source's own memory, not from a copy."""
        return self._lease is None

    def grid(self) -> memoryview | None:
        """The payload's grid sums as bytes (after `ready()`), or None where the host must hash it."""
        if self._sums_issued is not None:
            self._sums_issued.wait()
        if self._sums is None or self._lease is None:
            return None
        if self._sums_event is not None:
            self._sums_event.synchronize()
            self._sums_event = None
        return host_memoryview(self._lease.tensor[self._sums_at:self._sums_at + grid_bytes(self.nbytes)])

    def release(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        self._keep = None
        self._pending_copy = None
        self._sums = None


@dataclass(frozen=True)
class _PendingSums:
    """A staged chunk whose grid sums are still to be enqueued."""

    chunk: torch.Tensor
    staged: StagedChunk


def _typed(lease: Lease, like: torch.Tensor) -> torch.Tensor:
    return lease.tensor[:like.numel() * like.element_size()].view(like.dtype).view(like.shape)


@dataclass(frozen=True)
class ProducerFence:
    """Per-device events recorded on the caller's current streams when the save began."""

    events: dict  # device index -> torch.cuda.Event


def record_producer_fence(devices: set[int]) -> ProducerFence:
    events = {}
    for index in sorted(devices):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(index))
        events[index] = event
    return ProducerFence(events)


class Stager:
    """Stages chunks for one save. Per device, payload copies go on one side stream ordered
    after the producer's fence; each chunk's grid sums are computed on a second stream (the
    kernels read the device source, not the copy, so they run beside the copies instead of
    between them) and copied to the host on the first, right behind its chunk's copy, so they
    are never late for the writer. The sums' launches (the larger part of issuing a chunk) can
    wait until the writers are released (`stage`'s ``defer_sums``); deferred sums then queue
    behind every copy issued before them, which writers held back until the last copy is
    issued would be waiting for anyway."""

    def __init__(self, pool: PinnedPool, fence: ProducerFence | None = None, lease_timeout_s: float | None = None,
                 grid: bool = False, driver_copies: bool | None = None):
        """``grid``: compute grid sums on the device for the chunks where that pays (`StagedChunk.grid`);
        ``driver_copies``: enqueue contiguous copies through the CUDA driver (default: where it loads)."""
        self.pool = pool
        self.grid = grid
        self.fence = fence or ProducerFence({})
        self.lease_timeout_s = lease_timeout_s
        self._driver = cuda_driver.copies_available() if driver_copies is None else driver_copies
        self._streams: dict[int, object] = {}  # device -> copy stream
        self._kernel_streams: dict[int, object] = {}  # device -> grid sums' kernels, beside the copies
        self._last_copy: dict[int, object] = {}  # device -> the last event recorded on its stream
        self._pending: list[_PendingSums] = []
        self._lock = threading.Lock()
        self._sums_lock = threading.Lock()
        self.device_bytes = 0

    def _stream(self, index: int, streams: dict | None = None):
        """The device's copy stream (or one of ``streams``), ordered after the producer's fence."""
        streams = self._streams if streams is None else streams
        with self._lock:
            stream = streams.get(index)
            if stream is None:
                stream = torch.cuda.Stream(device=index)
                fence = self.fence.events.get(index)
                if fence is not None:
                    stream.wait_event(fence)
                streams[index] = stream
            return stream

    def stage(self, chunk: torch.Tensor, cancel: threading.Event | None = None, on_wait=None,
              defer_sums: bool = False) -> StagedChunk:
        """``on_wait`` is called once if the pool has no room yet and the lease must wait;
        ``defer_sums``: enqueue this chunk's grid sums at the next `flush_sums` instead of now
        (every deferred sum is flushed before a lease waits and before `wait_copies`)."""
        nbytes = chunk.numel() * chunk.element_size()
        contiguous = chunk.is_contiguous() or nbytes == 0
        split = None if contiguous else run_split(chunk)
        runs = None if split is None else run_views(chunk, split)
        if not self._device_path(chunk, nbytes, contiguous):
            if contiguous or runs is not None:
                return StagedChunk(nbytes, keep=chunk, runs=runs)
            lease = self.pool.lease(nbytes, self.lease_timeout_s, cancel, self._before_wait(on_wait))
            return StagedChunk(nbytes, keep=chunk, lease=lease, pending_copy=chunk)
        sums_at = self._sums_offset(chunk, nbytes, contiguous)
        total = nbytes if sums_at is None else sums_at + grid_bytes(nbytes)
        waited: list = []
        lease = self.pool.lease(total, self.lease_timeout_s, cancel, self._before_wait(on_wait, waited))
        try:
            # A lease that waited released the writers (on_wait): this chunk's sums go now.
            return self._stage_device(chunk, lease, nbytes, contiguous, runs, sums_at, defer_sums and not waited)
        except BaseException:
            self._release_after_copies(lease)
            raise

    def _release_after_copies(self, lease: Lease) -> None:
        """Give back the lease of a chunk whose staging failed (the pool is the process's: a
        failed save must not shrink the next one's), once no copy into it can still land."""
        try:
            for event in list(self._last_copy.values()):
                event.synchronize()
        except BaseException as exc:  # a broken context: better a smaller pool than a reused live range
            log.warning("keeping a %d-byte staging lease whose copies cannot be waited for: %s",
                        lease.nbytes, exc)
            return
        lease.release()

    def _device_path(self, chunk: torch.Tensor, nbytes: int, contiguous: bool) -> bool:
        return chunk.device.type != "cpu"

    def _stage_device(self, chunk, lease: Lease, nbytes: int, contiguous: bool, runs, sums_at, defer: bool):
        if nbytes == 0:
            return StagedChunk(0, keep=chunk, lease=lease)
        done = self._enqueue_copy(chunk, lease, contiguous, runs)
        self.device_bytes += nbytes
        staged = StagedChunk(nbytes, keep=chunk, lease=lease, event=done, sums_at=sums_at or 0)
        if sums_at is not None:
            self._add_sums(_PendingSums(chunk, staged), defer)
        return staged

    def _enqueue_copy(self, chunk: torch.Tensor, lease: Lease, contiguous: bool, runs):
        """Enqueue the chunk's device-to-host copy into the lease; the event that marks it landed."""
        index = chunk.device.index
        stream = self._stream(index)
        with torch.cuda.stream(stream):
            try:
                if runs is None and not contiguous:
                    # A strided copy makes torch build a contiguous temporary on the device first.
                    _typed(lease, chunk).copy_(chunk, non_blocking=True)
                else:
                    offset = 0
                    for run in runs or [chunk]:  # each run is contiguous: a plain D2H copy, no device temporary
                        n = run.numel() * run.element_size()
                        self._copy(lease.tensor, offset, run, n, stream)
                        offset += n
            finally:  # also after a failed run: the ones before it are queued and must be waited for
                done = self._mark(index, stream)
        return done

    def _mark(self, index: int, stream):
        """An event recorded on the device's stream, kept as its last: recorded and kept under
        the lock, so a flush of sums from another thread cannot leave an earlier event as the last."""
        with self._lock:
            done = torch.cuda.Event()
            done.record(stream)
            self._last_copy[index] = done
        return done

    def _add_sums(self, pending: _PendingSums, defer: bool) -> None:
        if defer:
            pending.staged._sums_issued = threading.Event()
            with self._sums_lock:
                self._pending.append(pending)
        else:
            self._issue_sums(pending)

    def _before_wait(self, on_wait, waited: list | None = None):
        def waiting() -> None:
            # A writer may be waiting for sums still deferred, and only its write frees the pool.
            if waited is not None:
                waited.append(True)
            self.flush_sums()
            if on_wait is not None:
                on_wait()
        return waiting

    def _copy(self, dst: torch.Tensor, offset: int, src: torch.Tensor, nbytes: int, stream) -> None:
        """Enqueue ``nbytes`` of the contiguous device tensor ``src`` into the host bytes ``dst`` at ``offset``."""
        if self._driver and cuda_driver.current_device() == stream.device_index:
            cuda_driver.memcpy_dtoh_async(dst.data_ptr() + offset, src.data_ptr(), nbytes, stream.cuda_stream)
        else:
            dst[offset:offset + nbytes].view(src.dtype).view(src.shape).copy_(src, non_blocking=True)

    def _issue_sums(self, pending: _PendingSums) -> None:
        staged, chunk = pending.staged, pending.chunk
        lease = staged._lease
        dst = None if lease is None else lease.tensor  # held: a writer may release the lease meanwhile
        try:
            if not self.grid or dst is None:
                return
            index = chunk.device.index
            stream = self._stream(index)
            with torch.cuda.stream(stream):
                try:
                    kernels = self._stream(index, self._kernel_streams)
                    try:
                        with torch.cuda.stream(kernels):
                            sums = grid_sums(chunk)
                    finally:  # also after a failure: the copy stream's last event follows every kernel launched
                        computed = torch.cuda.Event()
                        computed.record(kernels)
                        stream.wait_event(computed)
                    sums.record_stream(stream)  # freed on the kernels' stream, read on this one
                    self._copy(dst, staged._sums_at, sums, sums.numel() * 4, stream)
                except torch.cuda.OutOfMemoryError:
                    # Each failed allocation makes the caching allocator free (and synchronize)
                    # its cache: after one, the host hashes every chunk of this save.
                    log.warning("no device memory for checksum sums; hashing on the host for this save")
                    self.grid = False
                    return
                except RuntimeError as exc:  # a layout the int32 view refuses: the host hashes it
                    log.debug("device sums of a %d-byte chunk refused (%s); host hashing",
                              staged.nbytes, exc)
                    return
                finally:
                    done = self._mark(index, stream)
            staged._sums, staged._sums_event = sums, done
        finally:
            if staged._sums_issued is not None:
                staged._sums_issued.set()

    def flush_sums(self) -> None:
        """Enqueue every deferred grid sum, in staging order. A sum that cannot be enqueued
        leaves its chunk to be hashed on the host; no chunk is left waiting."""
        with self._sums_lock:
            pending, self._pending = self._pending, []
            for k, item in enumerate(pending):
                try:
                    self._issue_sums(item)
                except BaseException:
                    for rest in pending[k + 1:]:
                        rest.staged._sums_issued.set()
                    raise

    def drop_sums(self) -> None:
        """A failed save: let every deferred chunk's writer go on (to release it) without
        enqueuing its sums."""
        with self._sums_lock:
            pending, self._pending = self._pending, []
        for item in pending:
            item.staged._sums_issued.set()

    def _sums_offset(self, chunk: torch.Tensor, nbytes: int, contiguous: bool) -> int | None:
        """Where in the lease the grid sums of this device chunk go, or None to hash it on the host."""
        return sums_offset(chunk, nbytes, self.pool.capacity_bytes) if self.grid and contiguous else None

    def wait_copies(self) -> None:
        """Flush the deferred sums, then block until every device-to-host copy issued so far
        has landed (work on one stream completes in order, so its last event is enough)."""
        errors = []
        try:
            self.flush_sums()
        except BaseException as exc:
            errors.append(exc)
        for event in list(self._last_copy.values()):  # whatever failed, nothing may still be landing
            try:
                event.synchronize()
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
