"""Megatron's load entry points, read by safe_ckpt.

One job: put safe_ckpt's reader behind the two ways Megatron code loads a torch_dist checkpoint.
- `load_checkpoint`: `megatron.training.checkpointing.load_checkpoint` itself, unchanged (its
  tracker, `--ckpt-step`, `--finetune`, `--no-load-optim`, `--no-load-rng`, iteration, RNG,
  optimizer, scheduler and argument checks all stay stock), run with the
  `dist_checkpointing` module it calls swapped, for the call only, for one whose `load` is
  `safe_ckpt.load` and whose `load_common_state_dict` reads the common state the same safe way.
  Every version from megatron-core 0.15 to 0.19 (and slime's pin, Megatron-LM 1dcf0dafa884)
  reaches the checkpoint only through those two names of that module (and its pure helpers,
  left stock); the load strategy it builds, a `FullyParallelLoadStrategyWrapper` included, is
  not used: each rank reads only what it needs.
- `SafeTorchDistLoadStrategy`: a load strategy for code that calls
  `dist_checkpointing.load(..., sharded_strategy=...)` itself (stock then runs the rest).
After a load, `loaded_checkpoint()` says which save root and iteration it read, and
`resume.note_loaded` records it, so retention keeps that checkpoint.
Must not: change Megatron's state beyond what its own load_checkpoint changes.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass

from .. import compat
from ..errors import ValidationError
from ..loading import LoadOptions
from ..loading.options import checked as checked_load_options
from ..loading import contract
from ..options import GiB
from ..sinks.tensorstore import is_kvstore_url

log = logging.getLogger("safe_ckpt")


@dataclass(frozen=True)
class LoadedCheckpoint:
    save_root: str  # the directory holding the tracker (Megatron's --load)
    checkpoint_dir: str
    iteration: int | None


_loaded_lock = threading.Lock()
_loaded: list = []  # the latest LoadedCheckpoint of this process


def loaded_checkpoint() -> LoadedCheckpoint | None:
    """The checkpoint the latest `load_checkpoint` of this process read (None before one)."""
    with _loaded_lock:
        return _loaded[-1] if _loaded else None


def load_options_from_args(args) -> LoadOptions:
    """LoadOptions from Megatron args (the `--safe-ckpt-*` flags, where registered)."""
    budget = getattr(args, "safe_ckpt_staging_budget_gib", None)
    return LoadOptions(
        io_threads=getattr(args, "safe_ckpt_io_threads", None),
        staging_budget_bytes=int(budget * GiB) if budget else None,
        collective_timeout_s=float(getattr(args, "safe_ckpt_timeout_s", None) or 600.0),
        verify_checksums=not getattr(args, "safe_ckpt_no_verify_checksums", False),
        safe_globals=optimizer_classes(),
    )


# Where megatron-core finds the fused optimizers it prefers over torch's.
_FUSED_OPTIMIZERS = (("transformer_engine.pytorch.optimizers", "FusedAdam"),
                     ("transformer_engine.pytorch.optimizers", "FusedSGD"),
                     ("apex.optimizers", "FusedAdam"), ("apex.optimizers", "FusedSGD"))


def optimizer_classes() -> tuple:
    """The optimizer classes a Megatron checkpoint's optimizer state may name: with
    `--optimizer-cpu-offload`, megatron-core's HybridDeviceOptimizer keeps its `cpu_optimizer_cls`
    and `gpu_optimizer_cls` in its param groups, which stock load rebuilds. torch's, and the fused
    ones megatron-core picks where this process has already imported them; admitting a class lets
    the loader name it, nothing else."""
    import torch

    classes = [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD]
    for module, name in _FUSED_OPTIMIZERS:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type):
            classes.append(cls)
    return tuple(classes)


class _ReadBySafeCkpt:
    """`megatron.core.dist_checkpointing` as `megatron.training.checkpointing` sees it during one
    `load_checkpoint`: its reading entry points through safe_ckpt, everything else stock."""

    def __init__(self, stock, options: LoadOptions) -> None:
        self._stock = stock
        self._options = options
        self.read: list[tuple[str, object]] = []  # (checkpoint_dir, common state) of each full load

    def __getattr__(self, name):
        return getattr(self._stock, name)

    def load_common_state_dict(self, checkpoint_dir):
        return contract.read_common_state_dict(checkpoint_dir, self._options)

    def load(self, sharded_state_dict, checkpoint_dir, sharded_strategy=None, common_strategy=None,
             validate_access_integrity=True, strict=None, verify_integrity=False, process_group=None):
        # The strategy stock built (a FullyParallel wrapper, a cached-metadata reader) is not used.
        # A process group, where a caller passes one, must be a gloo group (safe_ckpt says so if not).
        result = contract.load(sharded_state_dict, checkpoint_dir, self._options, strict=strict,
                               validate_access_integrity=validate_access_integrity,
                               verify_integrity=verify_integrity, process_group=process_group)
        state = result[0] if isinstance(result, tuple) else result
        self.read.append((os.fspath(checkpoint_dir), state))
        return result


def _note(reader: _ReadBySafeCkpt, load_dir: str) -> None:
    if not reader.read:
        return
    checkpoint_dir, state = reader.read[-1]
    iteration = state.get("iteration") if isinstance(state, dict) else None
    loaded = LoadedCheckpoint(os.path.abspath(load_dir), checkpoint_dir, iteration)
    with _loaded_lock:
        _loaded[:] = [loaded]
    from . import resume

    resume.note_loaded(checkpoint_dir)  # retention keeps it (a local directory: URLs are refused above)


def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True,
                    checkpointing_context=None, *args, safe_ckpt_options: LoadOptions | None = None, **kwargs):
    """`megatron.training.checkpointing.load_checkpoint`, with the checkpoint read by safe_ckpt.

    Same arguments (those of the installed Megatron-LM pass through), same return value
    ``(iteration, num_floating_point_operations_so_far)``, same effects; so
    ``megatron.training.checkpointing.load_checkpoint = safe_ckpt.megatron.load_checkpoint``
    works. ``safe_ckpt_options`` overrides the `--safe-ckpt-*` flags. Reads a local `--load`
    directory (for an object store, use `safe_ckpt.load`, or copy the checkpoint down first).
    """
    from megatron.training import checkpointing as mck
    from megatron.training.global_vars import get_args

    margs = get_args()
    load_dir = getattr(margs, load_arg, None)
    if isinstance(load_dir, str) and is_kvstore_url(load_dir):
        raise ValidationError(f"--{load_arg.replace('_', '-')} {load_dir}: safe_ckpt.megatron.load_checkpoint reads a "
                              f"local directory (Megatron's tracker and format checks are file system calls); "
                              f"copy the checkpoint down with `safe-ckpt copy`, or load it with safe_ckpt.load")
    if getattr(_inside, "load", False):  # a wrapper of ours posing as Megatron's function called us back
        raise ValidationError("safe_ckpt.megatron.load_checkpoint was called again from inside itself: the function "
                              "it ran as Megatron's own load_checkpoint calls it back (a wrapper installed in "
                              "megatron.training.checkpointing's place?). Install safe_ckpt's loader where pretrain() "
                              "calls it, megatron.training.training.load_checkpoint, and leave checkpointing's stock")
    options = safe_ckpt_options or load_options_from_args(margs)
    stock = compat.training_dist_checkpointing(mck)
    stock_load_checkpoint = _stock_load_checkpoint(mck)
    reader = _ReadBySafeCkpt(stock, options)
    with _swap_lock:
        mck.dist_checkpointing = reader
        _inside.load = True
        try:
            result = stock_load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg, strict,
                                           checkpointing_context, *args, **kwargs)
        finally:
            _inside.load = False
            mck.dist_checkpointing = stock
    if load_dir is not None:
        _note(reader, load_dir)
    return result


load_checkpoint._safe_ckpt_loader = True
_swap_lock = threading.Lock()  # one load at a time swaps the module
_inside = threading.local()  # this thread is running Megatron's load_checkpoint for us
_stock = []  # megatron.training's own load_checkpoint, once found


def _is_stock(fn, mck) -> bool:
    """Megatron's own function: compiled from checkpointing's source file, and not a wrapper (a
    `functools.wraps` wrapper copies the name and module, not the code)."""
    code = getattr(fn, "__code__", None)
    source = getattr(mck, "__file__", None)
    return (code is not None and source is not None and not hasattr(fn, "__wrapped__")
            and not getattr(fn, "_safe_ckpt_loader", False) and getattr(fn, "__name__", None) == "load_checkpoint"
            and os.path.realpath(code.co_filename) == os.path.realpath(source))


def remember_stock_loader(mck):
    """Remember megatron.training's own `load_checkpoint` while it is still in its module (called
    wherever safe_ckpt meets that module); returns it, or None if it has been replaced."""
    current = getattr(mck, "load_checkpoint", None)
    if _is_stock(current, mck):
        _stock[:] = [current]
        return current
    return None


def _stock_load_checkpoint(mck):
    """megatron.training's own `load_checkpoint`, which does the work around the read. Users install
    this function in its place (`checkpointing.load_checkpoint = safe_ckpt.megatron.load_checkpoint`),
    so it is looked for where Megatron's modules imported it by name (`megatron.training.training`)
    and remembered; calling the module's attribute would call this function again."""
    current = remember_stock_loader(mck)
    if current is not None:
        return current
    if _stock:
        return _stock[0]
    found = next((fn for name, m in list(sys.modules.items()) if m is not None and name.startswith("megatron.")
                  for fn in [getattr(m, "load_checkpoint", None)] if _is_stock(fn, mck)), None)
    if found is None:
        raise ValidationError("megatron.training.checkpointing.load_checkpoint has been replaced, and Megatron's own "
                              "is nowhere else to be found (every module that imported it now holds a replacement): "
                              "leave megatron.training.checkpointing.load_checkpoint stock and install "
                              "safe_ckpt.megatron.load_checkpoint as megatron.training.training.load_checkpoint, or "
                              "import safe_ckpt.megatron after megatron.training so it remembers Megatron's own")
    _stock.append(found)
    return found


