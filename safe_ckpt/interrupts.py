"""Interrupts that must wait: a `KeyboardInterrupt` or `SystemExit` met while an outcome is
being made final (a checkpoint swapped into place and not yet durable, a tracker half written).

One job: `Deferred` keeps the first interrupt met in such a stretch, holds a SIGINT sent to the
main thread meanwhile (Python's default handler only; other threads never receive signals), and
runs idempotent steps again when an interrupt cut them short, so the caller can finish first and
raise the interrupt after. Must not: swallow an interrupt (the caller raises what it kept), or
decide what is finished.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, TypeVar

from .errors import INTERRUPTS

STEP_ATTEMPTS = 3  # an idempotent step cut short by an interrupt is run again, this many times in all
T = TypeVar("T")


class Deferred:
    """The interrupts of one stretch that must finish; raise `first` once it has."""

    def __init__(self) -> None:
        self.first: BaseException | None = None

    def keep(self, exc: BaseException) -> None:
        if self.first is None:
            self.first = exc

    @contextlib.contextmanager
    def holding_sigint(self):
        """Within the block a SIGINT to the main thread is kept (as a `KeyboardInterrupt`), not raised."""
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            yield self
            return
        signal.signal(signal.SIGINT, lambda signum, frame: self.keep(KeyboardInterrupt()))
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def step(self, fn: Callable[[], T]) -> T:
        """``fn()`` (idempotent), run again when an interrupt cuts it short; the interrupt is kept.
        After `STEP_ATTEMPTS` cut-short runs the last interrupt propagates."""
        for _ in range(STEP_ATTEMPTS - 1):
            try:
                return fn()
            except INTERRUPTS as exc:
                self.keep(exc)
        return fn()
