"""SaveHandle: an asynchronous save that finishes in a background thread.

One job: run the remaining collective steps of a save (join the writers, vote,
commit) off the caller's thread, keep at most one save in flight per process, and
finish pending saves before the interpreter exits. Must not: contain save logic.
"""

from __future__ import annotations

import atexit
import logging
import threading

log = logging.getLogger("safe_ckpt")

_inflight_lock = threading.Lock()
_inflight: list["SaveHandle"] = []


def wait_for_previous() -> None:
    """One save at a time per process: block until the asynchronous ones in flight are done."""
    with _inflight_lock:
        previous = list(_inflight)
    for handle in previous:
        handle._thread.join()


class SaveHandle:
    """An asynchronous save whose device bytes are already staged.

    `wait()` returns the `SaveResult` or raises the save's `CheckpointError`;
    `done()` tells whether it has finished. Every rank must let its handle finish
    (the remaining steps are collective).
    """

    def __init__(self, job, stall_s: float) -> None:
        self.stall_s = stall_s
        self._job = job
        self._result = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="safe_ckpt-finish", daemon=True)
        with _inflight_lock:
            _inflight.append(self)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._job.finish(stall_s=self.stall_s)
        except BaseException as exc:
            self._error = exc
        finally:
            self._job = None
            with _inflight_lock:
                if self in _inflight:
                    _inflight.remove(self)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None):
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"safe_ckpt: save still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._thread.join(timeout)
        return self._error


@atexit.register
def _finish_inflight_at_exit() -> None:
    with _inflight_lock:
        pending = list(_inflight)
    for handle in pending:
        log.warning("safe_ckpt: waiting for an asynchronous save to finish before exit")
        handle._thread.join()


