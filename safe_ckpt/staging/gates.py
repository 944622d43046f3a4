"""Gates in front of writes to saved tensors, for every copy window open in this process.

One job: send each guarded write to the open windows' `CopyWindow.before_update`:
- every `torch.optim.Optimizer.step`, outer and inner alike (Megatron's `HybridDeviceOptimizer`,
  then each CPU AdamW it steps), through one global step pre-hook. It is registered by the first
  `track` and never removed: removing a global pre-hook while `Optimizer.step` iterates them
  makes the step raise "OrderedDict mutated during iteration", and a window closes from a
  background thread at any time. With no window open it returns at once;
- `before_update()`: the explicit gate, for loops that change saved tensors other than through a
  torch optimizer;
- torch_memory_saver's `pause` (`guard_memory_saver`): the host waits until every issued copy has
  landed before the saver unmaps the memory they read.
A window is tracked from its opening until it settles (`CopyWindow.on_settled`), failed or not:
a failed window's gates return at once, but a pause still waits for copies already issued.
A save whose copies start later leaves an opener (`defer`): whoever comes first runs it, in its
own thread: `open_deferred()` (the next step's trigger; also the save's handle when waited for or
polled, and the next save's start) or any gate.
An async save's host gate (`staging.host_gate`) uses the step hook and `before_update`; a save
that returns right after planning (`write.window_staging`) uses them all.

Must not: know what is copied, block while no window is open, or remove the hook.
"""

from __future__ import annotations

import logging
import sys
import threading

from .window import CopyWindow

log = logging.getLogger("safe_ckpt")


class _Registry:
    """The process's open windows (a tuple, replaced whole: a hook iterates it without a lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.windows: tuple[CopyWindow, ...] = ()
        self.deferred: tuple = ()  # openers of windows whose copies start at the next trigger
        self.hook = None  # the optimizer pre-hook's handle, kept and never removed
        self.hook_calls = 0  # pre-hook calls that found a window open


_registry = _Registry()


def install_optimizer_hook() -> bool:
    """Register the global optimizer step pre-hook, once per process; True if this call did."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    with _registry.lock:
        if _registry.hook is not None:
            return False
        _registry.hook = register_optimizer_step_pre_hook(_optimizer_step_pre_hook)
        return True


def _optimizer_step_pre_hook(optimizer, args, kwargs):
    if _registry.deferred:
        open_deferred()
    windows = _registry.windows
    if windows:
        _registry.hook_calls += 1
        what = f"{type(optimizer).__name__}.step()"
        for window in windows:
            window.before_update(what=what)
    return None


def track(window: CopyWindow) -> None:
    """Gate writes for ``window`` from now until it settles (call right after it opened)."""
    install_optimizer_hook()
    with _registry.lock:
        if window not in _registry.windows:
            _registry.windows = _registry.windows + (window,)
    window.on_settled(lambda: _untrack(window))


def _untrack(window: CopyWindow) -> None:
    with _registry.lock:
        _registry.windows = tuple(w for w in _registry.windows if w is not window)


def defer(opener) -> None:
    """Run ``opener()`` (it opens a window, in the calling thread, and tracks it) at the next
    `open_deferred()`, or before the next gate, whichever comes first; once."""
    install_optimizer_hook()
    with _registry.lock:
        _registry.deferred = _registry.deferred + (opener,)


def open_deferred() -> None:
    """Open every deferred window now, in this thread (a training step's trigger)."""
    with _registry.lock:
        openers, _registry.deferred = _registry.deferred, ()
    for k, opener in enumerate(openers):
        try:
            opener()
        except Exception as exc:  # the opener fails its own save; the training step goes on
            log.warning("opening a deferred copy window failed: %s", exc)
        except BaseException:  # an interrupt: its own save failed; the others open at the next trigger
            with _registry.lock:
                _registry.deferred = openers[k + 1:] + _registry.deferred
            raise


def open_windows() -> tuple[CopyWindow, ...]:
    return _registry.windows


def hook_calls() -> int:
    """How many optimizer steps met an open window (for tests and the benchmark)."""
    return _registry.hook_calls


def before_update(what: str = "before_update()") -> None:
    """Wait, as an optimizer step would, until changing any saved tensor of an open window is safe
    (`safe_ckpt.before_update`: call it before changing host tensors an `async_save` may still be
    writing, other than in a torch optimizer's step, which waits by itself)."""
    if _registry.deferred:
        open_deferred()
    for window in _registry.windows:
        window.before_update(what=what)


def before_unmap(what: str = "an unmap") -> None:
    """Block the host until no copy of an open window still reads device memory (a deferred
    window is opened first: its sources must be copied before they go)."""
    if _registry.deferred:
        open_deferred()
    for window in _registry.windows:
        window.before_update(what=what, unmap=True)


def guard_memory_saver(saver=None) -> bool:
    """Make torch_memory_saver's ``pause`` wait for the open windows' copies first (``saver``:
    the saver instance; default: the `torch_memory_saver.torch_memory_saver` singleton where
    the module is already imported). Once per instance; True if this call installed it."""
    if saver is None:
        module = sys.modules.get("torch_memory_saver")
        saver = getattr(module, "torch_memory_saver", None)
        if saver is None:
            return False
    if saver.__dict__.get("_safe_ckpt_pause_guarded"):
        return False
    inner = saver.pause

    def pause(*args, **kwargs):
        before_unmap("torch_memory_saver.pause()")
        return inner(*args, **kwargs)

    saver.pause = pause  # an instance attribute: the class and other instances are untouched
    saver._safe_ckpt_pause_guarded = True
    return True
