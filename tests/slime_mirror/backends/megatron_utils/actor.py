"""Mirror of slime's MegatronTrainRayActor (init and save_model), on CPU with gloo."""

from __future__ import annotations

import os
from datetime import timedelta


class _SyntheticModel:
    def __init__(self, state):
        self._state = state

    def sharded_state_dict(self, metadata=None, **kwargs):
        return self._state["model"]


class _SyntheticOptimizer:
    is_stub_optimizer = False

    def __init__(self, state):
        self._state = state

    def sharded_state_dict(self, model_state_dict, metadata=None, is_loading=False, **kwargs):
        return self._state["optimizer"]


class _Scheduler:
    def state_dict(self):
        return {"max_lr": 1e-4, "num_steps": 40}


class MegatronTrainRayActor:
    def __init__(self, world_size, rank, master_addr, master_port):
        self.world_size, self.rank = world_size, rank
        if master_addr:
            os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK="0")

    def get_master_addr_and_port(self):
        from safe_ckpt.bench.ray_launch import host_rendezvous

        return host_rendezvous()

    def init(self, args, role, seed_spec):
        import torch.distributed as dist
        from megatron.core import mpu
        from megatron.training.global_vars import set_args

        from safe_ckpt.synthetic import StateSpec, build_state
        from tests.slime_mirror.utils.misc import load_function

        self.args = args
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        mpu.initialize_model_parallel(args.tensor_model_parallel_size, 1)
        set_args(args)
        self.spec = StateSpec(**seed_spec)
        state = build_state(self.rank, self.world_size, tp=args.tensor_model_parallel_size, spec=self.spec)
        self.model = [_SyntheticModel(state)]
        self.optimizer = _SyntheticOptimizer(state)
        self.opt_param_scheduler = _Scheduler()
        if getattr(args, "custom_megatron_init_path", None):  # as slime's initialize.init does, last
            load_function(args.custom_megatron_init_path)(args)
        return True

    def save_model(self, rollout_id, force_sync=False):
        """As slime v0.2.x: finalize pending async saves, save, finalize again if forced."""
        from .model import save  # slime imports it at module level; here the driver must not need megatron.training
        if self.args.async_save:
            from megatron.training.async_utils import maybe_finalize_async_save

            maybe_finalize_async_save(blocking=True)
        save(rollout_id, self.model, self.optimizer, self.opt_param_scheduler)
        if force_sync and self.args.async_save:
            from megatron.training.async_utils import maybe_finalize_async_save

            maybe_finalize_async_save(blocking=True)

    # ---- test hooks (not in slime) -----------------------------------------------------------
    def arm_fault(self, fault_kw):
        """Make this actor's next save misbehave (a SIGKILL, ENOSPC, ...) in its byte sink."""
        import safe_ckpt.megatron.training as training
        from safe_ckpt.sinks.faults import Fault, FaultySink
        from safe_ckpt.sinks.posix import PosixSink

        original = training.options_from_args
        fault = Fault(**fault_kw)

        def options_from_args(args):
            import dataclasses

            return dataclasses.replace(original(args), sink_factory=lambda d: FaultySink(PosixSink(d), fault))

        training.options_from_args = options_from_args
        return True

    def check_load(self, iteration):
        """Load iteration with stock Megatron under another sharding; list mismatches."""
        from megatron.core import dist_checkpointing

        from safe_ckpt.synthetic import build_state
        from tests.cases import compare_loaded

        tp = self.args.tensor_model_parallel_size
        path = os.path.join(self.args.save, f"iter_{iteration:07d}")
        target = build_state(self.rank, self.world_size, tp=tp, spec=self.spec, layout="alt", empty=True, saved_tp=tp)
        expected = build_state(self.rank, self.world_size, tp=tp, spec=self.spec, layout="alt", saved_tp=tp)
        target.pop("rank_info"), expected.pop("rank_info")  # the synthetic model does not save these
        target.pop("rng_state"), expected.pop("rng_state")
        loaded = dist_checkpointing.load(target, path)
        return compare_loaded(loaded, expected), loaded.get("iteration")
