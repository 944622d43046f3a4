"""SaveHandle: an asynchronous save that finishes in a background thread.

One job: run the remaining collective steps of a save (join the writers, vote,
commit) off the caller's thread, and finish pending saves before the interpreter exits.
Must not: contain save logic.

A failure nobody was told about is never silent:
- when an asynchronous save fails, its background thread logs an ERROR on the
  ``safe_ckpt`` logger naming the checkpoint directory and the error, at once (whether or
  not anyone waits for the handle later);
- at interpreter exit (an ``atexit`` handler) every save still running is waited for; if
  one of them failed and its error was never observed, by `SaveHandle.wait()` raising it
  or `SaveHandle.exception()` returning it, the handler logs an ERROR naming each such
  checkpoint, flushes the logging handlers, stdout and stderr, and ends the process with
  ``os._exit(1)``: the exit status is 1 whatever it would have been, and the ``atexit``
  handlers registered before safe_ckpt was imported do not run. A process killed by a
  signal, or ended with ``os._exit``, runs no ``atexit`` handler: then only the ERROR line
  written when the save failed remains.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading

log = logging.getLogger("safe_ckpt")

_inflight_lock = threading.Lock()
_inflight: list["SaveHandle"] = []
_unobserved: list["SaveHandle"] = []  # failed, and nobody has seen the error yet


def _forget_in_child() -> None:
    # A forked child has none of the parent's save threads: nothing of theirs to wait for at its exit.
    global _inflight_lock
    _inflight_lock = threading.Lock()
    _inflight.clear()
    _unobserved.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class SaveHandle:
    """An asynchronous save whose device bytes are already staged, or, with
    ``return_after="planned"``, one returned right after planning whose copies are still running.

    `wait()` returns the `SaveResult` or raises the save's `CheckpointError`;
    `done()` tells whether it has finished. Every rank must let its handle finish
    (the remaining steps are collective). `stall_s` is the call's time; the host time steps
    spent waiting at the copy window's gates is `window_stats().gate_wait_s`.
    """

    def __init__(self, job, stall_s: float) -> None:
        self.stall_s = stall_s
        self.checkpoint_dir = job.checkpoint_dir
        self._job = job
        self._window = job.window  # kept after the job is dropped: its stats stay readable
        self._result = None
        self._error: BaseException | None = None
        # Set last in `_run`: `Thread.join` cut short by Ctrl-C marks the thread stopped for good on
        # Python 3.11 (every later join returns at once), so waits never rely on it.
        self._finished = threading.Event()
        self._waiters = 0  # threads in `wait`/`exception` now: they are handed a failure, so it is not also logged
        self._thread = threading.Thread(target=self._run, name="safe_ckpt-finish", daemon=True)
        with _inflight_lock:
            _inflight.append(self)
        try:
            self._thread.start()
        except BaseException:  # never started: nothing to wait for, at exit either
            with _inflight_lock:
                if self in _inflight:
                    _inflight.remove(self)
            self._finished.set()
            raise

    def _run(self) -> None:
        try:
            self._result = self._job.finish(stall_s=self.stall_s)
        except BaseException as exc:
            self._error = exc
            with _inflight_lock:
                waited_for = self._waiters > 0
                _unobserved.append(self)
            (log.debug if waited_for else log.error)(
                "asynchronous save of %s failed: %s", self.checkpoint_dir,
                str(exc).removeprefix("safe_ckpt: ") or type(exc).__name__)
        finally:
            self._job = None
            with _inflight_lock:
                if self in _inflight:
                    _inflight.remove(self)
            self._finished.set()

    def _observed(self) -> BaseException | None:
        with _inflight_lock:
            if self in _unobserved:
                _unobserved.remove(self)
        return self._error

    def _open_deferred(self) -> None:
        """A copy window still waiting for its trigger opens now, in this thread: whoever waits
        for the save (or polls it) must not wait for a training step that may never come."""
        if not self._finished.is_set():
            from ..staging import gates

            gates.open_deferred()

    def done(self) -> bool:
        self._open_deferred()
        return self._finished.is_set()

    def before_update(self) -> None:
        """Wait until changing this save's source tensors is safe (a deferred window is opened
        first); call it before writing them other than in a torch optimizer's step, which waits by
        itself. A no-op once the window closed, and without one."""
        from ..staging import gates

        gates.open_deferred()
        if self._window is not None:
            self._window.before_update(what="SaveHandle.before_update()")

    def window_closed(self) -> bool:
        """Every source byte is in host memory (or the save failed): the sources may change."""
        window = self._window
        return window is None or window.is_settled or window.error is not None

    def wait_window_closed(self, timeout: float | None = None) -> bool:
        """Block until `window_closed()` (True) or ``timeout`` seconds passed (False)."""
        if self._window is None:
            return True
        self._open_deferred()
        closed = threading.Event()
        self._window.on_settled(closed.set)
        return closed.wait(timeout)

    def window_stats(self):
        """The copy window's `WindowStats` (gates met, host time blocked, bytes copied), or None."""
        return None if self._window is None else self._window.stats()

    def _wait(self, timeout: float | None) -> bool:
        with _inflight_lock:
            self._waiters += 1
        try:
            return self._finished.wait(timeout)
        finally:
            with _inflight_lock:
                self._waiters -= 1

    def wait(self, timeout: float | None = None):
        self._open_deferred()
        if not self._wait(timeout):
            raise TimeoutError(f"safe_ckpt: save still running after {timeout} s")
        if self._observed() is not None:
            raise self._error
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._open_deferred()
        if not self._wait(timeout):
            return None
        return self._observed()


def count_at_exit(failed) -> None:
    """Count a save that failed without a `SaveHandle` (one that failed before its writes began)
    like a failed asynchronous save: unless `mark_observed(failed)` comes first, the exit handler
    names it and ends the process with status 1. ``failed`` has a ``checkpoint_dir`` and an
    ``_error``, as a `SaveHandle` has."""
    with _inflight_lock:
        if failed not in _unobserved:
            _unobserved.append(failed)


def mark_observed(failed) -> None:
    """Someone was told of ``failed``'s error (it was raised to a caller)."""
    with _inflight_lock:
        if failed in _unobserved:
            _unobserved.remove(failed)


@atexit.register
def _finish_inflight_at_exit() -> None:
    with _inflight_lock:
        pending = list(_inflight)
    if pending:  # a copy window still waiting for its trigger: nobody else will open it now
        from ..staging import gates

        gates.open_deferred()
    for handle in pending:
        log.warning("waiting for the asynchronous save of %s to finish before exit",
                    handle.checkpoint_dir)
        while not handle._finished.wait(0.5):  # join is not used: see `SaveHandle.__init__`
            if not handle._thread.is_alive():
                break
    with _inflight_lock:
        failed = list(_unobserved)
    if not failed:
        return
    for handle in failed:
        log.error("the asynchronous save of %s failed and nobody waited for it (see the error "
                  "above: %s); exiting with status 1", handle.checkpoint_dir, type(handle._error).__name__)
    for handler in logging.getLogger().handlers + log.handlers + [logging.lastResort]:
        try:
            if handler is not None:
                handler.flush()
        except Exception:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(1)
