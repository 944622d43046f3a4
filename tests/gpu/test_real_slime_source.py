"""Opt-in: slime's own source, not the mirror. With `SLIME_SRC=/path/to/slime` (a checkout, or
a plain export made by scripts/export_slime.sh; neither is committed here) this imports slime's
`slime.backends.megatron_utils.actor` and `model` modules and runs slime's real
`MegatronTrainRayActor.sleep`, `save_model` and `wake_up` with `--ckpt-backend safe` on a real
small GPTModel (DistributedOptimizer) whose state sleeps in torch_memory_saver with a CPU backup.
`save_model` is called as slime's loop calls it between rollouts (no `force_sync`): it must return
without waking the actor (no `resume()`), the writes finish while it still sleeps (no host-to-device
copy, kernel or NCCL call under the profiler), and `wake_up()` then resumes once and restores the
same weights. A fresh process resumes from the checkpoint with stock `load_checkpoint` and must
train on exactly like an uninterrupted run. Each run prints one line, "real slime save_model
evidence:", a JSON object with the slime commit, the Megatron used, the stubs, save_model's hold,
the time until durable, the profile counts and the losses.

Which Megatron: slime pins Megatron-LM 1dcf0dafa884 plus its docker/patch/latest/megatron.patch;
this test runs slime's code against whatever `megatron.core`/`megatron.training` is importable,
on the GPU machine megatron-core 0.19.2's wheel (which ships `megatron.training`), not slime's
pin. The test prints and returns the slime commit (from a checkout's git, or the export's
COMMIT file), the megatron-core version and where `megatron.training` came from.

The actor is made without slime's `init` (which needs a rollout manager, an HF checkpoint and
Ray): its model, optimizer and scheduler come from tests/helpers/bodies/gpu_megatron.py, and it gets what
`init` leaves behind for these paths: `args`, `role`, slime's own `TensorBackuper` holding the
trained weights (as `train_actor` leaves it) and `_active_model_tag`. Two variants:
- `slime_group_cycle`: before Megatron builds its groups, the test does what slime's actor `init`
  does first (`monkey_patch_torch_dist`, `init_gloo_group`, `register_default_process_group`),
  so slime's `sleep()` really destroys NCCL WORLD and every model-parallel group and starts a
  temporary gloo WORLD, and `wake_up()` rebuilds them: the asleep save runs with the groups gone.
- `torch_groups`: without those steps, `sleep()`'s `destroy_process_groups()` finds nothing
  registered and the groups stay up (the asleep path alone, if slime's group cycle and this
  Megatron disagree).

Stubs, each only where the package is not installed (as slime's own CPU tests stub them, but wandb):
`transformers` (tests/plugin_contracts/_shared.py; installed on the GPU machine), the module
`slime.backends.megatron_utils.sglang` (slime's tests/test_empty_colocated_weight_bucket.py), whose
unguarded `from sglang.srt.utils import ...` needs the whole sglang; `wandb` (imported at module
level by slime.observability, called only with `--use-wandb`) has no stub in slime's tests: its
wheel (wandb 0.31: 19 MiB, plus pydantic, opentelemetry and five more not on the GPU machine) would
not fit beside the wheels brought to that machine, so it is a module with `run = None`.

Checked on CPU (Python 3.12, torch 2.13, megatron-core 0.19.2 with its megatron.training, ray
2.60, the real torch_memory_saver 0.0.10 wheel, slime 624b824a exported; scripts/slime_real_dryrun.py
repeats it): the whole import chain of the actor and model modules with these stubs (every other
third-party module it imports is on the GPU machine or brought there as a wheel); that the hand-built actor holds
every attribute and arg that `save_model`, `sleep`, `wake_up`, `_switch_model` and `model.save`
read; that `install()` hooks slime's real class (its `sleep`/`wake_up` are slime's `@timer`
wrappers, and the bracket is recognised from slime's own `save_model` frame) and rebinds
`model.save_checkpoint`; slime's `monkey_patch_torch_dist`/`register_default_process_group` wrap
megatron-core 0.19.2's model-parallel groups (23, over gloo); and slime's real `sleep()` (WORLD and
every group destroyed, a new gloo WORLD on the job's file store: the gloo WORLD made to count as an
accelerator's), `save_model(force_sync=True)` (asleep path, no resume, tracker written, stock
`load_common_state_dict` reads it) and `wake_up()` (one resume, groups rebuilt, weights restored
by slime's TensorBackuper) on a tiny CPU GPTModel without optimizer, with pause/resume,
`clear_memory`/`print_memory`, pinned memory and the CUDA RNG state replaced.
Only the GPU can check: training with megatron-core 0.19.2's DDP and DistributedOptimizer while
its groups are slime's wrappers (the coalesced reduce-scatter/all-gather that Megatron binds at
import go through the wrappers' methods; on CPU that stopped at slime's accelerator lookup), the
teardown and rebuild of an NCCL WORLD and NCCL groups, torch_memory_saver's pause/resume and CPU backup, the
save reading the backup while asleep under the profiler, and the bit-exact resume.

Run (GPU machine): SLIME_SRC=$PWD/.slime python3 -m pytest -q -m gpu tests/gpu/test_real_slime_source.py -rA -s
"""

