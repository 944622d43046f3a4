"""Bring one copy window's chunks into the staging pool, small sources first.

One job: for each chunk, in window order, take a pool lease and bring the chunk's bytes into it
(a device chunk by a copy enqueued on its device's copy stream, a host chunk by a copy on one of a
few snapshot threads), report the chunk to the window, and hand the staged chunk (the stager's
`StagedChunk`, which the writers already consume) to the caller's ``put``. With a pool smaller
than the state, a lease waits for the writers to free space, as the stager's leases do, and the
window's gates wait only for what is not yet issued. Without snapshots (an async save that
writes host sources from their own memory), a host chunk is staged by the stager as today and
the writer reports it to the window once it is written (`CopyWindow.captured`).

Order: the chunks of sources below the window's small-source size first, staged in the caller's
thread by `open` (their copies are what the caller's stream waits for at the opening); then the
rest, in the order given (the write pipeline's interleaved file order), by `run` on the staging
thread.

Must not: write files, lay out items, allocate host memory outside the pool, or synchronize a
device (it waits only on the marks of copies it enqueued, and only when a staging fails).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import CheckpointError
from ..integrity import grid_bytes, grid_sums
from .pool import Lease, PinnedPool, reserved_bytes, split
from .stager import StagedChunk, Stager, sums_offset
from .views import run_split, run_views
from .window import CopyWindow, WindowChunk

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkJob:
    source: int  # the `WindowSource.index` the chunk belongs to
    view: torch.Tensor  # the chunk's view of its source
    item: Any  # what the writer needs with the bytes (the pipeline's placed item)


def window_order(jobs: list[ChunkJob], window: CopyWindow) -> tuple[list[ChunkJob], list[ChunkJob]]:
    """(the small sources' chunks, the rest), each in the order given."""
    small = [job for job in jobs if window.small(job.source)]
    rest = [job for job in jobs if not window.small(job.source)]
    return small, rest


class _Snapshot:
    """A host chunk's copy into its lease, done by a snapshot thread; `synchronize` as a mark's."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error


class WindowCopier:
    def __init__(self, window: CopyWindow, pool: PinnedPool, *, snapshot_host: bool = True,
                 lease_timeout_s: float | None = None, on_wait: Callable[[], None] | None = None,
                 snapshot_threads: int = 4, grid: bool = False) -> None:
        """``snapshot_host``: host chunks are copied into the pool (else written from their own
        memory, and reported by the writer); ``on_wait``: called once when a lease must wait
        for space (the pipeline lets its writers start there); ``snapshot_threads``: threads that
        copy host chunks during `run` (a memcpy releases the GIL; one thread copies ~5-10 GB/s);
        ``grid``: a device chunk of `stager.GRID_MIN_PAYLOAD_BYTES` or more also gets its grid sums on
        the copy stream, as the stager's do (else a writer hashes it on the host, holding the GIL
        the training thread needs while the window is open)."""
        self.window = window
        self.pool = pool
        self.snapshot_host = snapshot_host
        self.lease_timeout_s = lease_timeout_s
        self.on_wait = on_wait
        self.snapshot_threads = max(1, snapshot_threads)
        self.grid = grid
        self._snapshots: ThreadPoolExecutor | None = None
        self._opening_bytes = 0
        self._host_stager = Stager(pool, lease_timeout_s=lease_timeout_s, driver_copies=False)

    def open(self, jobs: list[ChunkJob], put: Callable[[Any, StagedChunk], None]) -> list[ChunkJob]:
        """In the caller's thread: open the window, stage the small sources' chunks (one whose
        lease is not free at once is left for `run`), order the caller's streams after them.
        Returns the jobs left for `run`, in window order."""
        try:
            self.window.open()
            small, rest = window_order(jobs, self.window)
            later = self._stage_opening(small, put)
            self.window.order_opening()
            return later + rest
        except BaseException as exc:
            self.window.fail(exc)
            raise

    def _stage_opening(self, jobs: list[ChunkJob], put: Callable[[Any, StagedChunk], None]) -> list[ChunkJob]:
        """Stage the small sources' chunks in the caller's thread; returns those whose lease was
        not free at once. Whole contiguous device sources share one lease and one mark per device
        (a few hundred norms and biases would otherwise cost a lease, an event and a stream
        hand-off each, in the training thread)."""
        later: list[ChunkJob] = []
        together: dict[int, list[ChunkJob]] = {}
        for job in jobs:
            source = self.window.sources[job.source]
            nbytes = job.view.numel() * job.view.element_size()
            if source.device is not None and source.chunks == 1 and nbytes and job.view.is_contiguous() \
                    and self._sums_offset(job.view, nbytes) is None:
                together.setdefault(source.device, []).append(job)
                continue
            staged = self._stage(job, wait=False)
            if staged is None:
                later.append(job)
            else:
                put(job.item, staged)
        for device, group in together.items():
            if not self._stage_together(device, group, put):
                for job in group:
                    staged = self._stage(job, wait=False)
                    if staged is None:
                        later.append(job)
                    else:
                        put(job.item, staged)
        left = {id(job) for job in later}  # counted by `_settle_grid` among the staging thread's jobs
        self._opening_bytes = sum(reserved_bytes(job.view.numel() * job.view.element_size()) for job in jobs
                                  if id(job) not in left and job.view.numel() and self._in_pool(job))
        return later

    def _stage_together(self, device: int, jobs: list[ChunkJob], put: Callable[[Any, StagedChunk], None]) -> bool:
        """Copy whole small device sources into one lease, reported under one mark; False where
        that lease is not free at once (nothing was staged)."""
        sizes = [job.view.numel() * job.view.element_size() for job in jobs]
        lease = self._lease(sum(reserved_bytes(n) for n in sizes), wait=False)
        if lease is None:
            return False
        parts = split(lease, sizes)
        streams = self.window.streams
        try:
            for job, part in zip(jobs, parts):
                self.window.before_copy(job.source, keep=False)  # the caller's streams wait for these copies
                streams.copy(device, part.tensor, job.view)
            mark = self.window.issued_together(device, [WindowChunk(job.source, n) for job, n in zip(jobs, sizes)])
        except BaseException:
            self._release_after_copies(lease, device)
            raise
        handed = 0
        try:
            for job, part, n in zip(jobs, parts, sizes):
                put(job.item, StagedChunk(n, keep=job.view, lease=part, event=mark))
                handed += 1
        except BaseException:  # the part whose put raised is the dispatch's now; those never put are ours
            if streams.wait(mark, self.window.timeout_s):
                for part in parts[handed + 1:]:
                    part.release()
            raise
        return True

    def run(self, jobs: list[ChunkJob], put: Callable[[Any, StagedChunk], None]) -> None:
        """On the staging thread: stage every job in order. A failure fails the window and is raised."""
        try:
            self._settle_grid(jobs)  # here, not at the opening: the small sources copied there take no sums
            for job in jobs:
                if self.window.cancelled.is_set():
                    raise self.window.error or CheckpointError("staging cancelled")
                put(job.item, self._stage(job, wait=True))
        except BaseException as exc:
            self.window.fail(exc)
            raise
        finally:
            if self._snapshots is not None:
                self._snapshots.shutdown(wait=True)  # every snapshot is reported before `run` returns
                self._snapshots = None

    def _stage(self, job: ChunkJob, wait: bool) -> StagedChunk | None:
        window = self.window
        source = window.sources[job.source]
        view = job.view
        if source.device is None and not self.snapshot_host:
            window.before_copy(job.source)
            return self._host_stager.stage(view, window.cancelled)
        nbytes = view.numel() * view.element_size()
        if nbytes == 0:
            window.before_copy(job.source)
            if source.device is None:
                window.captured(job.source, 0)
                return StagedChunk(0, keep=view)
            return StagedChunk(0, keep=view, event=window.issued(job.source, 0))
        window.before_copy(job.source)
        sums_at = self._sums_offset(view, nbytes) if source.device is not None else None
        lease = self._lease(nbytes if sums_at is None else sums_at + grid_bytes(nbytes), wait)
        if lease is None:
            return None
        try:
            dst = lease.tensor[:nbytes]
            if source.device is None:
                if not wait:  # the caller's thread, at the opening: small, copied at once
                    dst.view(view.dtype).view(view.shape).copy_(view)
                    window.captured(job.source, nbytes)
                    return StagedChunk(nbytes, keep=view, lease=lease)
                return StagedChunk(nbytes, keep=view, lease=lease,
                                   event=self._snapshot(job.source, dst, view, nbytes))
            self._copy(source.device, dst, view)
            sums = self._sums(source.device, view, lease, sums_at) if sums_at is not None else None
            mark = window.issued(job.source, nbytes)  # after the sums: the gates and writers wait for them too
            staged = StagedChunk(nbytes, keep=view, lease=lease, event=mark, sums_at=sums_at or 0)
            if sums is not None:
                staged._sums, staged._sums_event = sums, mark
            return staged
        except BaseException:
            self._release_after_copies(lease, source.device)
            raise

    def _settle_grid(self, jobs: list[ChunkJob]) -> None:
        """No sums where they alone would make a pool that holds every chunk at once too small (its
        gates would then wait for writes): the host hashes those chunks instead."""
        if not self.grid:
            return
        plain = with_sums = self._opening_bytes  # the small sources staged at the opening, without sums
        for job in jobs:
            device = self.window.sources[job.source].device
            nbytes = job.view.numel() * job.view.element_size()
            if nbytes == 0 or not self._in_pool(job):
                continue
            at = self._sums_offset(job.view, nbytes) if device is not None else None
            plain += reserved_bytes(nbytes)
            with_sums += reserved_bytes(nbytes if at is None else at + grid_bytes(nbytes))
        if plain <= self.pool.capacity_bytes < with_sums:
            self.grid = False

    def _in_pool(self, job: ChunkJob) -> bool:
        return self.snapshot_host or self.window.sources[job.source].device is not None

    def _sums_offset(self, view: torch.Tensor, nbytes: int) -> int | None:
        """Where this device chunk's grid sums go in its lease, or None to hash it on the host."""
        if not self.grid or self.pool.pinned != (view.device.type == "cuda"):
            return None
        return sums_offset(view, nbytes, self.pool.capacity_bytes)

    def _sums(self, device: int, view: torch.Tensor, lease: Lease, at: int) -> list | None:
        """Enqueue on the copy stream the chunk's grid sums and their copy into the lease after
        ``at``; returns what keeps the sums alive until the writer has them (they are freed in the
        stream's order), or None where they cannot be enqueued (the host hashes the chunk)."""
        dst = lease.tensor[at:at + grid_bytes(view.numel() * view.element_size())].view(torch.int32)
        kept: list = []

        def enqueue() -> None:
            sums = grid_sums(view)
            dst.copy_(sums, non_blocking=True)  # into the pinned pool: ordered on the copy stream
            kept.append(sums)

        try:
            self.window.streams.call(device, enqueue)
        except torch.cuda.OutOfMemoryError:
            log.warning("no device memory for checksum sums; hashing this save's remaining chunks on the host")
            self.grid = False
            return None
        except RuntimeError as exc:  # a layout the int32 view refuses
            log.debug("device sums of a chunk refused (%s); host hashing", exc)
            return None
        return kept

    def _snapshot(self, index: int, dst: torch.Tensor, view: torch.Tensor, nbytes: int) -> _Snapshot:
        """Copy a host chunk into its lease on a snapshot thread; the window hears of it once copied."""
        done = _Snapshot()

        def copy() -> None:
            try:
                dst.view(view.dtype).view(view.shape).copy_(view)
                self.window.captured(index, nbytes)
            except BaseException as exc:
                done.error = exc
                self.window.fail(exc)
            finally:
                done._done.set()

        if self._snapshots is None:
            self._snapshots = ThreadPoolExecutor(self.snapshot_threads, thread_name_prefix="safe_ckpt-snapshot")
        self._snapshots.submit(copy)
        return done

    def _lease(self, nbytes: int, wait: bool) -> Lease | None:
        if not wait:
            try:
                return self.pool.lease(nbytes, 0.0, self.window.cancelled)
            except CheckpointError:
                return None
        return self.pool.lease(nbytes, self.lease_timeout_s, self.window.cancelled, self.on_wait)

    def _copy(self, device: int, dst: torch.Tensor, view: torch.Tensor) -> None:
        streams = self.window.streams
        split = None if view.is_contiguous() else run_split(view)
        if split is None:
            streams.copy(device, dst, view)
            return
        offset = 0
        for run in run_views(view, split):  # each run contiguous: no device temporary
            n = run.numel() * run.element_size()
            streams.copy(device, dst[offset:offset + n], run)
            offset += n

    def _release_after_copies(self, lease: Lease, device: int | None) -> None:
        """Give back the lease of a chunk whose staging failed once no copy into it can still land."""
        if device is None:  # snapshots are synchronous
            lease.release()
            return
        streams = self.window.streams
        try:
            if not streams.wait(streams.mark(device), self.window.timeout_s):
                raise TimeoutError(f"copies still running after {self.window.timeout_s:g} s")
        except BaseException as exc:  # better a smaller pool than a reused range a copy may still fill
            log.warning("keeping a %d-byte staging lease whose copies cannot be waited for: %s", lease.nbytes, exc)
            return
        lease.release()
