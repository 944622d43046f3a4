"""What the loaders let a pickled part of a checkpoint rebuild: the one allow-list, for both sides.

One job: run torch's weights-only unpickler with the classes every loader of a `torch_dist`
checkpoint admits (torch's own, those registered in the process with
`torch.serialization.add_safe_globals`, megatron-core's `SAFE_GLOBALS`) plus the ones a caller
lists, so that the loader (`loading.objects`, `encoding.safe_read`) and the save's check that
its common state and ShardedObjects load back (`plan.collect`) refuse exactly the same classes.
Must not: call `pickle.load` or `torch.load(weights_only=False)`.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re
import threading
from dataclasses import dataclass

import torch

from . import compat

_GLOBAL_IN_MESSAGE = re.compile(r"GLOBAL ([\w.]+)")
_WHY_IN_MESSAGE = re.compile(r"WeightsUnpickler error:\s*(.+?)\s*(?:\n\s*\n|$)", re.S)
_admit_lock = threading.Lock()


@contextlib.contextmanager
def admitted(classes) -> None:
    """Admit ``classes`` to torch's weights-only unpickler for the block. Only those not admitted
    already: torch's `safe_globals` context removes on exit whatever it was given, which would take
    away what megatron-core registers for the whole process at import."""
    classes = list(classes)
    if not classes:
        yield
        return
    with _admit_lock:
        known = {id(c) for c in torch.serialization.get_safe_globals()}
        missing = [c for c in classes if id(c) not in known]
        if not missing:  # torch's context rebuilds its registry even for none: every save would churn it
            yield
            return
        with torch.serialization.safe_globals(missing):
            yield


def load(data, safe_globals=(), map_location=None, megatron_globals: bool = True):
    """``torch.load(weights_only=True)`` of ``data`` with megatron-core's safe globals and ``safe_globals``."""
    classes = [*compat.megatron_safe_globals(), *safe_globals] if megatron_globals else list(safe_globals)
    with admitted(classes):
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)


def refused_global(exc: BaseException) -> str | None:
    """The global (``module.Name``) torch's weights-only unpickler refused in ``exc``, if it names one."""
    if not isinstance(exc, pickle.UnpicklingError):
        return None
    found = _GLOBAL_IN_MESSAGE.search(str(exc))
    return found.group(1) if found else None


def reason(message: str) -> str:
    """The line of torch's long weights-only message that says what went wrong."""
    found = _WHY_IN_MESSAGE.search(message)
    return found.group(1).strip() if found else message.strip().splitlines()[0][:200] if message.strip() else "?"


@dataclass(frozen=True)
class Refusal:
    """Why the weights-only unpickler refuses a payload."""

    refused_global: str | None  # ``module.Name`` of the class or function it may not rebuild
    reason: str  # the line of torch's message that says why


def global_name(cls) -> str:
    """The name torch's weights-only unpickler knows ``cls`` by (``(cls, "name")`` as torch takes it)."""
    if isinstance(cls, tuple):
        return cls[1]
    return f"{cls.__module__}.{cls.__qualname__}"


def unloadable(payload: bytes, safe_globals=()) -> Refusal | None:
    """Why the loaders would refuse ``payload`` (the bytes of a `torch.save`), or None if they
    load it. The pickle's globals are read, not run: no class of the caller's is rebuilt, no
    tensor storage is built, and torch's process-wide allow-list is left alone (other threads'
    loads never see a class admitted here)."""
    scan = compat.unsafe_globals_in_checkpoint()
    if scan is None:  # a torch without the scan: the loaders' own load, on the CPU
        return _refused_by_loading(payload, safe_globals)
    admitted_here = {global_name(c) for c in (*compat.megatron_safe_globals(), *safe_globals)}
    try:
        found = scan(io.BytesIO(payload))
    except pickle.UnpicklingError as exc:  # what the scan cannot read, the loaders cannot either
        return Refusal(None, reason(str(exc)))
    refused = sorted(name for name in found if name not in admitted_here)
    if refused:
        return Refusal(refused[0], f"GLOBAL {refused[0]} is not an allowed global")
    if b"numpy" in payload:  # the scan leaves out what is registered already (megatron-core admits numpy's)
        # numpy makes a dtype's class only while unpickling, which the scan cannot see: load it
        return _refused_by_loading(payload, safe_globals)
    return None


def _refused_by_loading(payload: bytes, safe_globals) -> Refusal | None:
    try:
        load(payload, safe_globals, map_location="cpu")
    except pickle.UnpicklingError as exc:
        return Refusal(refused_global(exc), reason(str(exc)))
    return None