class SafeTorchDistLoadStrategy(compat.torch_dist_load_strategy_base()):
    """A torch_dist load strategy whose reads go through safe_ckpt: for
    `dist_checkpointing.load(sharded_state_dict, checkpoint_dir, sharded_strategy=SafeTorchDistLoadStrategy())`.
    Stock `load` still reads the common state and `.metadata` for strict modes its own way; use
    `safe_ckpt.load` to have every part read safely."""

    def __init__(self, options: LoadOptions | None = None, process_group=None, **kwargs) -> None:
        super().__init__(**compat.accepted_kwargs(super().__init__, kwargs))
        self.options = checked_load_options(options, LoadOptions(safe_globals=optimizer_classes()) if options is None
                                            else None)  # as the save strategy admits
        self.process_group = process_group

    def load(self, sharded_state_dict, checkpoint_dir, *args, **kwargs):
        return contract.load_sharded(sharded_state_dict, checkpoint_dir, self.options, self.process_group)

    def load_tensors_metadata(self, checkpoint_dir, metadata=None):
        return {k: v for k, v in self.load_sharded_metadata(checkpoint_dir).items()
                if type(v).__name__ == "ShardedTensor"}

    def load_sharded_metadata(self, checkpoint_dir):
        return contract.read_sharded_metadata(checkpoint_dir, self.options)


if "megatron.training.checkpointing" in sys.modules:  # a user about to install this loader in its place
    remember_stock_loader(sys.modules["megatron.training.checkpointing"])
