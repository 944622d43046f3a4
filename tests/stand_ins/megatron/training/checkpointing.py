"""Stand-in for megatron.training.checkpointing (core_v0.19.0 signatures, torch_dist semantics)."""

from __future__ import annotations

import os
import random
from argparse import Namespace
from typing import Optional

import numpy as np
import torch
from megatron.core import mpu
from megatron.core.dist_checkpointing.mapping import ShardedObject



def unwrap_model(model):
    return model


def get_checkpoint_name(checkpoints_path, iteration, release=False, pipeline_parallel=None, tensor_rank=None,
                        pipeline_rank=None, expert_parallel=None, expert_rank=None, return_base_dir=False,
                        basename="model_optim_rng.pt"):
    directory = "release" if release else "iter_{:07d}".format(iteration)
    assert return_base_dir, "the stand-in covers the torch_dist layout only"
    return os.path.join(checkpoints_path, directory)


def _build_sharded_state_dict_metadata(args: Namespace, dp_cp_group=None) -> dict:
    metadata = {}
    if args.use_distributed_optimizer:
        if getattr(args, "dist_ckpt_optim_fully_reshardable", False):
            metadata["distrib_optim_sharding_type"] = "fully_reshardable"
        else:
            metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    metadata["singleton_local_shards"] = False
    metadata["chained_optim_avoid_prefix"] = True
    metadata["dp_cp_group"] = dp_cp_group or mpu.get_data_parallel_group(with_context_parallel=True)
    return metadata


def get_rng_state(ckpt_format: str, tp_group, pp_group, dp_cp_group=None, dp_group=None, key_prefix: str = ""):
    rng_state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                 "torch_rng_state": torch.get_rng_state()}
    rng_state_list = [rng_state]
    if ckpt_format == "torch_dist":
        return ShardedObject(f"{key_prefix}rng_state", rng_state_list,
                             (pp_group.size(), tp_group.size()), (pp_group.rank(), tp_group.rank()),
                             replica_id=mpu.get_data_parallel_rank(with_context_parallel=True))
    return rng_state_list


def generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state, iteration=None,
                        optim_sd_kwargs=None, model_sd_kwargs=None, rerun_state=None):
    state_dict = {"args": args, "checkpoint_version": 3.0}
    if iteration is not None:
        state_dict["iteration"] = iteration
    for i in range(len(model)):
        key = "model" if len(model) == 1 else f"model{i}"
        state_dict[key] = model[i].sharded_state_dict(**(model_sd_kwargs or {}))
    if not args.no_save_optim:
        if optimizer is not None and not optimizer.is_stub_optimizer:
            state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, **(optim_sd_kwargs or {}))
        if opt_param_scheduler is not None:
            state_dict["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if rerun_state:
        state_dict["rerun_state_machine"] = rerun_state
    if not args.no_save_rng and rng_state:
        state_dict["rng_state"] = rng_state
    return state_dict


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                    checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None,
                    pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False, train_data_iterator=None,
                    preprocess_common_state_dict_fn=None, release=False, tp_group: Optional[object] = None,
                    pp_group=None, dp_cp_group=None, dp_group=None, expt_dp_group=None, rng_state_key_prefix=""):
    """Stock saving. The tests only need to know it was reached (the real one cannot run on a
    CPU-only torch: it fails in torch.cuda.synchronize())."""
    raise RuntimeError("stock megatron.training save_checkpoint was called")


# ---------------------------------------------------------------- loading (core_v0.19.0, torch_dist only)
# The real module's load path for --ckpt-format torch_dist, step by step with the same names, so that
# whatever replaces a name the real one calls (safe_ckpt.megatron.load_checkpoint swaps the
# `dist_checkpointing` module below for the call) meets the same calls. Left out: other formats,
# non-persistent and local checkpoints, ModelOpt, GPT->hybrid retargeting, wandb/FT callbacks.
# Differs where a CPU-only test cannot follow: `read_metadata` reduces on a CPU tensor (the real
# one on a CUDA tensor), the CUDA RNG states are set only where CUDA exists, and the microbatch
# calculator is not updated.

from megatron.core import dist_checkpointing  # noqa: E402

from .global_vars import get_args  # noqa: E402

_CHECKPOINT_VERSION = None
_LOADED_ITERATION = None


def set_checkpoint_version(value):
    global _CHECKPOINT_VERSION
    _CHECKPOINT_VERSION = value


def get_checkpoint_version():
    return _CHECKPOINT_VERSION


def set_loaded_iteration(value):
    global _LOADED_ITERATION
    _LOADED_ITERATION = value


def get_loaded_iteration():
    return _LOADED_ITERATION


def get_checkpoint_tracker_filename(checkpoints_path):
    return os.path.join(checkpoints_path, "latest_checkpointed_iteration.txt")


