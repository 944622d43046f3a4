"""Keep the cyclic garbage collector off the training process's heap during a save.

One job: while a save runs, move the objects that existed when it began into the
collector's permanent generation (`gc.freeze()`) and put them back when it ends
(`gc.unfreeze()`). A save allocates tens of objects per stored item; the collections that
triggers each walk the whole heap, a generation-2 pause per save in a process with torch
and megatron-core loaded, none with the freeze (benchmarks/diag/gc_pauses.py; figures in
benchmarks/results/HISTORY.md). The collector still runs; it only skips what was already there, and garbage among those
objects is collected after the save (for an async save, that can be some training steps
later). Nothing is done if the collector is disabled.

A process that froze objects itself (fork-based data loaders do, inference engines do after
warm-up; CPython 3.12 starts with 375 objects frozen), before or during a save, is not frozen
or unfrozen by safe_ckpt from then on, since unfreezing would undo its freeze. Its saves hold
off the collector's oldest generation instead (CPython before 3.14, where that generation
exists): its threshold is raised for the save and put back after (unless the process set its
own meanwhile), so no automatic collection walks the whole heap during the save (an explicit
`gc.collect()` still does); the younger generations are still collected. Without this, such a
process meets a full pass inside the planning of a save on some rank
(benchmarks/results/plan_exchange_8ranks_qwen3-4b-dp8_2026-12-04.md).

Either way the pass is moved, not removed: cyclic garbage among the held objects waits for the
save to end, and the first full pass after it walks the whole heap then (between saves, where
a training loop meets such passes anyway).

Must not: disable the collector, or leave objects frozen or a threshold raised after the last
save ends.
"""

from __future__ import annotations

import gc
import logging
import threading

from .. import compat

log = logging.getLogger(__name__)


# The oldest generation's threshold while a save holds it off: a count of younger-generation
# passes no save reaches.
HELD_THRESHOLD = 2**31 - 1


class _Freezer:
    """Process-wide (the collector is): nested holds share one freeze.

    `gc.get_freeze_count()` walks the whole permanent generation (a large training process's
    whole heap), so it is asked only while nothing is frozen, where it costs nothing. Whether the process froze objects itself during the save
    is told by a sentinel created just after our freeze: a freeze by anyone else moves it into
    the permanent generation too, and finding it among the unfrozen objects costs only the
    objects created since (the older ones are frozen)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._sentinel: list | None = None
        self._process_freezes = False  # once seen, safe_ckpt never freezes or unfreezes again
        self._oldest_before: int | None = None  # the oldest generation's threshold we replaced

    def acquire(self) -> None:
        with self._lock:
            if self._holders == 0 and gc.isenabled():
                if not self._process_freezes and gc.get_freeze_count() == 0:
                    gc.freeze()
                    self._sentinel = [None]  # a list is tracked from birth, so it starts in generation 0
                    log.debug("froze the heap for the save")
                else:
                    if not self._process_freezes:
                        log.debug("the process freezes objects itself; the save holds off "
                                  "the collector's oldest generation instead")
                    self._process_freezes = True
                    self._hold_oldest()
            self._holders += 1

    def _hold_oldest(self) -> None:
        if not compat.generational_gc():
            return
        now = gc.get_threshold()
        self._oldest_before = now[2]
        gc.set_threshold(now[0], now[1], HELD_THRESHOLD)

    def _release_oldest(self) -> None:
        before, self._oldest_before = self._oldest_before, None
        if before is None:
            return
        now = gc.get_threshold()
        if now[2] == HELD_THRESHOLD:  # the younger generations' values are whatever the process set meanwhile
            gc.set_threshold(now[0], now[1], before)
        else:  # the process set its own oldest threshold meanwhile: it stands
            log.debug("the collector's oldest threshold changed during the save; left as it is")

    def release(self) -> None:
        with self._lock:
            if self._holders == 0:
                return
            self._holders -= 1
            if self._holders > 0:
                return
            self._release_oldest()
            if self._sentinel is not None:
                sentinel, self._sentinel = self._sentinel, None
                # Frozen meanwhile by someone else (an async save spans training steps):
                # unfreezing would undo their freeze, so leave it, and from now on stay out.
                if any(o is sentinel for o in gc.get_objects()):  # the unfrozen objects only
                    gc.unfreeze()
                else:
                    self._process_freezes = True

    @property
    def frozen_by_us(self) -> bool:
        return self._sentinel is not None


FREEZER = _Freezer()


class Hold:
    """One save's claim on the freeze; `release()` is idempotent."""

    def __init__(self, enabled: bool) -> None:
        self._held = enabled
        if enabled:
            FREEZER.acquire()

    def release(self) -> None:
        if self._held:
            self._held = False
            FREEZER.release()
