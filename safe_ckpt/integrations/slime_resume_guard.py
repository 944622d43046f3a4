"""Hold torch_memory_saver's `resume()` while an asleep save still reads the CPU backup.

One job: put a guard on the process's torch_memory_saver singleton so that every `resume()`
first waits for the asleep save in flight (`AsleepSaves.before_resume`), whoever calls it.

Why: `resume()` copies the CPU backup back to the device and then frees it, or, where the saver
keeps its backup, lets the next `pause()` rewrite it in place; an asleep save reading that
backup would read freed or changing memory. slime's own `wake_up()` calls are hooked already
(`slime_asleep.AsleepSaves.wake_up`), but a `wake_up()` that Ray resolved when it created the
actor (the driver's `RayTrainGroup.onload()`) runs slime's original method, and any other code
may call `resume()` directly: the guard sits below both.

A `resume(tag)` of any tag waits the same and counts the actor as awake (the next save then
takes slime's wake-up path): slower for a region the save does not read, never unsafe. A later
install replaces an earlier guard rather than stacking on it.

Must not: import torch_memory_saver (importing it fixes its hook mode; only the copy slime
imported is guarded), guard a saver twice, or change `resume()`'s arguments, result or errors
beyond the save's own error, which it raises before resuming, as the hooked `wake_up()` does.
"""

from __future__ import annotations

import functools
import logging
import sys

log = logging.getLogger("safe_ckpt")


def guard_resume(saves) -> bool:
    """Guard the imported torch_memory_saver singleton's `resume` with ``saves``; False when
    torch_memory_saver has not been imported in this process (nothing to guard yet)."""
    module = sys.modules.get("torch_memory_saver")
    saver = getattr(module, "torch_memory_saver", None) if module is not None else None
    current = getattr(saver, "resume", None)
    if not callable(current):
        return False
    if getattr(current, "_safe_ckpt_asleep", None) is saves:
        return True
    original = getattr(current, "_safe_ckpt_original", current)  # a guard of an earlier install

    @functools.wraps(original)
    def resume(*args, **kwargs):
        saves.before_resume()
        return original(*args, **kwargs)

    resume._safe_ckpt_asleep = saves
    resume._safe_ckpt_original = original
    saver.resume = resume  # on the instance: the class, and other instances, stay as they are
    log.debug("torch_memory_saver.resume waits for an asleep save in flight")
    return True
