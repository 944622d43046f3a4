"""The copy window of one save: which source bytes are not yet in host memory, and the gate that
makes a write to a saved tensor wait for them.

One job: track, per source, the chunks whose copy (device source) or capture (host source:
snapshotted into the pool, or written from its own memory) is still to come and the copy
stream's mark after each device source's last copy; answer a gate; say, once every copy has
landed, whether a source changed under the window (its version counter at copy time, its content
sums at the opening and after its last copy).

Lifecycle: `open()` in the caller's thread (copy streams after its streams); the copier reports
every chunk (`before_copy`, then `issued`, `issued_together` or `captured`); `order_opening()` once
the small sources are copied (opening sums enqueued for the rest; the caller's streams run nothing
more before all that is done, or, held since `open`, are released once it is); `settle()` in the
save's thread once the copier is done: every copy landed, sums compared, closed. `fail(exc)` may
come at any time, from any thread.

A gate (`before_update`, in `window_gate`), in the thread about to write:
1. a source not yet released whose version counter moved fails the save (an in-place write came
   before its bytes were copied);
2. while any chunk is not yet issued or captured, the host blocks (the pool is smaller than the
   state and only writes free it, or host sources are still being captured), at most
   ``timeout_s``: past it the save is abandoned (`StagingTimeoutError`) and the write goes on;
3. the caller's current stream waits for each device's last mark: the host goes on at once;
4. before an unmap (``unmap=True``), the host blocks until those marks are done.
Once the window failed, a gate returns at once (an unmap still waits for copies already issued).

Must not: install hooks (`gates` does), write files, lease memory, or choose the copy order
(`window_copier` does).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from ..errors import CheckpointError, SourceModifiedError, StagingTimeoutError  # noqa: F401 (tests import it here)
from .source_sums import SourceSums
from .stream_hold import StreamHold
from .streams import CopyStreams, Mark
from .window_gate import WindowGate
from .window_records import WindowChunk, WindowSource, WindowStats  # noqa: F401 (callers import them here)

# Sources below this size are copied first, and the opener's stream waits for them: a write to one
# before the optimizer step (the MoE router's expert bias, rewritten in backward) comes after its copy.
SMALL_SOURCE_BYTES = 1 << 20


class CopyWindow(WindowGate):
    def __init__(self, sources: list[WindowSource], streams: CopyStreams, sums: SourceSums | None = None, *,
                 name: str, rank: int, timeout_s: float = 600.0,
                 small_source_bytes: int = SMALL_SOURCE_BYTES) -> None:
        """``name``: the save's checkpoint directory (errors name it); ``timeout_s``: the longest a
        gate blocks the host, and a bound on waits for copies to land; ``small_source_bytes``:
        sources below it are copied at the opening."""
        self.name = name
        self.small_source_bytes = small_source_bytes
        self.rank = rank
        self.timeout_s = timeout_s
        self.streams = streams
        self.sums = sums
        self.sources = {s.index: s for s in sources}
        self._left = {s.index: s.chunks for s in sources}
        self._incomplete = sum(1 for s in sources if s.chunks > 0)
        self._pending_bytes = sum(s.size_bytes for s in sources)
        self._devices = sorted({s.device for s in sources if s.device is not None})
        self._device_last: dict[int, Mark] = {}
        self._released: set[int] = set()
        self._kept: set[int] = set()
        self._checked_at_opening: set[int] = set()  # small sources whose versions the held opening checked
        self._opening_held = False
        self._reserved: dict[int, int] = {}  # source index -> sums slot, taken before a held opening
        self._slots: dict[int, int] = {}  # source index -> content-sums slot
        self._cond = threading.Condition()
        self._opened_at: float | None = None
        self._settled_at: float | None = None
        self._on_settled: list[Callable[[], None]] = []
        self.error: BaseException | None = None
        self.cancelled = threading.Event()  # set when the window fails: the copier stops
        self.gate_blocked = threading.Event()  # set once a gate has blocked the host (tests, progress)
        self._gates = 0
        self._blocked = 0
        self._wait_s = 0.0
        self._copied = 0
        self._captured = 0

    # ------------------------------------------------------------------ the copier's side
    def open(self) -> None:
        """In the caller's thread, before any copy (and before its streams are held)."""
        with self._cond:
            if self._opened_at is not None:
                raise RuntimeError("a copy window opens once")
            self._opened_at = time.monotonic()
        for device in self._devices:
            self.streams.fence(device)

    @staticmethod
    def _measure_all(sums: SourceSums, slots: list, phase: int) -> None:
        for slot, tensor in slots:
            sums.measure(slot, phase, tensor)

    def _measure(self, source: WindowSource, phase: int) -> None:
        slot, sums, tensor = self._slots[source.index], self.sums, source.tensor
        self.streams.call(source.device, lambda: sums.measure(slot, phase, tensor))

    def order_opening(self, hold: "StreamHold | None" = None) -> None:
        """Once the small sources' copies are enqueued: the opening sums of every source with
        copies still to come are enqueued, and the caller's current streams run nothing more before
        those copies and sums are done; the sources wholly copied are released. In the caller's
        thread, its streams wait for them; with ``hold`` (the caller's streams held since `open`,
        this called from the staging thread), the host waits for them, then releases the hold."""
        if self.sums is not None:
            checked = [s for s in self.sources.values() if s.device is not None and self._left[s.index] > 0
                       and (s.index in self._reserved if self._reserved else self.sums.checks(s.tensor))]
            for slot, source in enumerate(checked):
                if self._reserved:  # slots taken by `reserve_sums`
                    slot = self._reserved[source.index]
                else:
                    self.sums.reserve(slot, source.tensor)
                self._slots[source.index] = slot
            for device in self._devices:  # one stream hand-off per device, not one per source
                mine = [(self._slots[s.index], s.tensor) for s in checked if s.device == device]
                if mine:
                    self.streams.call(device, lambda mine=mine, sums=self.sums: self._measure_all(sums, mine, 0))
        marks = [self.streams.mark(device) for device in self._devices]
        with self._cond:
            for mark in marks:
                self._device_last[mark.device] = mark
        if hold is None:
            for mark in marks:
                self.streams.order_current_after(mark)
        else:
            self._opening_held = True
            try:
                for mark in marks:
                    if not self.streams.wait(mark, self.timeout_s):
                        raise CheckpointError(f"rank {self.rank}: the opening copies of the save to {self.name} did "
                                              f"not land within {self.timeout_s:g} s; is the device hung?")
                    mark.synchronize()  # raises a failed copy's error
            finally:  # released on every path: the caller's streams must never wait for good
                hold.release()
        with self._cond:
            self._released.update(i for i, left in self._left.items() if left == 0)

    def reserve_sums(self) -> None:
        """In the opener's thread before its streams are held: a sums slot for every device source,
        and the sums' device memory taken now (an allocation that had to free cached device memory
        would wait for the held streams, on the staging thread that must release them)."""
        if self.sums is not None:
            checked = [s for s in self.sources.values() if s.device is not None and self.sums.checks(s.tensor)]
            for slot, source in enumerate(checked):
                self._reserved[source.index] = slot
                self.sums.reserve(slot, source.tensor)
            self.sums.allocate()

    def check_small_versions(self) -> None:
        """In the opener's thread once its streams are held: the small sources' versions, checked now
        (a write it enqueues later runs after their copies, on the staging thread). Raises a moved one."""
        for source in self.sources.values():
            if source.device is not None and self.small(source.index):
                if source.tensor._version != source.version:
                    self._modified(source, "its version counter moved before its bytes were copied")
                    raise self.error
                self._checked_at_opening.add(source.index)

    def before_copy(self, index: int, keep: bool = True) -> None:
        """A chunk of source ``index`` is about to be copied or snapshotted: its memory is kept
        from reuse (not with ``keep=False``: a copy before `order_opening`, which the caller's
        streams wait for), and a moved version counter fails the save (raised here too)."""
        source = self.sources[index]
        if index not in self._checked_at_opening and source.tensor._version != source.version:
            self._modified(source, "its version counter moved before its bytes were copied")
            raise self.error
        if keep and source.device is not None and index not in self._kept:
            self._kept.add(index)
            self.streams.keep(source.device, source.tensor)

    def issued(self, index: int, chunk_bytes: int) -> Mark:
        """One more copy of device source ``index`` is enqueued; the mark after it (after the
        source's closing sums, for its last copy)."""
        source = self.sources[index]
        left = self._left[index] - 1  # only the issuing thread changes a device source's count
        if left == 0 and index in self._slots:
            self._measure(source, 1)
        mark = self.streams.mark(source.device)
        with self._cond:
            self._left[index] = left
            self._device_last[source.device] = mark
            self._copied += chunk_bytes
            self._pending_bytes -= chunk_bytes
            if left == 0:
                self._incomplete -= 1
                self._cond.notify_all()
        return mark

    def issued_together(self, device: int, chunks: list[WindowChunk]) -> Mark:
        """Copies of several whole sources on ``device`` are enqueued, before `order_opening`
        (no sums yet); one mark after them all."""
        mark = self.streams.mark(device)
        with self._cond:
            for chunk in chunks:
                self._left[chunk.index] -= 1
                self._copied += chunk.size_bytes
                self._pending_bytes -= chunk.size_bytes
                if self._left[chunk.index] == 0:
                    self._incomplete -= 1
            self._device_last[device] = mark
            self._cond.notify_all()
        return mark

    def captured(self, index: int, chunk_bytes: int) -> None:
        """One more chunk of host source ``index`` is in the pool or written."""
        source = self.sources.get(index)
        if source is None:  # settled (a failed save's late snapshot): nothing reads it any more
            return
        with self._cond:  # checked before the gate may let a step go: a later write is the step's own
            if source.tensor._version != source.version:
                self._fail_locked(self._modified_error(source, "its version counter moved before all its bytes "
                                                       "were captured"))
            self._left[index] -= 1
            self._captured += chunk_bytes
            self._pending_bytes -= chunk_bytes
            if self._left[index] == 0:
                self._incomplete -= 1
                self._cond.notify_all()

    def on_settled(self, callback: Callable[[], None]) -> None:
        with self._cond:
            if self._settled_at is None:
                self._on_settled.append(callback)
                return
        callback()

    def fail(self, exc: BaseException) -> None:
        """The save failed: every gate goes on at once and the copier stops. The first failure stays."""
        with self._cond:
            self._fail_locked(exc)

    def _fail_locked(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            self.cancelled.set()
            self._cond.notify_all()

    def _modified_error(self, source: WindowSource, how: str) -> SourceModifiedError:
        return SourceModifiedError(
            f"{source.key!r} on rank {self.rank} changed while the save to {self.name} was copying it ({how}); "
            "the checkpoint would be torn, so it is not committed. Change saved tensors only in "
            "`optimizer.step()` or after `before_update()` (docs/options.md, \"Returning right after planning\")")

    def _modified(self, source: WindowSource, how: str) -> None:
        self.fail(self._modified_error(source, how))

    def settle(self) -> None:
        """In the save's thread once the copier is done: wait for every issued copy to land,
        compare the content sums, close (the sources and sums are dropped: only the stats stay).
        Raises the window's failure, if any. Once settled, a second call only raises that failure
        again."""
        with self._cond:
            if self._settled_at is not None:
                if self.error is not None:
                    raise self.error
                return
            marks = list(self._device_last.values())
            if self._opened_at is None:
                self._fail_locked(CheckpointError(f"internal error: the copy window of the save to {self.name} "
                                                  "was settled without being opened; nothing was copied"))
        try:
            for mark in marks:
                if not self.streams.wait(mark, self.timeout_s):
                    raise CheckpointError(f"rank {self.rank}: the copies of the save to {self.name} did not land "
                                          f"within {self.timeout_s:g} s; is the device hung?")
                mark.synchronize()  # raises a failed copy's error
            self._check_unsummed_versions()
            if self.error is None and self._slots:
                by_slot = {slot: self.sources[index] for index, slot in self._slots.items()}
                changed = [by_slot[slot] for slot in self.sums.changed()]
                if changed:
                    more = f" (and {len(changed) - 1} more: {', '.join(repr(s.key) for s in changed[1:4])})" \
                        if len(changed) > 1 else ""
                    self._modified(changed[0], "its bytes differ between the window's opening and its last copy: a "
                                   f"write no gate ordered, e.g. through `.data` or from another stream{more}")
        except BaseException as exc:
            self.fail(exc)
        finally:
            with self._cond:
                self._settled_at = time.monotonic()
                callbacks, self._on_settled = self._on_settled, []
                # A kept handle keeps the window (for its stats): it must not keep the saved tensors or sums.
                self.sources, self.sums, self._slots, self._kept = {}, None, {}, set()
                self._cond.notify_all()
            self.streams.close()
            for callback in callbacks:
                callback()
        if self.error is not None:
            raise self.error

    def _check_unsummed_versions(self) -> None:
        """Every copy landed: a device source no content sums cover (non-contiguous) and no gate
        released, whose version counter moved, may have been written while its copies ran."""
        with self._cond:
            moved = [s for i, s in self.sources.items() if s.device is not None and i not in self._slots
                     and i not in self._released and s.tensor._version != s.version]
            if moved and self.error is None:
                self._fail_locked(self._modified_error(moved[0], "its version counter moved before its copies were "
                                                       "known to have landed, with no gate in between"))

    # ------------------------------------------------------------------ state
    def small(self, index: int) -> bool:
        """Source ``index`` is copied at the opening (see `SMALL_SOURCE_BYTES`)."""
        return self.sources[index].size_bytes < self.small_source_bytes

    @property
    def devices(self) -> list[int]:  # those whose copy streams this window uses
        return list(self._devices)

    @property
    def is_open(self) -> bool:
        return self._opened_at is not None and self._settled_at is None

    @property
    def is_settled(self) -> bool:
        return self._settled_at is not None

    def all_in(self) -> bool:
        """Every chunk is issued (device) or captured (host)."""
        with self._cond:
            return self._all_in_locked()

    def last_marks(self) -> dict[int, Mark]:
        with self._cond:
            return dict(self._device_last)

    def stats(self) -> WindowStats:
        with self._cond:
            end = self._settled_at if self._settled_at is not None else time.monotonic()
            return WindowStats(gates=self._gates, blocked_gates=self._blocked, gate_wait_s=self._wait_s,
                               open_s=0.0 if self._opened_at is None else end - self._opened_at,
                               copied_bytes=self._copied, captured_bytes=self._captured,
                               pending_bytes=self._pending_bytes, opening_held=self._opening_held)
