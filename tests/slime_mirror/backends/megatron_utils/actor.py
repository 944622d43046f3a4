"""Mirror of slime's MegatronTrainRayActor (init, save_model, sleep/wake_up), over gloo, on CPU or GPU.

Mirrors THUDM/slime 624b824a (see tests/slime_mirror/__init__.py): `save_model` wakes the actor up
(`--offload-train`), finalizes pending async saves, saves, finalizes again if `force_sync`, writes
the HF copy (`--save-hf`, actor role), and puts it back to sleep; `sleep` = clear memory, destroy
the process groups, pause the memory saver; `wake_up` = resume, clear memory, reload the groups,
and (actor role) restore the weights from slime's `TensorBackuper` (`_switch_model("actor")`).

Memory layout, as slime ships it when `args.disable_param_buffers_cpu_backup` is set (slime's
`parse_args` sets it, and the grad one, with `--offload-train`; the test cases' `slime_args` too):
every bf16 model weight is a parameter viewing one flat `param_data` allocated in
`torch_memory_saver.region(tag="param_buffer", enable_cpu_backup=False)`, a flat `grad_data` sits in
`region(tag="grad_buffer", enable_cpu_backup=False)` (what slime's Megatron patch does in
`_ParamAndGradBuffer` with the distributed optimizer), everything else is outside those regions
(slime: the preload hook's default region, with CPU backup), and `weights_backuper` (the mirror of
slime's TensorBackuper, tests/slime_mirror/utils/tensor_backper.py) holds the weights in host memory
under the tag "actor", backed up at init and after each train step. `sleep` pauses every tag, as
slime's does; on CPU the stand-in torch_memory_saver (tests/stand_ins_tms) overwrites the regions
without backup, so whatever reads the weights while asleep from the parameters reads garbage.
Otherwise (the GPU tests' own args) the older layout: with `args.offload_train` and `device="cuda"`
the synthetic state lives inside one real torch_memory_saver region with a CPU backup.

`--release-train` (slime's `RayTrainGroup.create`/`save_model`/`release`, tests/slime_mirror/ray):
`init` loads `args.load` as slime's `initialize_model_and_optimizer` does, through slime's
`load_checkpoint` (checkpoint.py), which calls the module-level `_load_checkpoint_megatron`
(Megatron's `load_checkpoint`: the stand-in of core_v0.19.0's on CPU, tests/stand_ins; or what the
init hook bound there), and returns the next rollout id. The synthetic model and optimizer take
the loaded state as Megatron's do (`load_state_dict`: the values copied into their own tensors).

Where this differs from slime, and why:
- slime puts torch_memory_saver in its `preload` hook mode (RayTrainGroup sets `LD_PRELOAD` and
  `TMS_INIT_ENABLE{,_CPU_BACKUP}=1`, so every allocation of the actor is pauseable, one default tag)
  and calls `pause()`/`resume()` for all tags. The mirror uses the `torch` hook mode (a
  CUDAPluggableAllocator MemPool, no LD_PRELOAD) and one explicit region with
  `enable_cpu_backup=True` around the state; its tag is the only one.
- On CPU (`device="cpu"`) `--offload-train` has no memory saver to pause: `sleep`/`wake_up` do
  everything else (clear memory, destroy and reload the process groups), so the CPU tests see
  slime's group cycle and call counts.
- The process groups: the mirror's gloo WORLD stands for slime's NCCL WORLD in
  `utils/reloadable_process_group.py` (destroyed at sleep, a temporary gloo WORLD meanwhile,
  re-created at wake_up); Megatron's model-parallel groups are rebuilt at reload where slime
  re-creates its wrapped groups in place.
- `args.mirror_keep_groups` (mirror only) leaves the groups alive across sleep, as slime v0.2.x did:
  the GPU residence scenario saves in place while asleep (`save_in_place`) through the stock path.
- `init` does not call `sleep()` at its end as slime's does with `--offload-train`: the tests put
  the actor to sleep themselves (slime's `train()` also ends with `sleep()`).
- `args.mirror_param_buffer_backup = "disk"` (mirror only) spills the parameters' region to disk at
  pause instead (`enable_disk_backup`): a layout slime does not ship, for the tests of a tensor
  without readable source.
- `train` trains nothing unless `args.mirror_train_step` is set: then it changes every weight and
  optimizer tensor by a seeded step (a function of the rollout id and the state), as training would.
- `self.calls` counts sleep / wake_up / save_hf calls (test bookkeeping, not in slime).
"""

from __future__ import annotations

import contextlib
import os
import sys
from datetime import timedelta

