"""The gate half of the copy window: what a thread about to write a saved tensor waits for.

One job: `before_update` (the rules are in `window`'s docstring: version counters, blocking while
chunks are not yet issued or captured, ordering the caller's stream after the last marks, waiting
for the copies to land before an unmap). A base of `window.CopyWindow`, whose state it reads under
the window's condition.
Must not: copy, measure, or change what the copier reports.
"""

from __future__ import annotations

import logging
import time

from ..errors import CheckpointError, StagingTimeoutError
from ..units import human_bytes
from .streams import Mark

log = logging.getLogger("safe_ckpt")


class WindowGate:
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
