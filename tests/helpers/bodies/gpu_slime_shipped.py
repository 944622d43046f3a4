"""Bodies of the real-slime GPU tests in slime's shipped configuration (tests/gpu/test_real_slime_source.py):
slime's own actor code (SLIME_SRC), a Megatron whose DDP buffers behave as slime's Megatron patch
makes them (scripts/slime_megatron_patch.py: a patched copy of the installed megatron first on
PYTHONPATH), the args as slime's `parse_args` sets them, and torch_memory_saver started as slime's
`RayTrainGroup` starts it for a train actor: `LD_PRELOAD` of its preload hook,
`TMS_INIT_ENABLE=1`, `TMS_INIT_ENABLE_CPU_BACKUP=1` (`preload_env`; the parent sets these before
spawning the ranks, so they hold from the process's first CUDA allocation).

So, as in slime: every allocation is pauseable with a CPU backup, except the DDP's bf16
`param_data` (every parameter a view into it) and `grad_data`, which sit in regions without backup;
the trained weights are kept by slime's TensorBackuper (tag "actor").
"""

from __future__ import annotations

import json
import os
import sys
import time

PRELOAD_NAMES = ("torch_memory_saver_hook_mode_preload_cu13.abi3.so",
                 "torch_memory_saver_hook_mode_preload_cu12.abi3.so",
                 "torch_memory_saver_hook_mode_preload.abi3.so")


def patched_megatron_first() -> str | None:
    """Put the patched Megatron (SLIME_MEGATRON) first on this process's path, before anything
    imports megatron, and return where megatron.core now comes from. A spawned rank starts with its
    parent's `sys.path` (multiprocessing restores it), not PYTHONPATH's order, so setting
    PYTHONPATH in the parent is not enough; a rank that would run the unpatched Megatron stops."""
    dest = os.environ.get("SLIME_MEGATRON")
    if not dest:
        return None
    early = sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron."))
    if early:
        raise RuntimeError(f"megatron was imported before the patched copy {dest} could go first: {early[:5]}")
    sys.path.insert(0, dest)
    import megatron.core

    where = os.path.abspath(megatron.core.__file__)
    if not where.startswith(os.path.abspath(dest) + os.sep):
        raise RuntimeError(f"megatron.core comes from {where}, not from the patched copy {dest}")
    return where


