"""The copy window of one save: which source bytes are not yet in host memory, and the gate that
makes a write to a saved tensor wait for them.

One job: track, per source, the chunks whose copy (device source) or capture (host source:
snapshotted into the pool, or written from its own memory) is still to come and the copy
stream's mark after each device source's last copy; answer a gate; say, once every copy has
landed, whether a source changed under the window (its version counter at copy time, its content
sums at the opening and after its last copy).

Lifecycle of one save's window: `open()` in the caller's thread (copy streams ordered after the
caller's current streams); the copier reports every chunk (`before_copy`, then `issued`,
`issued_together` or `captured`); `order_opening()` once the small sources are copied (the opening
sums of every source not yet wholly copied are enqueued, and the caller's streams wait for all of
it: a source copied before that needs no sums); `settle()` in the save's own thread after the
copier is done: waits for every issued copy to land, compares the sums, closes. `fail(exc)` may
come at any time, from any thread.

A gate (`before_update`), in the thread about to write:
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

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..errors import CheckpointError, SourceModifiedError, StagingTimeoutError
from ..units import human_bytes
from .source_sums import SourceSums
from .streams import CopyStreams, Mark

log = logging.getLogger("safe_ckpt")

# Sources below this size are copied first, from the caller's thread as the window opens, and the
# caller's stream waits for them: a write to one before the optimizer step (the MoE router's expert
# bias, rewritten at the end of backward) then comes after its copy.
SMALL_SOURCE_BYTES = 1 << 20


@dataclass(frozen=True)
class WindowSource:
    index: int  # the source's local index in the rank's plan
    key: str  # its fqn, for errors
    tensor: torch.Tensor
    device: Optional[int]  # the copy stream's device; None: host-resident (captured by the host)
    chunks: int  # chunks to copy or capture
    size_bytes: int
    version: int  # the tensor's version counter when the save planned it


@dataclass(frozen=True)
class WindowChunk:
    index: int  # the source's index
    size_bytes: int


@dataclass(frozen=True)
class WindowStats:
    gates: int  # gates met while the window was open
    blocked_gates: int  # of them, those that blocked the host
    gate_wait_s: float  # host time spent blocked in gates
    open_s: float  # from open() until settled (or until now)
    copied_bytes: int  # device bytes whose copies were issued
    captured_bytes: int  # host bytes snapshotted or written
    pending_bytes: int  # bytes neither issued nor captured yet


class CopyWindow:
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
        """In the caller's thread, before any copy."""
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

    def order_opening(self) -> None:
        """In the caller's thread once the small sources are copied: the opening sums of every
        source with copies still to come are enqueued, its current streams wait for those
        copies and sums; the sources wholly copied are released."""
        if self.sums is not None:
            checked = [s for s in self.sources.values() if s.device is not None and self._left[s.index] > 0
                       and self.sums.checks(s.tensor)]
            for slot, source in enumerate(checked):
                self._slots[source.index] = slot
                self.sums.reserve(slot, source.tensor)
            for device in self._devices:  # one stream hand-off per device, not one per source
                mine = [(self._slots[s.index], s.tensor) for s in checked if s.device == device]
                if mine:
                    self.streams.call(device, lambda mine=mine, sums=self.sums: self._measure_all(sums, mine, 0))
        marks = [self.streams.mark(device) for device in self._devices]
        with self._cond:
            for mark in marks:
                self._device_last[mark.device] = mark
        for mark in marks:
            self.streams.order_current_after(mark)
        with self._cond:
            self._released.update(i for i, left in self._left.items() if left == 0)

    def before_copy(self, index: int, keep: bool = True) -> None:
        """A chunk of source ``index`` is about to be copied or snapshotted: its memory is kept
        from reuse (not with ``keep=False``: a copy before `order_opening`, which the caller's
        streams wait for), and a moved version counter fails the save (raised here too)."""
        source = self.sources[index]
        if source.tensor._version != source.version:
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

    # ------------------------------------------------------------------ gates
    def _all_in_locked(self) -> bool:
        return self._incomplete == 0

    def before_update(self, what: str = "an update", unmap: bool = False) -> None:
        """The gate (see the module docstring), in the thread about to write; ``what`` names the writer."""
        with self._cond:
            if self._opened_at is None or self._settled_at is not None:
                return
            if self.error is None:
                self._gates += 1
                moved = [s for i, s in self.sources.items()
                         if i not in self._released and s.tensor._version != s.version]
                if moved:
                    self._fail_locked(self._modified_error(moved[0], f"its version counter moved before {what}: an "
                                                           "in-place write came before its bytes were copied"))
            blocked = self.error is None and not self._all_in_locked()
            if blocked:
                self._block_locked(what)
            if self.error is None:
                self._released.update(i for i, left in self._left.items() if left == 0)
            marks = list(self._device_last.values())
            failed = self.error
        if failed is not None:
            if unmap:
                self._wait_landed(marks, what)
            return
        t0 = time.monotonic()
        waits = getattr(self.streams, "ordering_blocks_host", False) and not all(mark.done() for mark in marks)
        for mark in marks:
            try:
                self.streams.order_current_after(mark)
            except BaseException as exc:
                self.fail(exc)
                raise CheckpointError(f"rank {self.rank}: {what} could not be ordered after the copies of the save to "
                                      f"{self.name} ({type(exc).__name__}: {exc}); that save fails") from exc
        if waits:  # the host itself waited for the copies to land
            with self._cond:
                self._wait_s += time.monotonic() - t0
                self._blocked += 0 if blocked else 1
        if unmap:
            self._wait_landed(marks, what)

    def _block_locked(self, what: str) -> None:
        self.gate_blocked.set()
        self._blocked += 1
        log.info("%s waits for the save to %s: %s still to be copied (rank %d)", what, self.name,
                 human_bytes(self._pending_bytes), self.rank)
        t0 = time.monotonic()
        done = self._cond.wait_for(lambda: self.error is not None or self._all_in_locked(), self.timeout_s)
        self._wait_s += time.monotonic() - t0
        if not done:
            remedy = ("a staging pool as large as the rank's saved bytes (staging_budget_bytes), or a faster target, "
                      "lets the copies finish within the step") if self._devices else (
                "host tensors are written from their own memory, at the target's speed, before the next step may "
                "change them: a faster target, a larger collective_timeout_s or a synchronous save")
            self._fail_locked(StagingTimeoutError(
                f"rank {self.rank} abandoned the save to {self.name}: {what} waited {self.timeout_s:g} s for "
                f"{human_bytes(self._pending_bytes)} still to be copied or written; {remedy}"))
        if self.error is not None:
            log.warning("the save to %s failed while %s waited for it (%s); training goes on, the save publishes "
                        "nothing", self.name, what, type(self.error).__name__)

    def _wait_landed(self, marks: list[Mark], what: str) -> None:
        for mark in marks:
            if not self.streams.wait(mark, self.timeout_s):
                raise CheckpointError(f"rank {self.rank}: {what} waited {self.timeout_s:g} s for the copies of the "
                                      f"save to {self.name} to land; not going on while they may still read that "
                                      "memory")

    # ------------------------------------------------------------------ state
    def small(self, index: int) -> bool:
        """Source ``index`` is copied at the opening (see `SMALL_SOURCE_BYTES`)."""
        return self.sources[index].size_bytes < self.small_source_bytes

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
                               pending_bytes=self._pending_bytes)