TMS_TAG = "train"  # the mirror's one torch_memory_saver region (slime: every allocation, default tag)
STAND_INS_TMS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))), "stand_ins_tms")


class _SyntheticModel:
    def __init__(self, state, params=(), buffers=()):
        self._state = state
        self._params, self._buffers = list(params), list(buffers)

    def sharded_state_dict(self, metadata=None, **kwargs):
        return _fresh(self._state["model"])

    def load_state_dict(self, state_dict, strict=True):
        """As Megatron's module: the loaded values copied into the model's own tensors."""
        mine, given = set(self._state["model"]), set(state_dict)
        if strict and mine != given:
            raise RuntimeError(f"Error(s) in loading state_dict: missing {sorted(mine - given)}, "
                               f"unexpected {sorted(given - mine)}")
        _copy_leaves(self._state["model"], state_dict)

    def named_parameters(self):
        return iter(self._params)

    def named_buffers(self):
        return iter(self._buffers)


class _SyntheticOptimizer:
    """Megatron's optimizer as far as the save reads it; `optimizer` stands for the inner torch
    optimizer (its param_groups hold the fp32 main-parameter shards)."""

    is_stub_optimizer = False

    def __init__(self, state):
        import types

        self._state = state
        mains = [piece["tensor"].data for key, pieces in state["optimizer"]["distributed"].items()
                 if key.endswith(".param") for piece in pieces]
        self.optimizer = types.SimpleNamespace(param_groups=[{"params": mains}], state={})

    def sharded_state_dict(self, model_state_dict, metadata=None, is_loading=False, **kwargs):
        return _fresh(self._state["optimizer"])

    def load_state_dict(self, state_dict):
        """As Megatron's distributed optimizer: the loaded shards copied into its own tensors."""
        _copy_leaves(self._state["optimizer"], state_dict)


class _Scheduler:
    def __init__(self):
        self._state = {"max_lr": 1e-4, "num_steps": 40}

    def state_dict(self):
        return dict(self._state)

    def load_state_dict(self, state_dict):
        self._state = dict(state_dict)


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


def _memory_saver(stand_in: bool = False):  # slime imports it at module level; the CPU mirror must not need it
    if stand_in and STAND_INS_TMS not in sys.path:  # no device: the CPU stand-in
        sys.path.insert(0, STAND_INS_TMS)
    from torch_memory_saver import torch_memory_saver

    return torch_memory_saver


def _shipped_layout(args) -> bool:
    return bool(getattr(args, "disable_param_buffers_cpu_backup", False))


def _weight_holders(state):
    """(slime's global parameter name, the ShardedTensor or factory holding it) of every bf16 weight."""
    import torch

    for key, entry in state["model"].items():
        entries = entry if isinstance(entry, list) else [entry]
        for layer, holder in enumerate(entries):
            if getattr(holder, "data", None) is None or holder.data.dtype != torch.bfloat16:
                continue
            name = key.replace("decoder.layers.", f"decoder.layers.{layer}.", 1) if isinstance(entry, list) else key
            yield f"module.module.{name}", holder


