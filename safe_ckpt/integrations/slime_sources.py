"""Where an asleep slime train actor's checkpoint bytes are read from.

One job: before an asleep save, match every model weight to the host copy slime itself keeps of
it (its `TensorBackuper`, tag "actor"), and tell which tensors of the training state have no
readable source while the actor sleeps, so that such a save takes slime's wake-up path instead.

Why (slime 624b824a with its Megatron patch): with `--offload-train`, slime's `parse_args` sets
`disable_param_buffers_cpu_backup` (and the grad one); with the distributed optimizer the patched
DDP then allocates the bf16 `param_data` (every parameter a view into it) in a torch_memory_saver
region without CPU backup: paused, those bytes are gone. slime keeps the trained weights in
`actor.weights_backuper` instead (backed up after each train step; `wake_up()` restores them into
the parameters with `_switch_model("actor")`), so those copies are exactly what the wake-up path
saves, whatever the device held when the actor fell asleep.

Matching, without guessing: the (name, parameter) pairs are the ones the backuper's own
`backup`/`restore` iterate (its source getter: slime's global names), each copy is the backuper's
tensor of that name, and a pair is used only if the copy is a host tensor with the parameter's
shape, dtype and strides. A saved tensor is answered for only when its bytes lie within one
matched parameter, with the parameter's dtype (Megatron saves parameters and views of them, such
as the two halves of a fused GLU weight); the answer is the same view over the copy.

No readable source: a tensor in paused memory with neither a torch_memory_saver backup nor a
matched copy (a region with `enable_disk_backup`, whose bytes are in files; a backuper without
host copies, such as slime's `_TensorBackuperNoop`, whose `get` reads the live parameters; copies
under names or of shapes the parameters do not have), and every weight without a matched copy
while slime's layout keeps the parameters without backup.

Never asked: torch_memory_saver, about a tensor touching a DDP buffer the patch allocates without
backup (`regions_without_backup`): for a paused allocation without backup it terminates the process.

Must not: read any tensor's bytes, touch the device, or change the backuper.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from dataclasses import dataclass

import torch

from ..residence import classify as residence

log = logging.getLogger("safe_ckpt")

ACTOR_TAG = "actor"  # what slime's wake_up restores for the actor role (`_switch_model("actor")`)
COPIES_WHAT = "slime's TensorBackuper copy (tag 'actor')"
NAMES_SHOWN = 8


@dataclass(frozen=True)
class _Span:
    start: int  # address of the parameter's first byte
    end: int  # one past its last byte
    device: torch.device
    dtype: torch.dtype
    copy: torch.Tensor
    name: str


@dataclass(frozen=True)
class WeightCopies:
    """slime's host copies of the parameters, by the parameters' address ranges."""

    spans: tuple
    starts: tuple
    copy_bytes: int

    def lookup(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The view of a copy holding ``tensor``'s bytes, or None when no matched parameter holds all of them."""
        if tensor.numel() == 0 or any(s < 0 for s in tensor.stride()):
            return None
        start = tensor.data_ptr()
        i = bisect.bisect_right(self.starts, start) - 1
        if i < 0:
            return None
        span = self.spans[i]
        size = tensor.element_size()
        if (tensor.device != span.device or tensor.dtype != span.dtype
                or start + residence._span_bytes(tensor) > span.end or (start - span.start) % size):
            return None
        copy = span.copy
        return copy.as_strided(tuple(tensor.shape), tuple(tensor.stride()),
                               copy.storage_offset() + (start - span.start) // size)


@dataclass(frozen=True)
class Matched:
    copies: WeightCopies | None
    unmatched: tuple  # names of parameters without a usable copy
    notes: tuple  # why, in words


def host_copies_of(backuper) -> dict | None:
    """The backuper's host copies of the tag the wake-up restores, or None if it keeps none.

    slime's `_TensorBackuperNormal` keeps them in `_backups` (tag -> name -> tensor), which its
    `get` returns; its `get` is not called (a defaultdict: it would add the tag), and a backuper
    of another kind is not asked at all (`_TensorBackuperNoop.get` reads the live parameters)."""
    backups = getattr(backuper, "_backups", None)
    if not isinstance(backups, dict) or ACTOR_TAG not in backups:
        return None
    copies = backups[ACTOR_TAG]
    return copies if isinstance(copies, dict) else None


def match_weights(backuper) -> Matched:
    """Pair every parameter slime's backuper iterates with its copy (see the module docstring)."""
    getter = getattr(backuper, "_source_getter", None)
    copies = host_copies_of(backuper)
    if backuper is None:
        return Matched(None, (), ("the actor has no weights backuper (slime's critic role keeps none)",))
    if copies is None or not callable(getter):
        return Matched(None, (), (f"its weights backuper ({type(backuper).__name__}) keeps no host copies "
                                  f"of tag {ACTOR_TAG!r}",))
    spans, unmatched, notes, seen, total = [], [], [], set(), 0
    for name, param in getter():
        if not isinstance(param, torch.Tensor) or id(param) in seen:
            continue
        seen.add(id(param))
        copy = copies.get(name)
        problem = _mismatch(param, copy)
        if problem:
            unmatched.append(name)
            notes.append(f"{name}: {problem}")
            continue
        if param.numel() == 0:
            continue
        start = param.data_ptr()
        spans.append(_Span(start, start + residence._span_bytes(param), param.device, param.dtype, copy, name))
        total += copy.numel() * copy.element_size()
    spans.sort(key=lambda s: (s.device.type, s.device.index or 0, s.start))
    for a, b in zip(spans, spans[1:]):
        if a.device == b.device and b.start < a.end:
            return Matched(None, (a.name, b.name), (f"parameters {a.name} and {b.name} overlap in memory",))
    ordered = sorted(spans, key=lambda s: s.start)
    return Matched(WeightCopies(tuple(ordered), tuple(s.start for s in ordered), total), tuple(unmatched),
                   tuple(notes))


def _mismatch(param: torch.Tensor, copy) -> str:
    if not isinstance(copy, torch.Tensor):
        return "no copy of that name"
    if copy.device.type != "cpu":
        return f"its copy is on {copy.device}, not in host memory"
    if copy.dtype != param.dtype or tuple(copy.shape) != tuple(param.shape):
        return f"its copy is {copy.dtype} {tuple(copy.shape)}, the parameter {param.dtype} {tuple(param.shape)}"
    if param.numel() and tuple(copy.stride()) != tuple(param.stride()):
        return f"its copy's strides {tuple(copy.stride())} differ from the parameter's {tuple(param.stride())}"
    return ""


@dataclass(frozen=True)
class Region:
    start: int
    end: int  # one past the last byte
    device: torch.device


@dataclass(frozen=True)
class RegionsWithoutBackup:
    """The DDP buffers slime's patched Megatron allocates in torch_memory_saver regions without
    CPU backup. Asked about a paused allocation of one of them, torch_memory_saver terminates the
    process, so a tensor touching one is never asked about (`residence.regions_without_backup`)."""

    regions: tuple
    what: str

    def holds(self, tensor: torch.Tensor) -> bool:
        if tensor.numel() == 0:
            return False
        start = tensor.data_ptr()
        end = start + residence._span_bytes(tensor)
        return any(r.device == tensor.device and start < r.end and r.start < end for r in self.regions)


def regions_without_backup(model, args) -> RegionsWithoutBackup | None:
    """The param_data (`disable_param_buffers_cpu_backup` with the distributed optimizer) and
    grad_data (`disable_grad_buffers_cpu_backup`) of every DDP buffer of ``model``, or None."""
    params = params_without_backup(args)
    grads = bool(getattr(args, "disable_grad_buffers_cpu_backup", False))
    if not (params or grads):
        return None
    regions = []
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        # Megatron's DDP keeps its buffers in lists; an unwrapped module's `buffers` is nn.Module's method
        listed = [getattr(chunk, name, None) for name in ("buffers", "expert_parallel_buffers")]
        for buffer in [b for found in listed if isinstance(found, (list, tuple)) for b in found]:
            for wanted, name in ((params, "param_data"), (grads, "grad_data")):
                data = getattr(buffer, name, None) if wanted else None
                if isinstance(data, torch.Tensor) and data.numel():
                    regions.append(Region(data.data_ptr(), data.data_ptr() + data.numel() * data.element_size(),
                                          data.device))
    what = " and ".join(n for wanted, n in ((params, "the DDP param_data"), (grads, "the DDP grad_data")) if wanted)
    return RegionsWithoutBackup(tuple(regions), what) if regions else None


def params_without_backup(args) -> bool:
    """slime's layout: the parameters live in a torch_memory_saver region without CPU backup
    (what the patched DDP does with `disable_param_buffers_cpu_backup` and the distributed optimizer)."""
    return bool(getattr(args, "disable_param_buffers_cpu_backup", False)
                and getattr(args, "use_distributed_optimizer", False))


@dataclass(frozen=True)
class SourceCheck:
    """The outcome of `check_sources`: the copies to read the weights from, and what has no source."""

    copies: WeightCopies | None
    unreadable: tuple  # names of tensors with no readable source while asleep
    notes: tuple
    without_backup: RegionsWithoutBackup | None = None  # never asked of torch_memory_saver

    def reason(self) -> str:
        shown = ", ".join(self.unreadable[:NAMES_SHOWN])
        more = f" and {len(self.unreadable) - NAMES_SHOWN} more" if len(self.unreadable) > NAMES_SHOWN else ""
        why = f" ({'; '.join(self.notes[:3])})" if self.notes else ""
        return f"no readable source while asleep for {len(self.unreadable)} tensor(s): {shown}{more}{why}"


def training_tensors(model, optimizer):
    """(name, tensor) of what Megatron's state dict is built from: every model chunk's parameters
    and buffers, and the optimizer's parameters (the main params) and per-parameter state."""
    names = {}
    for i, chunk in enumerate(model if isinstance(model, (list, tuple)) else [model]):
        for kind in ("named_parameters", "named_buffers"):
            for name, t in getattr(chunk, kind, lambda: ())():
                if isinstance(t, torch.Tensor):
                    names.setdefault(id(t), f"model[{i}].{name}")
                    yield names[id(t)], t
    for k, opt in enumerate(getattr(optimizer, "chained_optimizers", None) or [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for g, group in enumerate(getattr(inner, "param_groups", None) or []):
            for j, p in enumerate(group.get("params", [])):
                if isinstance(p, torch.Tensor):
                    yield names.get(id(p), f"optimizer[{k}] group {g} param {j} {tuple(p.shape)}"), p
        for j, (p, state) in enumerate((getattr(inner, "state", None) or {}).items()):
            for key, t in (state.items() if isinstance(state, dict) else ()):
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    yield f"optimizer[{k}] state {key!r} of {names.get(id(p), f'param {j}')}", t


def check_sources(actor, args) -> SourceCheck:
    """Match the weights to slime's copies and list every training tensor with no readable source
    while asleep. Reads no bytes: residences are asked of the CUDA driver and torch_memory_saver."""
    matched = match_weights(getattr(actor, "weights_backuper", None)) if getattr(actor, "role", "actor") == "actor" \
        else Matched(None, (), ("the critic keeps no weights backuper",))
    copies, notes = matched.copies, list(matched.notes)
    unreadable = []
    no_backup = params_without_backup(args)
    if no_backup and copies is None:
        notes.insert(0, "the parameters are in a region without CPU backup")
    model = getattr(actor, "model", None) or []
    regions = regions_without_backup(model, args)
    with guarded(regions):
        for name, tensor in training_tensors(model, getattr(actor, "optimizer", None)):
            if copies is not None and copies.lookup(tensor) is not None:
                continue
            is_param = isinstance(tensor, torch.nn.Parameter)
            if no_backup and is_param and name.startswith("model["):
                unreadable.append(name)  # its region keeps no backup, and no copy answers for it
                continue
            kind = residence.classify(tensor, allow_cpu_backup=True).residence
            if kind == residence.Residence.CUDA_UNMAPPED.value:
                unreadable.append(name)
    return SourceCheck(copies, tuple(dict.fromkeys(unreadable)), tuple(notes), regions)


def guarded(regions: RegionsWithoutBackup | None):
    """The residence seam that keeps torch_memory_saver from being asked about ``regions``."""
    return residence.regions_without_backup(regions.holds, regions.what) if regions is not None \
        else contextlib.nullcontext()
