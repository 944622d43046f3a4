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