class MegatronTrainRayActor:
    def __init__(self, world_size, rank, master_addr, master_port):
        self.world_size, self.rank = world_size, rank
        if master_addr:
            os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK="0")

    def get_master_addr_and_port(self):
        from safe_ckpt_lab.bench.ray_launch import host_rendezvous

        return host_rendezvous()

    def init(self, args, role, seed_spec, device="cpu"):
        """As slime's init: process group, model parallel state, model/optimizer, then the
        --custom-megatron-init-path hook. ``device`` (mirror only) is where the synthetic
        state lives; with ``args.offload_train`` it is built in a torch_memory_saver region."""
        import torch.distributed as dist
        from megatron.core import mpu
        from megatron.training.global_vars import set_args

        from safe_ckpt_lab.synthetic import StateSpec, build_state
        from tests.slime_mirror.utils.misc import load_function

        from tests.slime_mirror.utils.reloadable_process_group import register_default_process_group

        self.args = args
        self.role = role
        self.calls = {"sleep": 0, "wake_up": 0, "save_hf": 0}
        self.device = str(device)
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():  # ranks spawned by tests/helpers/mp.py come with their group
            dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        mpu.initialize_model_parallel(args.tensor_model_parallel_size, 1)
        register_default_process_group(timedelta(seconds=120), rebuild_subgroups=self._rebuild_model_parallel)
        set_args(args)
        self.spec = StateSpec(**seed_spec)
        with self._offloadable_region():
            state = build_state(self.rank, self.world_size, tp=args.tensor_model_parallel_size, spec=self.spec,
                                device=self.device)
        self._state = state
        params = self._lay_out_as_shipped() if _shipped_layout(args) else []
        self.model = [_SyntheticModel(state, params, [("embedding.position_ids", state["model"]["embedding.position_ids"].data)])]
        self.optimizer = _SyntheticOptimizer(state)
        self.opt_param_scheduler = _Scheduler()
        if getattr(args, "custom_megatron_init_path", None):  # as slime's initialize.init does, last
            load_function(args.custom_megatron_init_path)(args)
        self.loaded_iteration = self._load(args.load) if getattr(args, "load", None) else None
        if params:
            from tests.slime_mirror.utils.tensor_backper import TensorBackuper

            self.weights_backuper = TensorBackuper.create(source_getter=lambda: iter(params), single_tag=None)
            self._active_model_tag = "actor"
            self.weights_backuper.backup("actor")
        return 0 if self.loaded_iteration is None else self.loaded_iteration + 1

    def _lay_out_as_shipped(self):
        """The weights as parameters viewing one flat buffer without CPU backup (see the module docstring)."""
        import torch

        tms = _memory_saver(stand_in=not self.device.startswith("cuda"))
        holders = list(_weight_holders(self._state))
        numel = sum(h.data.numel() for _, h in holders)
        disk = getattr(self.args, "mirror_param_buffer_backup", None) == "disk"  # a layout slime does not ship
        with tms.region(tag="param_buffer", enable_cpu_backup=False, enable_disk_backup=disk):
            param_data = torch.zeros(numel, dtype=torch.bfloat16, device=self.device)
        with tms.region(tag="grad_buffer", enable_cpu_backup=False):
            self._grad_data = torch.zeros(numel, dtype=torch.float32, device=self.device)
        params, offset = [], 0
        for name, holder in holders:
            n = holder.data.numel()
            view = param_data[offset:offset + n].view(holder.data.shape)
            view.copy_(holder.data)
            holder.data = torch.nn.Parameter(view, requires_grad=False)
            params.append((name, holder.data))
            offset += n
        self._param_data = param_data
        return params

    def _switch_model(self, target_tag):
        """As slime's: restore the weights of a tag from the backuper."""
        if target_tag not in self.weights_backuper.backup_tags:
            raise ValueError(f"Cannot switch to unknown model tag: {target_tag}")
        self.weights_backuper.restore(target_tag)
        self._active_model_tag = target_tag

    def _load(self, load_dir):
        """The load that ends slime's `initialize_model_and_optimizer`: slime's `load_checkpoint`
        (checkpoint.py) with the same arguments; returns the iteration loaded."""
        from .checkpoint import load_checkpoint

        iteration, _ = load_checkpoint(self.model, self.optimizer, self.opt_param_scheduler,
                                       checkpointing_context={}, skip_load_to_model_and_opt=False)
        return iteration

    def _rebuild_model_parallel(self):
        from megatron.core import mpu

        mpu.destroy_model_parallel()
        mpu.initialize_model_parallel(self.args.tensor_model_parallel_size, 1)

    def _offloadable_region(self):
        """Where slime's model and optimizer are allocated when --offload-train is set:
        pauseable memory with a CPU backup (see the module docstring for the hook mode)."""
        if not getattr(self.args, "offload_train", False) or not self.device.startswith("cuda"):
            return contextlib.nullcontext()
        tms = _memory_saver()
        try:
            tms.hook_mode = "torch"  # only before the saver's first use in this process
        except (AttributeError, AssertionError):
            pass
        return tms.region(tag=TMS_TAG, enable_cpu_backup=True)

    def sleep(self):
        """As slime's: drop cached memory, destroy the process groups, pause the saver."""
        from tests.slime_mirror.utils.reloadable_process_group import destroy_process_groups

        assert self.args.offload_train
        self.calls["sleep"] += 1
        _clear_memory(clear_host_memory=True)
        if not getattr(self.args, "mirror_keep_groups", False):
            destroy_process_groups()
        if _shipped_layout(self.args):
            _memory_saver(stand_in=not self.device.startswith("cuda")).pause()
        elif self.device.startswith("cuda"):
            _memory_saver().pause(TMS_TAG)
        return True

    def wake_up(self):
        """As slime's: resume the saver (the CPU backup is copied back), clear memory, reload the groups."""
        from tests.slime_mirror.utils.reloadable_process_group import reload_process_groups

        assert self.args.offload_train
        self.calls["wake_up"] += 1
        if _shipped_layout(self.args):
            _memory_saver(stand_in=not self.device.startswith("cuda")).resume()
        elif self.device.startswith("cuda"):
            _memory_saver().resume(TMS_TAG)
        _clear_memory()
        if not getattr(self.args, "mirror_keep_groups", False):
            reload_process_groups()
        if self.role == "actor" and hasattr(self, "weights_backuper"):
            self._switch_model("actor")
        return True

    def train(self, rollout_id, rollout_data_ref=None, external_data=None):
        """As slime's `train`: wake_up, the training (a seeded step with `args.mirror_train_step`),
        the weights backed up under "actor" (`train_actor`'s end), sleep."""
        if self.args.offload_train:
            self.wake_up()
        if getattr(self.args, "mirror_train_step", False):
            self._train_step(rollout_id)
        if hasattr(self, "weights_backuper"):
            self.weights_backuper.backup("actor")
        if self.args.offload_train:
            self.sleep()

    def _train_step(self, rollout_id):
        import torch

        import zlib

        with torch.no_grad():  # seeded by the tensor's place, not the rank: replicas stay equal, as in training
            for path, t in _leaves({"model": self._state["model"], "optimizer": self._state["optimizer"]}, keys=True):
                t = t.data
                g = torch.Generator().manual_seed(1000 * (rollout_id + 1) + zlib.crc32(path.encode()))
                if t.is_floating_point():
                    t.add_(torch.randn(t.shape, generator=g).to(t.dtype).mul_(0.01))
                else:
                    t.add_(rollout_id + 1)

    def state_digest(self):
        """sha256 of every tensor this rank saves (model and optimizer), in a fixed order."""
        import hashlib

        h = hashlib.sha256()
        for t in _leaves({"model": self._state["model"], "optimizer": self._state["optimizer"]}):
            h.update(t.data.detach().cpu().contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
        return h.hexdigest()

    def loaded(self):
        return self.loaded_iteration

    def loaded_by_safe_ckpt(self):
        """(save root, iteration) that safe_ckpt's load read in this process, None if none did."""
        from safe_ckpt.megatron.loading import loaded_checkpoint

        loaded = loaded_checkpoint()
        return None if loaded is None else (loaded.save_root, loaded.iteration)

    def save_model(self, rollout_id, force_sync=False):
        """As slime's (624b824a), line for line (plus the mirror's count of HF saves)."""
        from pathlib import Path

        from .hf_checkpoint_saver import save_hf_model_to_path
        from .model import save  # slime imports it at module level; here the driver must not need megatron.training

        if self.args.debug_rollout_only:
            return

        # torch dist may trigger nccl communication during saving.
        if self.args.offload_train:
            self.wake_up()

        if self.args.async_save:
            from megatron.training.async_utils import maybe_finalize_async_save

            maybe_finalize_async_save(blocking=True)

        save(rollout_id, self.model, self.optimizer, self.opt_param_scheduler)

        if force_sync and self.args.async_save:
            maybe_finalize_async_save(blocking=True)

        if self.args.save_hf is not None and self.role == "actor":
            self.calls["save_hf"] += 1
            save_hf_model_to_path(self.args, Path(self.args.save_hf.format(rollout_id=rollout_id)), self.model)

        if self.args.offload_train:
            self.sleep()

    # ---- test hooks (not in slime) -----------------------------------------------------------
    def save_in_place(self, rollout_id, force_sync=False):
        """The save as slime v0.2.x made it: finalize, save, finalize if forced, with the state left
        where it is (paused if asleep). What the GPU residence scenario drives."""
        from .model import save

        if self.args.async_save:
            from megatron.training.async_utils import maybe_finalize_async_save

            maybe_finalize_async_save(blocking=True)
        save(rollout_id, self.model, self.optimizer, self.opt_param_scheduler)
        if force_sync and self.args.async_save:
            from megatron.training.async_utils import maybe_finalize_async_save

            maybe_finalize_async_save(blocking=True)

    def call_counts(self):
        return dict(self.calls)

    def asleep_state(self):
        """What the asleep path installed on this class knows (None where it is not installed)."""
        from safe_ckpt.integrations.slime_asleep import installed

        saves = installed(type(self))
        if saves is None:
            return None
        return {"asleep": saves.asleep, "inflight": saves.inflight is not None,
                "last_hold_s": saves.last_hold_s, "last_wake_wait_s": saves.last_wake_wait_s,
                "class_is_patched": type(self).wake_up is MegatronTrainRayActor.wake_up}

    def capture_logs(self):
        """Keep safe_ckpt's log messages from now on (`logged()` returns them)."""
        import logging

        records = self._log_records = []

        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())

        logger = logging.getLogger("safe_ckpt")
        logger.addHandler(Keep())
        logger.setLevel(logging.INFO)
        return True

    def logged(self):
        return list(getattr(self, "_log_records", []))

    def gate_writes(self):
        """Hold every write of the next saves at a gate until `release_writes()`; `writes_reached`
        is set when the first write arrives there (in-process tests only: a Ray actor runs one call
        at a time, so nothing could release it while a call waits)."""
        import dataclasses
        import threading

        import safe_ckpt.megatron.training as training
        from tests.helpers.hooked_sinks import HookedSink

        self.writes_reached, self.writes_released = threading.Event(), threading.Event()
        reached, released = self.writes_reached, self.writes_released
        original = training.options_from_args

        class GatedSink(HookedSink):
            def before_write(self):
                reached.set()
                if not released.wait(120):
                    raise TimeoutError("the test never released the gated writes")

        training.options_from_args = lambda args: dataclasses.replace(original(args), sink_factory=GatedSink)
        return True

    def release_writes(self):
        self.writes_released.set()
        return True

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

        from safe_ckpt.residence import classify as residence

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

    def check_same_as(self, iteration, other_dir):
        """Every tensor of this rank's shards of ``iteration`` in args.save and in ``other_dir``,
        loaded with stock Megatron: the keys that differ (bit for bit)."""
        from megatron.core import dist_checkpointing

        from safe_ckpt_lab.synthetic import bits_equal, build_state

        tp = self.args.tensor_model_parallel_size
        out = []
        for root in (self.args.save, other_dir):
            template = build_state(self.rank, self.world_size, tp=tp, spec=self.spec, empty=True, saved_tp=tp)
            template.pop("rank_info"), template.pop("rng_state")
            out.append(dist_checkpointing.load({"model": template["model"], "optimizer": template["optimizer"]},
                                               os.path.join(root, f"iter_{iteration:07d}")))
        a, b = (list(_leaves(x, keys=True)) for x in out)
        return [ka for (ka, ta), (kb, tb) in zip(a, b) if ka != kb or not bits_equal(ta, tb)] + \
            (["<different structure>"] if len(a) != len(b) else [])

    def check_load(self, iteration):
        """Load iteration with stock Megatron under another sharding; list mismatches.
        Reads only the checkpoint and a freshly seeded CPU reference, so it works asleep too."""
        from megatron.core import dist_checkpointing

        from safe_ckpt_lab.synthetic import build_state
        from tests.helpers.bodies.common import compare_loaded

        tp = self.args.tensor_model_parallel_size
        path = os.path.join(self.args.save, f"iter_{iteration:07d}")
        target = build_state(self.rank, self.world_size, tp=tp, spec=self.spec, layout="alt", empty=True, saved_tp=tp)
        expected = build_state(self.rank, self.world_size, tp=tp, spec=self.spec, layout="alt", saved_tp=tp)
        target.pop("rank_info"), expected.pop("rank_info")  # the synthetic model does not save these
        target.pop("rng_state"), expected.pop("rng_state")
        loaded = dist_checkpointing.load(target, path)
        return compare_loaded(loaded, expected), loaded.get("iteration")


