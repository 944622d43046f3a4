"""Mirror of slime's MegatronTrainRayActor (init, save_model, sleep/wake_up), over gloo, on CPU or GPU.

With `args.offload_train` (slime's `--offload-train`) and `device="cuda"` the synthetic state
lives on the GPU inside a real torch_memory_saver region with a CPU backup, and `sleep()` /
`wake_up()` pause and resume it, as slime's do between training and rollout. Where this
differs from slime v0.2.x, and why:
- slime (v0.2.4) puts torch_memory_saver in its `preload` hook mode (RayTrainGroup sets
  `LD_PRELOAD` and `TMS_INIT_ENABLE{,_CPU_BACKUP}=1`, so every allocation of the actor is
  pauseable, one default tag) and `sleep()` calls `pause()` for all tags. The mirror uses the
  `torch` hook mode (a CUDAPluggableAllocator MemPool, no LD_PRELOAD in the worker's
  environment) and one explicit region with `enable_cpu_backup=True` around the state; its
  tag is the only one, so pausing the tag pauses what slime's `pause()` would.
- slime's `sleep()` also destroys its reloadable NCCL process groups, and `save_model`
  reloads them around the save (v0.2.3/v0.2.4); the mirror has no NCCL groups (gloo only),
  so there is nothing to destroy or reload. Memory stays paused during `save_model`, as in
  v0.2.x (v0.3.x calls `wake_up()` first instead).
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta

TMS_TAG = "train"  # the mirror's one torch_memory_saver region (slime: every allocation, default tag)


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


def _clear_memory(clear_host_memory: bool = False) -> None:
    """Stands for slime.utils.memory_utils.clear_memory: synchronize, collect, drop cached blocks."""
    import gc

    import torch

    if not torch.cuda.is_available():
        return
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    if clear_host_memory and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()


def _memory_saver():
    from torch_memory_saver import torch_memory_saver

    return torch_memory_saver


class MegatronTrainRayActor:
    def __init__(self, world_size, rank, master_addr, master_port):
        self.world_size, self.rank = world_size, rank
        if master_addr:
            os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK="0")

    def get_master_addr_and_port(self):
        from safe_ckpt.bench.ray_launch import host_rendezvous

        return host_rendezvous()

    def init(self, args, role, seed_spec, device="cpu"):
        """As slime's init: process group, model parallel state, model/optimizer, then the
        --custom-megatron-init-path hook. ``device`` (mirror only) is where the synthetic
        state lives; with ``args.offload_train`` it is built in a torch_memory_saver region."""
        import torch.distributed as dist
        from megatron.core import mpu
        from megatron.training.global_vars import set_args

        from safe_ckpt.synthetic import StateSpec, build_state
        from tests.slime_mirror.utils.misc import load_function

        self.args = args
        self.device = str(device)
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():  # ranks spawned by tests/mp.py come with their group
            dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        mpu.initialize_model_parallel(args.tensor_model_parallel_size, 1)
        set_args(args)
        self.spec = StateSpec(**seed_spec)
        with self._offloadable_region():
            state = build_state(self.rank, self.world_size, tp=args.tensor_model_parallel_size, spec=self.spec,
                                device=self.device)
        self._state = state
        self.model = [_SyntheticModel(state)]
        self.optimizer = _SyntheticOptimizer(state)
        self.opt_param_scheduler = _Scheduler()
        if getattr(args, "custom_megatron_init_path", None):  # as slime's initialize.init does, last
            load_function(args.custom_megatron_init_path)(args)
        return True

    def _offloadable_region(self):
        """Where slime's model and optimizer are allocated when --offload-train is set:
        pauseable memory with a CPU backup (see the module docstring for the hook mode)."""
        if not getattr(self.args, "offload_train", False):
            return contextlib.nullcontext()
        if not self.device.startswith("cuda"):
            raise ValueError("--offload-train needs the state on a CUDA device (device='cuda')")
        tms = _memory_saver()
        try:
            tms.hook_mode = "torch"  # only before the saver's first use in this process
        except (AttributeError, AssertionError):
            pass
        return tms.region(tag=TMS_TAG, enable_cpu_backup=True)

    def sleep(self):
        """As slime's sleep (RayTrainGroup.offload): drop cached memory, pause the saver."""
        assert self.args.offload_train
        _clear_memory(clear_host_memory=True)
        _memory_saver().pause(TMS_TAG)
        return True

    def wake_up(self):
        """As slime's wake_up (RayTrainGroup.onload): resume the saver (the CPU backup is copied back)."""
        assert self.args.offload_train
        _memory_saver().resume(TMS_TAG)
        _clear_memory()
        return True

    def save_model(self, rollout_id, force_sync=False):
        """As slime v0.2.x: finalize pending async saves, save, finalize again if forced.
        With --offload-train, v0.2.x only reloads its NCCL groups here (none in the mirror):
        the memory stays as it is, paused if the actor is asleep."""
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

    def update_args(self, changes):
        """Set attributes of this actor's args (the object Megatron's get_args() returns), e.g.
        {"safe_ckpt_unmapped_policy": "cpu_backup"}: what a relaunch with other flags would give."""
        for name, value in changes.items():
            setattr(self.args, name, value)
        return True

    def watch_saves(self):
        """Keep the result of each save that slime's `save` makes (it discards it): wraps the
        `save_checkpoint` that `install()` bound in the model module."""
        import importlib

        module = importlib.import_module(getattr(self.args, "safe_ckpt_model_module", None)
                                         or "tests.slime_mirror.backends.megatron_utils.model")
        inner = module.save_checkpoint
        self._last_save = None

        def save_checkpoint(*args, **kwargs):
            self._last_save = None
            result = inner(*args, **kwargs)
            self._last_save = result
            return result

        module.save_checkpoint = save_checkpoint
        return True

    def last_save(self):
        """bytes_by_residence of the last save that succeeded since the previous call, or None."""
        result, self._last_save = getattr(self, "_last_save", None), None
        return None if result is None else dict(result.bytes_by_residence)

    def probe(self):
        """That the process and its device work, and where the state's tensors are now
        (safe_ckpt's classification, which asks the CUDA driver and reads nothing)."""
        import torch

        from safe_ckpt import residence

        counts: dict[str, int] = {}
        keys = []
        for key, tensor in self._state_tensors():
            kind = residence.classify(tensor).residence
            counts[kind] = counts.get(kind, 0) + 1
            keys.append(key)
        device_ok = True
        if self.device.startswith("cuda"):  # fresh memory outside the paused region still works
            device_ok = int(torch.arange(10, device=self.device).sum().item()) == 45
        return {"pid": os.getpid(), "residences": counts, "keys": sorted(set(keys)), "device_ok": device_ok}

    def _state_tensors(self):
        import torch
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        def walk(tree):
            if isinstance(tree, dict):
                for v in tree.values():
                    yield from walk(v)
            elif isinstance(tree, list):
                for v in tree:
                    yield from walk(v)
            elif isinstance(tree, (ShardedTensor, ShardedTensorFactory)) and isinstance(tree.data, torch.Tensor):
                yield tree.key, tree.data

        yield from walk({"model": self._state["model"], "optimizer": self._state["optimizer"]})

    def check_load(self, iteration):
        """Load iteration with stock Megatron under another sharding; list mismatches.
        Reads only the checkpoint and a freshly seeded CPU reference, so it works asleep too."""
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
