"""The write phase's staging when an async save returns right after planning (`return_after="planned"`).

One job: for one rank's writer, build the copy window over every source it writes (device sources
copied on a side stream, host sources snapshotted into the pool, or, on a machine without CUDA,
copied by a simulated copy stream so their content is checked too), open it in the caller's thread
now or at the next trigger (`staging.gates.defer`: the Megatron drop-in opens it at the next
`optimizer.zero_grad()`, since Megatron synchronizes the device right after its save call), and
stage the rest on the writer's staging thread (`WindowCopier.run`), handing each staged chunk to the
writers. Once every copy is issued and has landed, the window settles (content sums compared) and
the writer counts as staged.

Order: the window copies the small sources first; where the writers must write every file front to
back (Megatron's integrity manifest hashes each file in order), staged items wait here until the
items before them in their file arrive.

Must not: write files, decide the layout, or talk to other ranks.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from ..errors import INTERRUPTS, CheckpointError
from ..residence.classify import HOST_RESIDENCES, Residence
from ..staging import gates
from ..staging.pool import PinnedPool, reserved_bytes
from ..staging.source_sums import DeviceSums, HostSums
from ..staging.streams import streams_for
from ..staging.views import chunk_view
from ..staging.window import CopyWindow, WindowSource
from ..staging.window_copier import ChunkJob, WindowCopier

if TYPE_CHECKING:
    from .pipeline import RankWriter

COPY_STARTS = ("now", "deferred")


def build_window(items, residences, sources, versions, *, name: str, rank: int, timeout_s: float,
                 page_locked: bool) -> CopyWindow:
    """The copy window over every source the rank's placed ``items`` write. Without CUDA, host
    sources go through the simulated copy stream of device 0 (ordered and content-checked)."""
    simulate = not torch.cuda.is_available()
    cuda, stageable = Residence.CUDA.value, {Residence.CUDA.value, *HOST_RESIDENCES}
    chunks, payload_bytes, keys = {}, {}, {}
    for item in items:
        chunk = item.chunk
        if chunk is None:
            continue
        i = chunk.local_index
        if residences[i] not in stageable:
            raise CheckpointError(f"internal error: {chunk.fqn!r} has residence {residences[i]!r}, which a copy "
                                  "window cannot stage")
        chunks[i] = chunks.get(i, 0) + 1
        payload_bytes[i] = payload_bytes.get(i, 0) + chunk.payload_bytes
        keys[i] = chunk.fqn
    window_sources = []
    for i in sorted(chunks):
        if residences[i] == cuda:
            device = sources[i].device.index
        else:
            device = 0 if simulate else None
        window_sources.append(WindowSource(index=i, key=keys[i], tensor=sources[i], device=device, chunks=chunks[i],
                                           size_bytes=payload_bytes[i], version=versions[i]))
    devices = {s.device for s in window_sources if s.device is not None}
    streams = streams_for(devices if not simulate else set(), page_locked=page_locked)
    sums = DeviceSums(streams) if devices and not simulate else HostSums()
    return CopyWindow(window_sources, streams, sums, name=name, rank=rank, timeout_s=timeout_s)


def pool_holds_every_chunk(items, pool: PinnedPool) -> bool:
    """The pool holds every chunk of the rank's placed ``items`` at once. Handed on in file order,
    the small sources copied first keep their leases until the items before them arrive: with a
    smaller pool those items may never get one."""
    return sum(reserved_bytes(item.chunk.payload_bytes) for item in items if item.chunk is not None) \
        <= pool.capacity_bytes


class WindowStaging:
    """The staging of one writer through a copy window (see the module docstring)."""

    def __init__(self, window: CopyWindow, pool: PinnedPool, *, copy_start: str = "now",
                 in_file_order: bool = False, grid: bool = False) -> None:
        if copy_start not in COPY_STARTS:
            raise ValueError(f"copy_start={copy_start!r} must be one of {COPY_STARTS}")
        self.window = window
        self.pool = pool
        self.copy_start = copy_start
        self.in_file_order = in_file_order
        self.grid = grid  # device chunks' grid sums on the copy stream (`WindowCopier`)
        self.copier: WindowCopier | None = None
        self._writer: RankWriter | None = None
        self._lock = threading.Lock()
        self._order = threading.Lock()  # hands items on in file order (``in_file_order``)
        self._opened = False  # the opener ran (or was abandoned): it never runs again
        self._go = threading.Event()  # the staging thread may go on (opened, or abandoned)
        self._rest: list[ChunkJob] | None = None
        self._objects: list = []
        self._jobs: list[ChunkJob] = []
        self._next: dict[int, int] = {}  # file index -> the next item to hand on (in file order)
        self._held: dict[int, dict[int, tuple]] = {}  # file index -> {position: (item, staged)}
        self._seq: dict[int, int] = {}  # id(item) -> its position in its file
        self.interrupt: BaseException | None = None  # an interrupt in `begin`, raised once the threads run

    # ------------------------------------------------------------------ caller's thread
    def begin(self, writer: "RankWriter") -> None:
        """In the caller's thread, from `RankWriter.start`: open the window now, or leave the
        opener for the next trigger."""
        self._writer = writer
        try:
            self._prepare(writer)
        except BaseException as exc:  # the save fails through its vote; the staging thread goes on at once
            writer.fail(None, exc)
            self.abandon()
            if isinstance(exc, INTERRUPTS):
                self.interrupt = exc
            return
        if self.copy_start == "deferred":
            gates.defer(self.open)
            return
        try:
            self.open()
        except INTERRUPTS as exc:  # the writer's threads must start first: the job raises it (`raise_interrupt`)
            self.interrupt = exc

    def raise_interrupt(self) -> None:
        """In the caller's thread once the writer's threads run: an interrupt met in `begin`, as itself."""
        if self.interrupt is not None:
            raise self.interrupt

    def _prepare(self, writer: "RankWriter") -> None:
        self.copier = WindowCopier(self.window, self.pool, snapshot_host=True, on_wait=writer.release_writers,
                                   grid=self.grid)
        per_file: dict[int, int] = {}
        for file_index, item in writer._interleaved():
            self._seq[id(item)] = per_file.get(file_index, 0)
            per_file[file_index] = self._seq[id(item)] + 1
            if item.obj is not None:
                self._objects.append((file_index, item))
                continue
            chunk = item.chunk
            view = chunk_view(writer.work.sources[chunk.local_index], chunk.shard_box.offsets, chunk.shard_box.sizes)
            self._jobs.append(ChunkJob(chunk.local_index, view, (file_index, item)))
        gates.guard_memory_saver()

    def open(self) -> None:
        """Open the window in this thread (the caller's, or the training step's at the trigger):
        the small sources are copied and the caller's streams ordered after them; then the window
        is tracked, so every gate waits for it."""
        with self._lock:
            if self._opened:
                return
            self._opened = True
        writer = self._writer
        try:
            if not self.window.cancelled.is_set():  # the writer fails the window on any failure
                self._rest = self.copier.open(self._jobs, self._put)
                gates.track(self.window)
        except BaseException as exc:  # the save fails through its vote; the caller goes on, unless interrupted
            writer.fail(None, exc)
            if isinstance(exc, INTERRUPTS):
                raise
        finally:
            self._go.set()

    def abandon(self) -> None:
        """The save failed: a window not yet opened never opens, and the staging thread goes on."""
        with self._lock:
            if self._opened:
                return  # the opener is running or ran: it sets `_go` itself
            self._opened = True
        self._go.set()

    # ------------------------------------------------------------------ staging thread
    def stage_all(self) -> None:
        """The writer's staging thread: objects, then every chunk through the window, then settle."""
        writer = self._writer
        try:
            for file_index, item in self._objects:
                self._put((file_index, item), writer.work.object_payloads[item.fqn])
            if not any(s.device is not None for s in self.window.sources.values()) or \
                    writer.large_chunks([job.item[1] for job in self._jobs]):
                writer.release_writers()
            self._go.wait()
            if self._rest is not None and not self.window.cancelled.is_set():
                self.copier.run(self._rest, self._put)
        except BaseException as exc:
            writer.fail(None, exc)
        finally:
            writer.release_writers()
            try:  # every issued copy landed; the content sums agree (a window never opened raises its failure)
                self.window.settle()
            except BaseException as exc:
                writer.fail(None, exc, first_only=True)
            finally:
                self._drop_held()
                writer.staging_done()

    def _put(self, tag, staged) -> None:
        file_index, item = tag
        if not self.in_file_order:
            self._hand_on(file_index, item, staged)
            return
        with self._order:  # handed on under the lock: two threads (opener, staging) must not cross
            self._held.setdefault(file_index, {})[self._seq[id(item)]] = (item, staged)
            held = self._held[file_index]
            position = self._next.get(file_index, 0)
            while position in held:
                self._hand_on(file_index, *held.pop(position))
                position += 1
            self._next[file_index] = position

    def _hand_on(self, file_index: int, item, staged) -> None:
        try:
            self._writer.hand_on(file_index, item, staged)
        except BaseException:
            if hasattr(staged, "release"):
                staged.release()
            raise

    def _drop_held(self) -> None:
        with self._order:
            held, self._held = self._held, {}
        for entries in held.values():
            for _, staged in entries.values():
                if hasattr(staged, "release"):
                    staged.release()