def _fresh(tree):
    """A new sharded state dict over the same tensors, as Megatron's modules and optimizers build
    one per call (stock load changes the ShardedTensors it is given: `.data` reshaped for a
    prepended axis)."""
    import copy

    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject, ShardedObject, ShardedTensor, ShardedTensorFactory,
    )

    if isinstance(tree, dict):
        return {k: _fresh(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_fresh(v) for v in tree]
    if isinstance(tree, (ShardedTensor, ShardedTensorFactory, ShardedObject, LocalNonpersistentObject)):
        return copy.copy(tree)
    return tree


def _copy_leaves(mine, loaded) -> None:
    """Copy every tensor of ``loaded`` into the same place of ``mine`` (same keys, same structure)."""
    import torch

    ours, theirs = list(_leaves(mine, keys=True)), list(_leaves(loaded, keys=True))
    if [k for k, _ in ours] != [k for k, _ in theirs]:
        raise RuntimeError("the loaded state does not have the structure of the one it is loaded into")
    with torch.no_grad():
        for (_, target), (_, value) in zip(ours, theirs):
            target.data.copy_(value)


def _leaves(tree, keys=False, path=""):
    """The tensors (or ShardedTensors/factories) of a state dict in a fixed order; with ``keys``, (path, leaf)."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(tree, dict):
        for k in sorted(tree, key=str):
            yield from _leaves(tree[k], keys, f"{path}/{k}")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, keys, f"{path}/{i}")
    elif isinstance(tree, (ShardedTensor, ShardedTensorFactory, torch.Tensor)):
        yield (path, tree) if keys else tree