from __future__ import annotations

import argparse
import json
import importlib.metadata
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import time
import types
from datetime import timedelta

import pytest

from tests.helpers.mp import run_world, values
from tests.helpers.paths import REPO

SLIME_SRC = os.environ.get("SLIME_SRC")


def _missing() -> str | None:
    if not SLIME_SRC:
        return "opt-in: set SLIME_SRC=/path/to/slime (a checkout or scripts/export_slime.sh's export)"
    if not os.path.isfile(os.path.join(SLIME_SRC, "slime", "backends", "megatron_utils", "actor.py")):
        return f"SLIME_SRC={SLIME_SRC} holds no slime/backends/megatron_utils/actor.py"
    try:
        import torch

        if not torch.cuda.is_available():
            return "slime's actor needs CUDA (torch_memory_saver, NCCL): run on the GPU machine"
        if importlib.util.find_spec("torch_memory_saver") is None:
            return "slime's actor.py imports torch_memory_saver: not installed"
        if importlib.util.find_spec("megatron.training.training") is None:
            return "slime's model.py imports megatron.training.training: not on the path"
    except ModuleNotFoundError as exc:
        return f"missing: {exc}"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_missing() is not None, reason=_missing() or "")]


def slime_commit(src: str) -> str:
    """The export's COMMIT file (scripts/export_slime.sh), else the checkout's HEAD."""
    marker = os.path.join(src, "COMMIT")
    if os.path.isfile(marker):
        return open(marker).read().strip() + " (export)"
    try:
        return subprocess.run(["git", "-C", src, "log", "-1", "--format=%H %cI"], capture_output=True, text=True,
                              timeout=30).stdout.strip() or "unknown (no COMMIT file, not a git checkout)"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def megatron_used() -> dict:
    """Which megatron.core / megatron.training the slime code ran against, and from where."""
    import megatron.core
    import megatron.training

    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        version = getattr(getattr(megatron.core, "package_info", None), "__version__", "unknown")
    training_file = os.path.abspath(megatron.training.__file__)
    try:  # does the megatron-core distribution itself list the megatron.training that was imported?
        dist = importlib.metadata.distribution("megatron-core")
        from_wheel = any(str(f).replace(os.sep, "/") == "megatron/training/__init__.py"
                         and os.path.abspath(dist.locate_file(f)) == training_file for f in dist.files or ())
    except importlib.metadata.PackageNotFoundError:
        from_wheel = False
    return {"megatron_core_version": version, "megatron_core": os.path.dirname(os.path.abspath(megatron.core.__file__)),
            "megatron_training": os.path.dirname(training_file), "training_from_megatron_core_wheel": from_wheel}