def checkpoint_exists(checkpoints_path):
    if checkpoints_path is None:
        return False
    return os.path.exists(get_checkpoint_tracker_filename(checkpoints_path))


def read_metadata(tracker_filename):
    iteration, release = -1, False
    with open(tracker_filename) as f:
        metastring = f.read().strip()
        try:
            iteration = int(metastring)
        except ValueError:
            release = metastring == "release"
            if not release:
                raise SystemExit(f"ERROR: Invalid metadata file {tracker_filename}. Exiting")
            iteration = 0
    if torch.distributed.is_initialized():
        iters = torch.tensor([iteration], dtype=torch.long)
        torch.distributed.all_reduce(iters, op=torch.distributed.ReduceOp.MAX)
        iteration = int(iters[0].item())
    return iteration, release


def find_checkpoint_rank_0(checkpoints_path, iteration, release=False):
    filename = get_checkpoint_name(checkpoints_path, iteration, release, pipeline_parallel=True, return_base_dir=True)
    if dist_checkpointing.check_is_distributed_checkpoint(filename):
        return filename
    return None


def check_checkpoint_args(checkpoint_args, skip_args=None):
    args = get_args()
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        if hasattr(checkpoint_args, name) and hasattr(args, name) and (skip_args is None or name not in skip_args):
            assert getattr(checkpoint_args, name) == getattr(args, name), f"{name} value from checkpoint differs"


def _accepted(fn, kwargs):
    import inspect

    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def _load_global_dist_base_checkpoint(load_dir, args, rank0, sharded_state_dict, iteration, release,
                                      checkpointing_context=None, dp_cp_group=None, expt_dp_group=None):
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    if rank0:
        checkpoint_name = find_checkpoint_rank_0(load_dir, iteration, release)
        state_dict = dist_checkpointing.load_common_state_dict(checkpoint_name)
        return state_dict, checkpoint_name, release, "global"
    checkpoint_name = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
    load_strategy = TorchDistLoadShardedStrategy(**_accepted(TorchDistLoadShardedStrategy.__init__, dict(
        cache_metadata=args.ckpt_assume_constant_structure)))
    if args.ckpt_fully_parallel_load:
        group = dp_cp_group if dp_cp_group is not None else mpu.get_data_parallel_group(with_context_parallel=True)
        load_strategy = FullyParallelLoadStrategyWrapper(load_strategy, group)
    if checkpointing_context is not None:
        checkpointing_context["load_strategy"] = load_strategy
    state_dict = dist_checkpointing.load(sharded_state_dict, checkpoint_name, load_strategy,
                                         **_accepted(dist_checkpointing.load, dict(
                                             validate_access_integrity=args.ckpt_load_validate_sharding_integrity,
                                             strict=args.dist_ckpt_strictness,
                                             verify_integrity=args.verify_integrity)))
    return state_dict, checkpoint_name, release, "global"


def _get_checkpoint_format(checkpoint_name, args):
    if dist_checkpointing.check_is_distributed_checkpoint(checkpoint_name):
        return "torch_dist"
    raise NotImplementedError(f"unknown checkpoint format in {checkpoint_name}")


def _load_base_checkpoint(load_dir, args, rank0=False, sharded_state_dict=None, checkpointing_context=None,
                          dp_cp_group=None, expt_dp_group=None, gpt_compat_layer_maps=None):
    iteration, release = -1, False
    if load_dir is not None:
        tracker_filename = get_checkpoint_tracker_filename(load_dir)
        if os.path.isfile(tracker_filename):
            iteration, release = read_metadata(tracker_filename)
    if getattr(args, "ckpt_step", None):
        iteration = args.ckpt_step
    set_loaded_iteration(iteration)
    if iteration == -1:
        return None, "", False, None
    checkpoint_name = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
    _get_checkpoint_format(checkpoint_name, args)
    return _load_global_dist_base_checkpoint(load_dir, args, rank0, sharded_state_dict, iteration, release,
                                             checkpointing_context=checkpointing_context, dp_cp_group=dp_cp_group,
                                             expt_dp_group=expt_dp_group)