def preload_env() -> dict:
    """The environment slime's `RayTrainGroup._allocate_gpus_for_actor` gives a train actor with
    --offload-train (the hook library found the same way: next to the torch_memory_saver package)."""
    import importlib.util

    spec = importlib.util.find_spec("torch_memory_saver")
    if spec is None or not spec.origin:
        raise RuntimeError("torch_memory_saver is not installed")
    site = os.path.dirname(os.path.dirname(spec.origin))
    for name in PRELOAD_NAMES:
        path = os.path.join(site, name)
        if os.path.exists(path):
            return {"LD_PRELOAD": path, "TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}
    raise RuntimeError(f"no torch_memory_saver preload hook library in {site}")


def slime_offload_colocate(args) -> None:
    """What slime's `parse_args` sets on Megatron's args for `--offload-train --colocate`
    (slime/utils/arguments.py, slime/backends/megatron_utils/arguments.py `_set_default_megatron_args`)."""
    args.colocate = True
    args.offload_train = True
    args.offload_rollout = True
    args.release_train = False
    args.disable_grad_buffers_cpu_backup = True
    args.disable_param_buffers_cpu_backup = True
    _slime_megatron_defaults(args)


def slime_release_train(args) -> None:
    """... and for `--colocate --release-train` (`--offload-train` ignored: the actors are released)."""
    args.colocate = True
    args.release_train = True
    args.offload_train = False
    args.offload_rollout = True
    _slime_megatron_defaults(args)


def _slime_megatron_defaults(args) -> None:
    args.use_distributed_optimizer = True
    if not hasattr(args, "enable_gloo_process_groups"):
        args.enable_gloo_process_groups = True
    args.bf16 = not args.fp16
    args.use_persistent_ckpt_worker = True
    args.ckpt_assume_constant_structure = True
    args.ckpt_fully_parallel_load = True


def setup(save_dir: str, world: int, slime_settings):
    """tests/helpers/bodies/gpu_megatron.py's real GPTModel and DistributedOptimizer, with slime's settings
    applied to Megatron's args before the model is built (the DDP buffers read them there)."""
    import inspect

    import torch

    from tests.helpers.bodies import gpu_megatron as g

    os.environ["RANK"] = str(torch.distributed.get_rank())
    os.environ["WORLD_SIZE"] = str(world)
    sys.argv = ["safe_ckpt_gpu_test", *g.MODEL_ARGS, "--global-batch-size", str(2 * world), "--save", save_dir]
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.utils import get_model_config
    import megatron.training.initialize as megatron_init
    from megatron.training.global_vars import get_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer

    megatron_init._compile_dependencies = lambda *a, **k: None
    if "extra_args_provider" not in inspect.signature(initialize_megatron).parameters:
        from megatron.training.arguments import parse_and_validate_args

        parse_and_validate_args()
    initialize_megatron()
    slime_settings(get_args())
    model, optimizer, scheduler = setup_model_and_optimizer(model_type=ModelType.encoder_or_decoder,
                                                            model_provider_func=g._model_provider)
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    return model, optimizer, scheduler


def backup_probe(tensor) -> str:
    """Whether torch_memory_saver keeps a CPU backup of a paused ``tensor``, asked in a forked child:
    for a paused allocation made without backup its `get_cpu_backup` calls exit(1), which must not
    end this process. "backup", "none" (it returned None) or what ended the child."""
    from torch_memory_saver import torch_memory_saver as tms

    pid = os.fork()
    if pid == 0:  # only torch_memory_saver's host-side bookkeeping is read here: no CUDA call
        try:
            os._exit(3 if tms.get_cpu_backup(tensor, zero_copy=True) is not None else 4)
        except BaseException:
            os._exit(5)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return {3: "backup", 4: "none", 1: "exit 1: paused without backup"}.get(code, f"exit {code}")
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "hung"


def layout(model, optimizer) -> dict:
    """Where the state lives while paused (asked of torch_memory_saver in a forked child and of the
    DDP buffers, nothing read): the parameters in the DDP's param_data, whether the saver keeps a
    backup of them, of the grad buffer and of the fp32 main parameters."""
    from torch_memory_saver import torch_memory_saver as tms

    buffers = [b for m in model for b in getattr(m, "buffers", [])]
    param = next(p for m in model for p in m.parameters())
    mains = [p for opt in getattr(optimizer, "chained_optimizers", [optimizer])
             for group in opt.optimizer.param_groups for p in group["params"]]
    in_param_data = any(b.param_data is not None and b.param_data.data_ptr() <= param.data_ptr()
                        < b.param_data.data_ptr() + b.param_data.numel() * b.param_data.element_size()
                        for b in buffers)
    return {"param_in_param_data": in_param_data,
            "param_backup": backup_probe(param.detach()),
            "grad_backup": backup_probe(buffers[0].grad_data),
            "main_param_backup": backup_probe(mains[0]),
            "hook_mode": getattr(getattr(tms, "_impl", None), "_hook_mode", None),
            "ld_preload": os.environ.get("LD_PRELOAD", ""), "tms_init_enable": os.environ.get("TMS_INIT_ENABLE")}


def unasked_regions(model, args) -> dict:
    """safe_ckpt's classification of a paused grad_data slice (a region kept without backup) inside
    the slime seam: unmapped, named, and torch_memory_saver never asked (this process lives on)."""
    from safe_ckpt.residence import classify as residence
    from safe_ckpt.integrations import slime_sources

    regions = slime_sources.regions_without_backup(model, args)
    grad = next(b.grad_data for m in model for b in getattr(m, "buffers", []))
    with slime_sources.guarded(regions):
        c = residence.classify(grad[:16], allow_cpu_backup=True)
    return {"what": regions.what if regions else None, "residence": c.residence, "detail": c.detail}


def shipped_save(rank, world, root, src) -> dict:
    """slime's sleep, save_model (asleep) and, for comparison, save_model on slime's wake-up path
    with stock Megatron's save_checkpoint, then wake_up, on a real actor in slime's layout."""
    patched_megatron_first()
    import torch

    from tests.helpers.bodies import gpu_megatron as g
    from tests.gpu import test_real_slime_source as t
    from tests.helpers.bodies.gpu_slime_asleep import profile_counts

    slime = t.import_slime(src)  # imports torch_memory_saver as slime's actor does (preload mode)
    out = {"slime_commit": t.slime_commit(src), "stubbed": slime["stubbed"], "megatron": t.megatron_used(),
           "megatron_patch": open(os.path.join(os.environ["SLIME_MEGATRON"], ".slime_megatron_patch")).read().strip()}
    from slime.utils import distributed_utils, reloadable_process_group as rpg
    from datetime import timedelta

    rpg.monkey_patch_torch_dist()  # what slime's actor init does before Megatron builds its groups
    distributed_utils.init_gloo_group()
    rpg.register_default_process_group(timeout=timedelta(minutes=10))
    save_dir = os.path.join(root, "safe")
    model, optimizer, scheduler = setup(save_dir, world, slime_offload_colocate)
    out["losses"] = g._train(model, optimizer, scheduler, 0, g.FIRST)
    torch.cuda.synchronize()
    from megatron.training import get_args
    from megatron.training.checkpointing import save_checkpoint as stock_save_checkpoint
    from torch_memory_saver import torch_memory_saver as tms

    from safe_ckpt.integrations import slime as integration
    from safe_ckpt.integrations.slime_asleep import installed

    args = get_args()
    t.slime_actor_args(args, save_dir)
    actor = t.hand_built_actor(slime["actor"], args, model, optimizer, scheduler)  # weights backed up, as train_actor
    before = t._weights(model)
    integration.install(args)
    saves = installed(slime["actor"].MegatronTrainRayActor)
    out["installed"] = saves is not None
    resumes = []
    resume = tms.resume
    tms.resume = lambda *a, **k: (resumes.append(1), resume(*a, **k))[1]

    actor.sleep()  # slime's: clear memory, destroy the groups, pause every region
    out["layout"] = layout(model, optimizer)
    out["unasked"] = unasked_regions(model, args)
    free_asleep = torch.cuda.mem_get_info()[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.monotonic()
        actor.save_model(g.FIRST)  # as slime's loop calls it between rollouts
        out["save_model_returned_s"] = time.monotonic() - start
        inflight = saves.inflight if saves else None
        result = inflight.wait(timeout=300) if inflight is not None else None
        torch.cuda.synchronize()
        out["durable_s"] = time.monotonic() - start
    out["save_profile"] = profile_counts(prof)
    out["bytes_by_residence"] = dict(result.bytes_by_residence) if result is not None else None
    out["hold_s"] = saves.last_hold_s if saves else None
    out["freed_bytes_kept"] = torch.cuda.mem_get_info()[0] >= free_asleep - (64 << 20)
    out["resumed_during_save"] = len(resumes)
    out["tracker"] = open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")).read().strip()

    # slime's wake-up path with stock Megatron (--ckpt-backend megatron), same step, another directory
    model_module = slime["model"]
    routed = model_module.save_checkpoint
    model_module.save_checkpoint = stock_save_checkpoint
    args.safe_ckpt_save_awake, args.save = True, os.path.join(root, "stock")
    try:
        actor.save_model(g.FIRST)
    finally:
        model_module.save_checkpoint = routed
        args.safe_ckpt_save_awake, args.save = False, save_dir
    out["resumed_by_wake_up_path"] = len(resumes)
    torch.distributed.barrier()
    if rank == 0:
        from tests.helpers.megatron_evidence import compare_contents

        out["compare"] = compare_contents(os.path.join(root, "safe", "iter_%07d" % g.FIRST),
                                          os.path.join(root, "stock", "iter_%07d" % g.FIRST))
    actor.wake_up()
    torch.cuda.synchronize()
    after = t._weights(model)
    out["weights_equal_after_wake"] = before.keys() == after.keys() and all(torch.equal(before[k], after[k])
                                                                            for k in before)
    return out


def release_cycle(rank, world, root, src, load_dir, steps) -> dict:
    """One `--release-train` step of slime's on a real actor: a new process runs the init hook
    (`install`, as `--custom-megatron-init-path` does before the actor's load), loads ``load_dir``
    through slime's own `load_checkpoint` as `initialize_model_and_optimizer` calls it (routed to
    safe_ckpt by the hook), trains ``steps`` iterations, calls slime's `save_model(force_sync=True)`
    (with --async-save: the forced finalize must make it durable) and is then killed (SIGKILL, as
    `ray.kill`): the caller reads the result file written just before."""
    patched_megatron_first()
    import signal

    import torch

    from tests.helpers.bodies import gpu_megatron as g
    from tests.gpu import test_real_slime_source as t

    slime = t.import_slime(src)
    save_dir = os.path.join(root, "release")
    model, optimizer, scheduler = setup(save_dir, world, slime_release_train)
    from megatron.training import get_args
    from slime.backends.megatron_utils import checkpoint as slime_checkpoint

    from safe_ckpt.integrations import slime as integration
    from safe_ckpt.integrations.slime_asleep import installed
    from safe_ckpt.megatron.loading import loaded_checkpoint

    args = get_args()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):  # as gpu_megatron_cases' resume
        init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
        if init is not None:
            init()
    t.slime_actor_args(args, save_dir)
    args.offload_train, args.release_train, args.async_save = False, True, True
    args.load = load_dir
    integration.install(args)  # the init hook, before the load
    routed = getattr(slime_checkpoint._load_checkpoint_megatron, "_safe_ckpt_stock", None) is not None
    args.iteration, args.num_floating_point_operations_so_far = slime_checkpoint.load_checkpoint(
        model, optimizer, scheduler, checkpointing_context={}, skip_load_to_model_and_opt=False)
    loaded = loaded_checkpoint()
    from tests.helpers.megatron_evidence import restore_adam_steps

    restore_adam_steps(optimizer)
    start = args.iteration
    losses = g._train(model, optimizer, scheduler, start, start + steps)
    actor = t.hand_built_actor(slime["actor"], args, model, optimizer, scheduler)
    began = time.monotonic()
    actor.save_model(start + steps, force_sync=True)
    out = {"start": start, "losses": losses, "asleep_path_installed": installed(
        slime["actor"].MegatronTrainRayActor) is not None, "save_model_s": time.monotonic() - began,
        "load_routed": routed, "loaded_by_safe_ckpt": None if loaded is None else [loaded.save_root, loaded.iteration],
        "tracker": open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")).read().strip()}
    with open(os.path.join(root, f"release_rank{rank}.json"), "w") as f:
        json.dump(out, f)
        f.flush()
        os.fsync(f.fileno())
    torch.cuda.synchronize()
    os.kill(os.getpid(), signal.SIGKILL)  # ray.kill: no atexit, no finalizers


def resume(rank, world, root, load_dir, stop) -> dict:
    """A fresh process: stock `load_checkpoint` of ``load_dir``, then train up to iteration ``stop``."""
    from tests.helpers.bodies import gpu_megatron as g

    model, optimizer, scheduler = g._setup(os.path.join(root, "unused"), "gpu", world)
    from megatron.training import get_args
    from megatron.training.checkpointing import load_checkpoint

    from tests.helpers.megatron_evidence import restore_adam_steps

    args = get_args()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
        if init is not None:
            init()
    args.load = load_dir
    args.iteration, args.num_floating_point_operations_so_far = load_checkpoint(model, optimizer, scheduler)
    restore_adam_steps(optimizer)
    return {"start_iteration": args.iteration, "losses": g._train(model, optimizer, scheduler, args.iteration, stop)}
