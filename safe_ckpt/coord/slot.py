"""One save at a time per process.

One job: a save (sync or async, from any thread) holds the process's save slot from the
start of its planning until its last step has ended; a later save waits for it, at most
``timeout_s`` (the save's `SaveOptions.collective_timeout_s`), then fails on that rank,
before any collective, with a `CoordinationError` naming the save it waited for.
Why: two saves of one process would issue their collectives on the same group at the
same time, and a collective pairs with whichever one a peer issued at that position.
Must not: talk to other ranks or know what a save does.
"""

from __future__ import annotations

import threading
import time

from ..errors import CoordinationError

_cond = threading.Condition()
_holder: "Held | None" = None


class Held:
    """The slot, held by one save until `release()` (idempotent)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.since = time.monotonic()
        self.thread = threading.current_thread().name

    def release(self) -> None:
        global _holder
        with _cond:
            if _holder is self:
                _holder = None
                _cond.notify_all()


def acquire(target: str, timeout_s: float) -> Held:
    """Wait until no other save of this process runs, then hold the slot for ``target``."""
    global _holder
    deadline = time.monotonic() + timeout_s
    with _cond:
        while _holder is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                other = _holder
                raise CoordinationError(
                    f"safe_ckpt: the save of {target} waited {timeout_s:.0f} s for this process's save of "
                    f"{other.target} (started {time.monotonic() - other.since:.0f} s ago in thread "
                    f"{other.thread!r}) to end; one save runs at a time per process. Finish (wait for) the "
                    "earlier save first, or raise SaveOptions.collective_timeout_s"
                )
            _cond.wait(left)
        _holder = Held(target)
        return _holder