def _stub_like_slimes_tests() -> list[str]:
    """Stand-ins in sys.modules, as slime's own CPU tests make them, for packages the imported
    modules name at import time but these paths never call; only where not installed."""
    stubbed = []
    if importlib.util.find_spec("transformers") is None:  # tests/plugin_contracts/_shared.py
        tf = types.ModuleType("transformers")
        for name in ("AutoConfig", "AutoTokenizer", "AutoProcessor"):
            setattr(tf, name, type(name, (), {"from_pretrained": staticmethod(lambda *a, **k: object())}))
        tf.PreTrainedTokenizerBase = type("PreTrainedTokenizerBase", (), {})
        tf.ProcessorMixin = type("ProcessorMixin", (), {})
        sys.modules["transformers"] = tf
        stubbed.append("transformers")
    if importlib.util.find_spec("sglang") is None:  # slime's tests/test_empty_colocated_weight_bucket.py
        mod = types.ModuleType("slime.backends.megatron_utils.sglang")

        def _needs_sglang(*a, **k):
            raise RuntimeError("sglang is not installed (stubbed by the real-slime save test)")

        mod.FlattenedTensorBucket = type("FlattenedTensorBucket", (), {"__init__": _needs_sglang})
        mod.MultiprocessingSerializer = type("MultiprocessingSerializer", (),
                                             {"serialize": staticmethod(_needs_sglang)})
        mod.monkey_patch_torch_reductions = _needs_sglang
        mod.quant_weight_ue8m0 = mod.transform_scale_ue8m0 = mod.should_deepgemm_weight_requant_ue8m0 = None
        sys.modules[mod.__name__] = mod
        stubbed.append(mod.__name__)
    if importlib.util.find_spec("wandb") is None:  # no stub in slime's tests: used only with --use-wandb
        wb = types.ModuleType("wandb")
        wb.run = None
        sys.modules["wandb"] = wb
        stubbed.append("wandb")
    for name in stubbed:
        # importlib.util.find_spec (accelerate and transformers probe optional packages with it)
        # raises on a module without a spec; with one and no installed distribution, they count
        # the package as absent, as they would without the stub
        sys.modules[name].__spec__ = importlib.machinery.ModuleSpec(name, None)
    return stubbed


def import_slime(src: str) -> dict:
    """slime's actor and model modules from ``src`` (first on the path), with the stubs."""
    sys.path.insert(0, src)
    stubbed = _stub_like_slimes_tests()
    import slime.backends.megatron_utils.actor as actor
    import slime.backends.megatron_utils.model as model

    where = os.path.abspath(actor.__file__)
    if not where.startswith(os.path.abspath(src) + os.sep):
        raise RuntimeError(f"slime was imported from {where}, not from SLIME_SRC={src}")
    return {"actor": actor, "model": model, "stubbed": stubbed}


def slime_actor_args(args, save_dir: str) -> None:
    """What slime's parser (slime/utils/arguments.py) adds and these paths read, and safe_ckpt's
    options at their defaults (as `add_arguments` registers them), on Megatron's parsed args."""
    from safe_ckpt.integrations import slime as integration

    for name, value in vars(integration.add_arguments(argparse.ArgumentParser()).parse_args([])).items():
        setattr(args, name, value)
    for name, value in dict(offload_train=True, save_hf=None, debug_rollout_only=False, use_critic=False,
                            colocate=True, ckpt_backend="safe", safe_ckpt_io_threads=2,
                            safe_ckpt_timeout_s=120.0).items():
        setattr(args, name, value)
    for name in ("async_save", "use_distributed_optimizer", "overlap_param_gather", "num_experts",
                 "distributed_timeout_minutes"):  # Megatron's, read by slime here
        if not hasattr(args, name):
            raise RuntimeError(f"Megatron's args lack {name!r}, which slime's actor reads")
    args.save = save_dir


def hand_built_actor(actor_module, args, model, optimizer, scheduler):
    """A `MegatronTrainRayActor` holding what its `init` (and `train_actor`) leave for
    `sleep`/`save_model`/`wake_up`: the weights backed up by slime's own TensorBackuper."""
    from slime.backends.megatron_utils.update_weight.common import named_params_and_buffers
    from slime.utils.tensor_backper import TensorBackuper

    cls = actor_module.MegatronTrainRayActor
    actor = cls.__new__(cls)
    actor.args, actor.role, actor.with_ref, actor.with_opd_teacher = args, "actor", False, False
    actor.model, actor.optimizer, actor.opt_param_scheduler = model, optimizer, scheduler
    actor.weights_backuper = TensorBackuper.create(
        source_getter=lambda: named_params_and_buffers(args, model, convert_to_global_name=True), single_tag=None)
    actor._active_model_tag = "actor"
    actor.weights_backuper.backup("actor")  # as init does, and train_actor after each step
    actor.weight_updater = None  # sleep() reads it only with use_critic and not colocate
    return actor


def _weights(model) -> dict:
    import torch

    return {name: p.detach().to("cpu", copy=True) for m in model for name, p in m.named_parameters()
            if isinstance(p, torch.Tensor)}


