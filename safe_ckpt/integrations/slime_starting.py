"""An asleep save whose state dict is still being built: the build runs in a thread.

One job: run the build of an asleep save (`slime_asleep.start_asleep_save`) off the caller's
thread, so that slime's `save_model` returns at once, and hand its outcome to whoever waits:
the `SaveHandle` writing the checkpoint, or the build's error. A build error nobody was told of
counts at exit like a failed asynchronous save (`safe_ckpt.saving.handle.count_at_exit`): an exiting
process ends with status 1.

Must not: build anything itself, or touch the device beyond setting the build thread's device.
"""

from __future__ import annotations

import logging
import threading
import time

from ..saving import handle as handle_mod
from ..errors import CheckpointError

log = logging.getLogger("safe_ckpt")


class StartingSave:
    """An asleep save whose state dict is built and planned in a thread, so that `save_model`
    returns at once; `done`/`wait` cover the build and then the `SaveHandle`'s writes.

    The build reads only the model's and optimizer's structure (no bytes, no device work: the
    paused memory is not touched until the writes read the CPU backup), and nothing the build
    reads changes before the next `wake_up()`, which waits for this save first.
    """

    def __init__(self, build, iteration, checkpoint_dir: str = "") -> None:
        self.iteration = iteration
        self.checkpoint_dir = checkpoint_dir or f"iteration {iteration}"  # named at exit if it fails unseen
        self.handle = None
        self.error: BaseException | None = None
        self._built = threading.Event()
        device = _current_cuda_device()  # slime sets it in the actor's main thread only
        # Not a daemon: an exiting process first lets the build finish (bounded by the group's
        # timeout), and its writes are then waited for, or reported, like any async save's.
        self._thread = threading.Thread(target=self._run, args=(build, device), daemon=False,
                                        name=f"safe_ckpt-asleep-build-{iteration}")
        self._thread.start()

    def _run(self, build, device) -> None:
        try:
            if device is not None:
                import torch

                torch.cuda.set_device(device)
            self.handle = build()
        except BaseException as exc:  # raised to whoever waits for this save
            self.error = exc
            log.error("the asleep save of iteration %s failed before writing: %s: %s; it is "
                      "raised at the next wake_up", self.iteration, type(exc).__name__, exc)
            handle_mod.count_at_exit(self)  # until someone is told, as a failed asynchronous save
        finally:
            self._built.set()

    @property
    def _error(self) -> BaseException | None:  # what `safe_ckpt.saving.handle`'s exit report names
        return self.error

    def take_error(self) -> BaseException | None:
        """The build's error, now counted as seen (it no longer makes the process exit 1)."""
        if self.error is not None:
            handle_mod.mark_observed(self)
        return self.error

    def done(self) -> bool:
        return self._built.is_set() and (self.handle is None or self.handle.done())

    def wait(self, timeout: float | None = None):
        start = time.monotonic()
        if not self._built.wait(timeout):
            raise TimeoutError(f"the asleep save of iteration {self.iteration} is still building its state dict")
        if self.take_error() is not None:
            raise self.error
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        return self.handle.wait(timeout=left)


def _current_cuda_device() -> int | None:
    try:
        import torch

        return torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    except Exception:  # no CUDA here: the build needs no device
        return None


def build_failure(starting: StartingSave) -> CheckpointError | None:
    """The error of a build that failed before its writes started, as a `CheckpointError`."""
    error = starting.take_error() if isinstance(starting, StartingSave) else None
    if error is None or isinstance(error, CheckpointError):
        return error
    failure = CheckpointError(f"the asleep save of iteration {starting.iteration} failed while building its "
                              f"state dict: {type(error).__name__}: {error}; nothing was written for it")
    failure.__cause__ = error
    return failure


def checkpoint_dir(args, iteration) -> str:
    try:
        from megatron.training import checkpointing as mck

        return mck.get_checkpoint_name(args.save, iteration, release=False, return_base_dir=True)
    except Exception:  # only a name for log lines
        return f"{getattr(args, 'save', '')}/iter_{iteration}"