def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True,
                    checkpointing_context=None, skip_load_to_model_and_opt=False, tp_group=None, pp_group=None,
                    dp_cp_group=None, dp_group=None, expt_dp_group=None, rng_state_key_prefix=""):
    args = get_args()
    load_dir = getattr(args, load_arg)
    pretrained_dir = getattr(args, "pretrained_checkpoint", None)
    if pretrained_dir is not None and not checkpoint_exists(load_dir):
        load_dir = pretrained_dir
        if not checkpoint_exists(load_dir):
            raise FileNotFoundError("No checkpoint found in load directory or pretrained directory")
        args.finetune = True
    model = unwrap_model(ddp_model)

    state_dict, checkpoint_name, release, ckpt_type = _load_base_checkpoint(
        load_dir, args, rank0=True, checkpointing_context=checkpointing_context)
    ckpt_format = "torch_dist" if ckpt_type == "global" else None
    ignore_rng_state = False
    load_kwargs = {}
    if ckpt_format == "torch_dist":
        ckpt_args = state_dict.get("args") or Namespace()
        ckpt_tp_pp = (getattr(ckpt_args, "tensor_model_parallel_size", 1),
                      getattr(ckpt_args, "pipeline_model_parallel_size", 1))
        run_tp_pp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
        if (ckpt_tp_pp == run_tp_pp and not release and not args.finetune and not args.no_load_rng
                and not getattr(ckpt_args, "no_save_rng", False)):
            if tp_group is None and pp_group is None:
                tp_group = mpu.get_tensor_model_parallel_group()
                pp_group = mpu.get_pipeline_model_parallel_group()
            gen_sd_rng_state = get_rng_state(args.ckpt_format, tp_group, pp_group, dp_cp_group=dp_cp_group,
                                             dp_group=dp_group, key_prefix=rng_state_key_prefix)
        else:
            ignore_rng_state = True
            gen_sd_rng_state = None
        sharded_sd_metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=state_dict)
        if (not release and not args.finetune and not args.no_load_optim
                and not getattr(ckpt_args, "no_save_optim", False)):
            gen_sd_optim, gen_sd_opt_param_scheduler = optimizer, opt_param_scheduler
        else:
            gen_sd_optim, gen_sd_opt_param_scheduler = None, None
        if dp_cp_group is None:
            dp_cp_group = mpu.get_data_parallel_group(with_context_parallel=True)
        sharded_sd_metadata = dict(sharded_sd_metadata or {})
        sharded_sd_metadata["dp_cp_group"] = dp_cp_group
        load_kwargs["sharded_state_dict"] = generate_state_dict(
            args, model, gen_sd_optim, gen_sd_opt_param_scheduler, gen_sd_rng_state,
            optim_sd_kwargs=dict(metadata=sharded_sd_metadata, is_loading=True),
            model_sd_kwargs=dict(metadata=sharded_sd_metadata))

    state_dict, checkpoint_name, release, ckpt_type = _load_base_checkpoint(
        load_dir, args, rank0=False, checkpointing_context=checkpointing_context, dp_cp_group=dp_cp_group,
        expt_dp_group=expt_dp_group, **load_kwargs)
    if state_dict is None:
        return 0, 0
    set_checkpoint_version(state_dict.get("checkpoint_version", 0))
    iteration = 0 if args.finetune or release else state_dict["iteration"]
    num_floating_point_operations_so_far = state_dict.get("num_floating_point_operations_so_far", 0)
    if "args" in state_dict and not args.finetune:
        checkpoint_args = state_dict["args"]
        check_checkpoint_args(checkpoint_args)
        args.consumed_train_samples = getattr(checkpoint_args, "consumed_train_samples", 0)
        args.skipped_train_samples = getattr(checkpoint_args, "skipped_train_samples", 0)
        args.consumed_valid_samples = getattr(checkpoint_args, "consumed_valid_samples", 0)
    if not skip_load_to_model_and_opt:
        if len(ddp_model) == 1:
            ddp_model[0].load_state_dict(state_dict["model"], strict=strict)
        else:
            for i in range(len(ddp_model)):
                if "model%d" % i in state_dict:
                    ddp_model[i].load_state_dict(state_dict["model%d" % i], strict=strict)
    if not release and not args.finetune and not args.no_load_optim:
        if not skip_load_to_model_and_opt and optimizer is not None and not optimizer.is_stub_optimizer:
            optimizer.load_state_dict(state_dict["optimizer"])
        if opt_param_scheduler is not None and not args.finetune:
            opt_param_scheduler.load_state_dict(state_dict["opt_param_scheduler"])
    elif (args.fp16 or args.bf16) and optimizer is not None:
        optimizer.reload_model_params()
    if not release and not args.finetune and not args.no_load_rng and not ignore_rng_state:
        rng_state = state_dict["rng_state"]
        rng_state = rng_state[mpu.get_data_parallel_rank()] if args.data_parallel_random_init else rng_state[0]
        random.setstate(rng_state["random_rng_state"])
        np.random.set_state(rng_state["np_rng_state"])
        torch.set_rng_state(rng_state["torch_rng_state"])
        if torch.cuda.is_available() and "cuda_rng_state" in rng_state:
            torch.cuda.set_rng_state(rng_state["cuda_rng_state"])
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return iteration, num_floating_point_operations_so_far