def real_save_model(rank, world, root, src, cycle) -> dict:
    """slime's sleep, save_model (which takes the asleep path) and wake_up on a real actor."""
    import torch

    from tests.helpers.bodies import gpu_megatron as g
    from tests.helpers.bodies.gpu_slime_asleep import _memory_saver, profile_counts

    # before the first memory-saver region: megatron.core's inference code, imported with slime's
    # actor, sets torch_memory_saver's hook mode, which fails once a region has been used
    slime = import_slime(src)
    slime_actor = slime["actor"]
    out = {"slime_commit": slime_commit(src), "stubbed": slime["stubbed"], "megatron": megatron_used(),
           "cycle": cycle}
    if cycle:  # what slime's TrainRayActor.init / MegatronTrainRayActor.init do before Megatron's groups
        from slime.utils import distributed_utils, reloadable_process_group as rpg

        rpg.monkey_patch_torch_dist()
        distributed_utils.init_gloo_group()
        rpg.register_default_process_group(timeout=timedelta(minutes=10))

    tms = _memory_saver()
    save_dir = os.path.join(root, "safe")
    with tms.region(tag="train", enable_cpu_backup=True):
        model, optimizer, scheduler = g._setup(save_dir, "gpu", world)
        out["losses"] = g._train(model, optimizer, scheduler, 0, g.FIRST)
    torch.cuda.synchronize()
    from megatron.training import get_args

    from safe_ckpt.integrations import slime as integration
    from safe_ckpt.integrations.slime_asleep import installed

    args = get_args()
    slime_actor_args(args, save_dir)
    actor = hand_built_actor(slime_actor, args, model, optimizer, scheduler)
    before = _weights(model)
    integration.install(args)  # what --custom-megatron-init-path runs at the end of slime's init
    saves = installed(slime_actor.MegatronTrainRayActor)
    out["installed"] = saves is not None
    out["save_checkpoint_rebound"] = getattr(slime["model"].save_checkpoint, "_safe_ckpt_asleep", None) is saves
    wake_calls = []
    resume = tms.resume
    tms.resume = lambda *a, **k: (wake_calls.append(1), resume(*a, **k))[1]

    actor.sleep()  # slime's own sleep: clear memory, destroy the groups, pause
    if cycle:
        from slime.utils.reloadable_process_group import default_process_group_states

        out["world_backend_asleep"] = str(torch.distributed.get_backend())
        out["world_destroyed_asleep"] = default_process_group_states[os.getpid()].accelerator_world_destroyed
    free_asleep = torch.cuda.mem_get_info()[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.monotonic()
        actor.save_model(g.FIRST)  # slime's own save_model, as its loop calls it between rollouts
        out["save_model_returned_s"] = time.monotonic() - start
        handle = saves.inflight if saves else None
        if handle is not None:  # the writes go on while asleep: wait for them here, without waking
            handle.wait(timeout=300)
        torch.cuda.synchronize()
        out["durable_s"] = time.monotonic() - start
    out["save_profile"] = profile_counts(prof)
    out["hold_s"] = saves.last_hold_s if saves else None  # save_model's own time (the loop held)
    out["freed_bytes_kept"] = torch.cuda.mem_get_info()[0] >= free_asleep - (64 << 20)  # nothing woke
    out["resumed_during_save"] = len(wake_calls)
    out["tracker"] = open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")).read().strip()

    actor.wake_up()  # slime's own wake_up: resume, reload the groups, restore the actor's weights
    torch.cuda.synchronize()
    out["resumed_after"] = len(wake_calls)
    if cycle:
        out["world_backend_awake"] = str(torch.distributed.get_backend())
    after = _weights(model)
    out["weights_equal_after_wake"] = before.keys() == after.keys() and all(
        torch.equal(before[k], after[k]) for k in before)
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    from tests.helpers.bodies import gpu_megatron as g

    root = str(tmp_path_factory.mktemp("full"))
    (full,) = values(run_world(1, g.run, (root, "gpu", "full"), backend="nccl", timeout_s=400))
    return full


@pytest.mark.parametrize("cycle", [False, True], ids=["torch_groups", "slime_group_cycle"])
def test_real_slime_save_model_saves_asleep_and_stock_megatron_resumes(tmp_path, uninterrupted, cycle):
    from tests.helpers.bodies import gpu_megatron as g

    root = str(tmp_path)
    (out,) = values(run_world(1, real_save_model, (root, SLIME_SRC, cycle), backend="nccl", timeout_s=300))
    (resumed,) = values(run_world(1, g.run, (root, "gpu", "resume"), backend="nccl", timeout_s=400))
    evidence = {k: out.get(k) for k in ("cycle", "slime_commit", "megatron", "stubbed", "hold_s",
                                        "save_model_returned_s", "durable_s", "installed",
                                        "save_checkpoint_rebound", "resumed_during_save", "resumed_after",
                                        "save_profile", "freed_bytes_kept", "tracker", "world_backend_asleep",
                                        "world_destroyed_asleep", "world_backend_awake", "weights_equal_after_wake")}
    evidence["resumed_start_iteration"] = resumed["start_iteration"]
    evidence["losses_resumed"], evidence["losses_uninterrupted"] = resumed["losses"], uninterrupted["losses"][g.FIRST:]
    print("real slime save_model evidence:", json.dumps(evidence, default=str, sort_keys=True))
    assert out["installed"] and out["save_checkpoint_rebound"] and out["tracker"] == str(g.FIRST), evidence
    assert out["resumed_during_save"] == 0 and out["resumed_after"] == 1, evidence  # saved asleep, woken after
    prof = out["save_profile"]  # slime's whole save_model, asleep: no device work, no NCCL
    assert prof["HtoD"] == 0 and prof["kernels"] == 0 and prof["nccl"] == 0, evidence
    assert out["losses"] == uninterrupted["losses"][:g.FIRST], evidence  # slime's import changed no training
    if cycle:
        assert out["world_destroyed_asleep"] and out["world_backend_asleep"] == "gloo", evidence
        assert out["world_backend_awake"] == "nccl", evidence
    assert out["weights_equal_after_wake"], evidence
    assert out["freed_bytes_kept"], evidence  # the memory sleep freed stayed free through the save
    assert resumed["start_iteration"] == g.FIRST, evidence
    assert resumed["losses"] == uninterrupted["losses"][g.FIRST:], evidence


# ---- slime as it ships: its Megatron patch's DDP buffers, its args, torch_memory_saver preloaded ----

def _shipped_missing() -> str | None:
    from tests.helpers.bodies import gpu_slime_shipped as s

    try:
        s.preload_env()
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def slime_megatron(tmp_path_factory):
    """A copy of the installed Megatron with slime's DDP-buffer hunks (scripts/slime_megatron_patch.py;
    slime's own megatron.patch is used where SLIME_MEGATRON_PATCH names it and it applies)."""
    import importlib.util as iu

    dest = str(tmp_path_factory.mktemp("slime_megatron"))
    spec = iu.spec_from_file_location("slime_megatron_patch", os.path.join(
        REPO, "scripts", "slime_megatron_patch.py"))
    module = iu.module_from_spec(spec)
    spec.loader.exec_module(module)
    how = module.make(dest, os.environ.get("SLIME_MEGATRON_PATCH"))
    print(f"slime megatron patch: {how} ({dest})")
    return dest


@pytest.fixture()
def shipped_env(slime_megatron, monkeypatch):
    """What the spawned ranks inherit: slime's preload environment, the patched Megatron first."""
    from tests.helpers.bodies import gpu_slime_shipped as s

    reason = _shipped_missing()
    if reason:
        pytest.skip(reason)
    for name, value in s.preload_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SLIME_MEGATRON", slime_megatron)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([slime_megatron, os.environ.get("PYTHONPATH", "")]))
    return slime_megatron


def test_real_slime_in_its_shipped_configuration_saves_asleep_equal_to_its_wake_up_path(
        tmp_path, uninterrupted, shipped_env, monkeypatch):
    from tests.helpers.bodies import gpu_megatron as g
    from tests.helpers.bodies import gpu_slime_shipped as s

    root = str(tmp_path)
    (out,) = values(run_world(1, s.shipped_save, (root, SLIME_SRC), backend="nccl", timeout_s=400))
    for name in ("LD_PRELOAD", "TMS_INIT_ENABLE", "TMS_INIT_ENABLE_CPU_BACKUP", "PYTHONPATH"):
        monkeypatch.delenv(name, raising=False)  # the resuming process: stock Megatron, no saver
    (resumed,) = values(run_world(1, s.resume, (root, os.path.join(root, "safe"), g.FIRST + g.SECOND),
                                  backend="nccl", timeout_s=400))
    evidence = {k: out.get(k) for k in ("slime_commit", "megatron", "megatron_patch", "stubbed", "layout", "unasked", "hold_s",
                                        "save_model_returned_s", "durable_s", "bytes_by_residence",
                                        "resumed_during_save", "resumed_by_wake_up_path", "save_profile",
                                        "freed_bytes_kept", "tracker", "weights_equal_after_wake")}
    evidence["compare"] = {k: v for k, v in (out.get("compare") or {}).items() if k != "details"}
    evidence["resumed_start_iteration"] = resumed["start_iteration"]
    evidence["losses_resumed"], evidence["losses_uninterrupted"] = resumed["losses"], uninterrupted["losses"][g.FIRST:]
    print("real slime shipped-configuration evidence:", json.dumps(evidence, default=str, sort_keys=True))
    lay = out["layout"]  # slime's layout, as torch_memory_saver sees it
    assert lay["param_in_param_data"] and lay["param_backup"].startswith("exit 1"), evidence
    assert lay["grad_backup"].startswith("exit 1") and lay["main_param_backup"] == "backup", evidence
    assert lay["hook_mode"] == "preload", evidence
    unasked = out["unasked"]  # a region without backup is classified without asking the saver
    assert unasked["residence"] == "cuda_unmapped" and "kept without CPU backup" in unasked["detail"], evidence
    assert out["installed"] and out["tracker"] == str(g.FIRST), evidence
    assert out["resumed_during_save"] == 0, evidence  # save_model returned without waking
    prof = out["save_profile"]
    assert prof["HtoD"] == 0 and prof["kernels"] == 0 and prof["nccl"] == 0, evidence
    residences = out["bytes_by_residence"] or {}
    assert residences.get("host_copy", 0) > 0 and residences.get("offload_backup", 0) > 0, evidence
    assert not {"cuda", "cuda_unmapped"} & set(residences), evidence  # nothing read from device memory
    assert out["freed_bytes_kept"] and out["weights_equal_after_wake"], evidence
    assert out["resumed_by_wake_up_path"] == 1, evidence  # the stock save did wake up
    # tensor for tensor what stock Megatron writes on slime's wake-up path; the common state's args
    # differ only where the test pointed the stock save elsewhere and turned the asleep path off
    content = out["compare"]
    differ = [f for f in content["differ"] or ["<unreadable>"] if not (
        f.startswith("common_state") and content["common_differ"] == ["args"]
        and set(content["common_args_differ"]) <= {"save", "safe_ckpt_save_awake"})]
    assert differ == [] and content["tensors"] > 0 and content["only_ours"] == content["only_stock"] == [], evidence
    assert out["losses"] == uninterrupted["losses"][:g.FIRST], evidence
    assert resumed["start_iteration"] == g.FIRST, evidence
    assert resumed["losses"] == uninterrupted["losses"][g.FIRST:], evidence


def test_real_slime_release_train_cycle_saves_durably_before_the_kill(tmp_path, uninterrupted, shipped_env,
                                                                     monkeypatch):
    """A checkpoint at FIRST loaded by slime's own `load_checkpoint` with the init hook installed
    (through safe_ckpt), one `--release-train` step of 3 iterations through slime's own save_model,
    a SIGKILL, and a fresh stock load training on: losses as uninterrupted."""
    from tests.helpers.bodies import gpu_megatron as g
    from tests.helpers.bodies import gpu_slime_shipped as s

    for name in ("LD_PRELOAD", "TMS_INIT_ENABLE", "TMS_INIT_ENABLE_CPU_BACKUP"):
        monkeypatch.delenv(name, raising=False)  # --release-train: slime starts no saver in the train actor
    root = str(tmp_path)
    (saved,) = values(run_world(1, g.run, (root, "gpu", "save"), backend="nccl", timeout_s=400))  # iteration FIRST
    steps = 3
    run_world(1, s.release_cycle, (root, SLIME_SRC, os.path.join(root, "safe"), steps), backend="nccl",
              timeout_s=400)  # ends in its own SIGKILL
    with open(os.path.join(root, "release_rank0.json")) as f:
        cycle = json.load(f)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    (resumed,) = values(run_world(1, s.resume, (root, os.path.join(root, "release"), g.FIRST + g.SECOND),
                                  backend="nccl", timeout_s=400))
    evidence = {"cycle": cycle, "resumed_start": resumed["start_iteration"],
                "losses": cycle["losses"] + resumed["losses"], "uninterrupted": uninterrupted["losses"][g.FIRST:]}
    print("real slime release-train evidence:", json.dumps(evidence, default=str, sort_keys=True))
    assert cycle["start"] == g.FIRST and cycle["tracker"] == str(g.FIRST + steps), evidence
    assert not cycle["asleep_path_installed"], evidence  # --release-train saves awake
    assert cycle["load_routed"], evidence  # slime's _load_checkpoint_megatron now safe_ckpt's
    assert cycle["loaded_by_safe_ckpt"] == [os.path.abspath(os.path.join(root, "safe")), g.FIRST], evidence
    assert resumed["start_iteration"] == g.FIRST + steps, evidence
    assert cycle["losses"] + resumed["losses"] == uninterrupted["losses"][g.FIRST:], evidence
