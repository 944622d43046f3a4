"""The Megatron drop-in's overlapped save (`--safe-ckpt-overlap-copy` with `--async-save`).

One job: say whether this save may return right after planning (`ineligible`: the reason it may
not, or None) and make the copies start at the next training step (`install_trigger`: the
optimizer's `zero_grad`, the first call of Megatron's `train_step` in every version 0.15 to 0.19,
opens the save's deferred copy window). Megatron synchronizes the device right after its save call
(`_Timer.stop` in `save_checkpoint_and_time`), so copies issued in the call would be waited for
there; deferred, they run during the next step's forward and backward, and the optimizer step
waits for what is left (a global torch optimizer step pre-hook).

Eligibility (else the save returns once staged, with one INFO line naming why): the distributed
optimizer's state in `dp_reshardable` (already enforced); with `--overlap-param-gather` every
bucket group's all-gather dispatched and waited for (else the next forward's gather rewrites the
saved bf16 buffer before any gate); not `--reuse-grad-buf-for-mxfp8-param-ag` / `--fp8-param-gather`
(their param buffers are not verified); no CUDA graph replaying the optimizer step or the param
gather (no Python hook runs in a replay); not `--offload-optimizer-states` (the sources leave the
GPU before the next forward); not Megatron-FSDP; not while a CUDA graph is being captured.

Must not: build state dicts or save anything.
"""

from __future__ import annotations

import logging

import torch

from .. import compat
from ..staging import gates

log = logging.getLogger("safe_ckpt")


def requested(args) -> bool:
    return bool(getattr(args, "safe_ckpt_overlap_copy", False)) and bool(getattr(args, "async_save", False))


def ineligible(args, model=None) -> str | None:
    """Why this save may not return right after planning, or None. ``model``: Megatron's
    (DDP-wrapped) model chunks, for the param-gather rule."""
    for flag in ("reuse_grad_buf_for_mxfp8_param_ag", "fp8_param_gather", "offload_optimizer_states",
                 "use_megatron_fsdp", "use_torch_fsdp2"):
        if getattr(args, flag, False):
            return f"--{flag.replace('_', '-')} is set"
    graph = compat.step_replaying_cuda_graph(args)
    if graph is not None:
        return f"{graph} replays the optimizer step or the param gather, where no hook runs"
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "a CUDA graph is being captured"
    if getattr(args, "overlap_param_gather", False) and model is not None:
        chunks = model if isinstance(model, (list, tuple)) else [model]
        pending = compat.param_gathers_pending(chunks)
        if pending:
            return (f"{pending} param all-gather bucket group(s) are not synced (--overlap-param-gather): the next "
                    "forward would rewrite the saved bf16 parameters before any gate")
    return None


def return_after(args, model=None) -> str:
    """"planned" where `--safe-ckpt-overlap-copy` with `--async-save` is eligible, else "staged"
    (with one INFO line naming why, when the overlap was asked for)."""
    if not requested(args):
        return "staged"
    reason = ineligible(args, model)
    if reason is None:
        return "planned"
    log.info("--safe-ckpt-overlap-copy: this save returns once its device bytes are staged, not right after "
             "planning: %s", reason)
    return "staged"


def install_trigger(optimizer) -> bool:
    """Make ``optimizer.zero_grad()`` open any deferred copy window first (once per optimizer
    object, an instance attribute; a no-op while no window waits). True if this call installed it."""
    if optimizer is None or optimizer.__dict__.get("_safe_ckpt_trigger"):
        return False
    inner = optimizer.zero_grad

    def zero_grad(*args, **kwargs):
        gates.open_deferred()
        return inner(*args, **kwargs)

    optimizer.zero_grad = zero_grad
    optimizer._safe_ckpt_trigger = True
    return True
