"""Rank bodies of the Megatron drop-in's overlapped save on the CPU (`--safe-ckpt-overlap-copy` with
`--async-save`), through `safe_ckpt.megatron.save_checkpoint` and the megatron.training stand-in.

`StandInMegatronOptimizer` mirrors the part of megatron-core's `MixedPrecisionOptimizer` a training
step calls (megatron/core/optimizer/optimizer.py at core_v0.16.1, commit 55ac7082517c): `zero_grad`
(the first call of `train_step`), and `step` = `prepare_grads` -> the grad norm (its `.item()`, a host
sync) -> `step_with_ready_grads` (the inner torch optimizer's `step`, then the main params copied into
the model params through `.data`). Its inner optimizer is a real fused `torch.optim.AdamW`, as
`--optimizer-cpu-offload` steps on the host; the model's and optimizer's sharded state dicts hold the
live tensors, as Megatron's `dp_reshardable` state dict does.
"""

from __future__ import annotations

import os
import sys

import torch

from tests.helpers.bodies.load_megatron import STAND_INS, Scheduler, _args

N = 1 << 19  # 2 MiB fp32 per tensor: above the window's small-source size


class StandInModel:
    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(N, generator=g)  # the "bf16" model param, here fp32

    def sharded_state_dict(self, metadata=None, **kwargs):
        from megatron.core.dist_checkpointing import ShardedTensor

        return {"weight": ShardedTensor.from_rank_offsets("model.weight", self.weight, replica_id=0)}


class StandInMegatronOptimizer:
    """See the module docstring: zero_grad, step -> prepare_grads, grad norm .item(), step_with_ready_grads."""

    is_stub_optimizer = False

    def __init__(self, model: StandInModel, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.model = model
        self.main_param = torch.nn.Parameter(model.weight.clone())
        self.main_param.grad = torch.randn(N, generator=g)
        self.optimizer = torch.optim.AdamW([self.main_param], lr=0.1, fused=True)
        self.optimizer.step()  # Adam's state exists, as after any earlier step
        self.param_groups = self.optimizer.param_groups
        self.zero_grad_calls = 0
        self._g = g

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero_grad_calls += 1
        self.main_param.grad = None

    def backward(self) -> None:  # stands for forward_backward_func filling the main grads
        self.main_param.grad = torch.randn(N, generator=self._g)

    def prepare_grads(self) -> bool:
        return False

    def get_grad_norm(self) -> float:
        return self.main_param.grad.norm().item()

    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        self.model.weight.data.copy_(self.main_param.data)  # _copy_main_params_to_model_params
        return True

    def step(self):
        if self.prepare_grads():
            return False, None, None
        grad_norm = self.get_grad_norm()
        return self.step_with_ready_grads(), grad_norm, 0

    def state_tensors(self) -> dict:
        state = self.optimizer.state[self.main_param]
        return {"optimizer.param": self.main_param.detach(), "optimizer.exp_avg": state["exp_avg"],
                "optimizer.exp_avg_sq": state["exp_avg_sq"]}

    def sharded_state_dict(self, model_state_dict, metadata=None, is_loading=False, **kwargs):
        from megatron.core.dist_checkpointing import ShardedTensor

        return {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in self.state_tensors().items()}


def _snapshot(model, opt) -> dict:
    return {"model.weight": model.weight.clone(), **{k: t.clone() for k, t in opt.state_tensors().items()}}


def deferred_opening_at_zero_grad(rank, world, root) -> dict:
    """Save iteration 3 through the drop-in in the overlap mode, then run one training step the way
    `train_step` does. The copies must not start in the call (Megatron synchronizes the device right
    after it) but at the step's `zero_grad`; the checkpoint holds the state of the call, bit for bit."""
    if STAND_INS not in sys.path:
        sys.path.insert(0, STAND_INS)
    from megatron.core import dist_checkpointing, mpu
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.training.global_vars import set_args

    import safe_ckpt.megatron as safe_megatron
    from safe_ckpt.staging import gates

    mpu.initialize_model_parallel(world, 1)
    set_args(_args(root, world, async_save=True, safe_ckpt_overlap_copy=True))
    model = StandInModel(5 + rank)
    opt = StandInMegatronOptimizer(model, 6 + rank)
    saved = _snapshot(model, opt)
    handle = safe_megatron.save_checkpoint(3, [model], opt, Scheduler(30), num_floating_point_operations_so_far=9)
    out = {"stall_s": handle.stall_s, "returned_before_copies": not handle.window_closed(),
           "windows_after_call": len(gates.open_windows())}
    stats = handle.window_stats()
    out["after_call"] = {"open_s": stats.open_s, "copied_bytes": stats.copied_bytes}
    # train_step: zero the grad buffers, optimizer.zero_grad() (the trigger), forward+backward, step
    opt.zero_grad()
    out["windows_after_zero_grad"] = len(gates.open_windows()) + int(handle.window_closed())
    opt.backward()
    hooks_before = gates.hook_calls()
    opt.step()
    out["step_met_the_window"] = gates.hook_calls() - hooks_before
    results = safe_megatron.finalize_async_saves(blocking=True)
    out["saved"] = len(results)
    out["zero_grad_calls"] = opt.zero_grad_calls
    out["tracker"] = open(os.path.join(root, "latest_checkpointed_iteration.txt")).read().strip()
    template = {k: ShardedTensor.from_rank_offsets(k, torch.empty(N), replica_id=0) for k in saved}
    loaded = dist_checkpointing.load(template, os.path.join(root, "iter_0000003"))
    out["checkpoint_is_the_call_state"] = {k: torch.equal(loaded[k], saved[k]) for k in saved}
    out["live_moved"] = not torch.equal(model.weight, saved["model.weight"])
    return out
