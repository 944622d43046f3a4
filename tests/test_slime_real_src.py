"""Opt-in: slime's own source, not the mirror. With `SLIME_SRC=/path/to/slime` (a checkout fetched
for the run, never committed here) this imports slime's `slime.backends.megatron_utils.actor`
and `model` modules and runs slime's real `MegatronTrainRayActor.save_model` with
`--ckpt-backend safe` on a real small GPTModel whose state sleeps in torch_memory_saver.

Stubs: only what slime's own CPU tests stub in `sys.modules` (`transformers`, `sglang_router`)
where it is not installed. The actor object is made without slime's `init` (which needs a
rollout manager, an HF checkpoint and Ray): its model, optimizer and scheduler come from
tests/gpu_megatron_cases.py, and `weights_backuper` (which `wake_up` asks for the actor's
weights tag) is a stand-in that knows the one tag.

It needs the GPU machine: slime's `model.py` imports Megatron-LM's `megatron.training.training`
(not in the megatron-core wheel, so the CPU stand-in cannot serve it) and `actor.py` imports
`torch_memory_saver` at module level. Tried on CPU against slime 624b824a (2026-08-21): the
import stops at `megatron.training.training`.
Run: SLIME_SRC=/path/to/slime pytest tests/test_slime_real_src.py (slime pins Megatron-LM
1dcf0dafa884 plus its docker/patch/latest/megatron.patch; the test logs the slime commit it ran).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types

import pytest

from tests.mp import run_world, values

SLIME_SRC = os.environ.get("SLIME_SRC")


def _missing() -> str | None:
    if not SLIME_SRC:
        return "opt-in: set SLIME_SRC=/path/to/a/slime/checkout to run slime's own save_model"
    if not os.path.isfile(os.path.join(SLIME_SRC, "slime", "backends", "megatron_utils", "actor.py")):
        return f"SLIME_SRC={SLIME_SRC} holds no slime/backends/megatron_utils/actor.py"
    try:
        import torch

        if not torch.cuda.is_available():
            return "slime's actor needs CUDA (torch_memory_saver, NCCL): run on the GPU machine"
        if importlib.util.find_spec("torch_memory_saver") is None:
            return "slime's actor.py imports torch_memory_saver: not installed"
        if importlib.util.find_spec("megatron.training.training") is None:
            return "slime's model.py imports Megatron-LM's megatron.training.training: not on the path"
    except ModuleNotFoundError as exc:
        return f"missing: {exc}"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_missing() is not None, reason=_missing() or "")]


def slime_commit(src: str) -> str:
    try:
        return subprocess.run(["git", "-C", src, "log", "-1", "--format=%H %cI"], capture_output=True, text=True,
                              timeout=30).stdout.strip() or "unknown (not a git checkout)"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _stub_like_slimes_tests() -> list[str]:
    """As slime's CPU tests do (tests/test_fully_async_rollout.py, tests/plugin_contracts): stand-ins
    in sys.modules for packages the imported modules name but this path never calls."""
    stubbed = []
    if importlib.util.find_spec("transformers") is None:
        tf = types.ModuleType("transformers")
        tf.AutoConfig = tf.AutoTokenizer = type("Auto", (), {"from_pretrained": staticmethod(lambda *a, **k: None)})
        sys.modules["transformers"] = tf
        stubbed.append("transformers")
    if importlib.util.find_spec("sglang_router") is None:
        sys.modules["sglang_router"] = types.ModuleType("sglang_router")
        stubbed.append("sglang_router")
    return stubbed


class _WeightsTags:
    backup_tags = ("actor",)

    def restore(self, tag):
        pass


def real_save_model(rank, world, root, src) -> dict:
    """slime's save_model on an asleep actor: the asleep path runs inside it; then stock resume."""
    import torch

    sys.path.insert(0, src)
    stubbed = _stub_like_slimes_tests()
    from tests import gpu_megatron_cases as g
    from tests.gpu_slime_asleep_cases import _memory_saver

    tms = _memory_saver()
    save_dir = os.path.join(root, "safe")
    with tms.region(tag="train", enable_cpu_backup=True):
        model, optimizer, scheduler = g._setup(save_dir, "gpu", world)
        losses = g._train(model, optimizer, scheduler, 0, g.FIRST)
    from megatron.training import get_args

    import slime.backends.megatron_utils.actor as slime_actor
    from safe_ckpt.integrations import slime as integration
    from safe_ckpt.integrations.slime_asleep import installed

    args = get_args()
    for name, value in dict(offload_train=True, async_save=False, save_hf=None, debug_rollout_only=False,
                            use_critic=False, colocate=True, ckpt_backend="safe", safe_ckpt_io_threads=2,
                            safe_ckpt_timeout_s=120.0).items():
        setattr(args, name, value)
    actor = slime_actor.MegatronTrainRayActor.__new__(slime_actor.MegatronTrainRayActor)
    actor.args, actor.role = args, "actor"
    actor.model, actor.optimizer, actor.opt_param_scheduler = model, optimizer, scheduler
    actor.weights_backuper, actor._active_model_tag = _WeightsTags(), "actor"
    integration.install(args)  # what --custom-megatron-init-path runs at the end of slime's init
    saves = installed(slime_actor.MegatronTrainRayActor)
    wake_calls = []
    resume = tms.resume
    tms.resume = lambda *a, **k: (wake_calls.append(1), resume(*a, **k))[1]
    actor.sleep()  # slime's own sleep: clear memory, destroy the groups, pause
    actor.save_model(g.FIRST, force_sync=True)  # slime's own save_model
    out = {"slime_commit": slime_commit(src), "stubbed": stubbed, "losses": losses,
           "resumed_during_save": len(wake_calls), "hold_s": saves.last_hold_s if saves else None,
           "installed": saves is not None,
           "tracker": open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")).read().strip()}
    actor.wake_up()  # slime's own wake_up: resume, reload the groups
    out["resumed_after"] = len(wake_calls)
    torch.cuda.synchronize()
    return out


def test_real_slime_save_model_saves_asleep_and_stock_megatron_resumes(tmp_path):
    from tests import gpu_megatron_cases as g

    root = str(tmp_path)
    full = values(run_world(1, g.run, (root + "/full", "gpu", "full"), backend="nccl", timeout_s=400))
    (out,) = values(run_world(1, real_save_model, (root, SLIME_SRC), backend="nccl", timeout_s=400))
    print("slime commit", out["slime_commit"], "stubbed", out["stubbed"], "hold_s", out["hold_s"])
    (resumed,) = values(run_world(1, g.run, (root, "gpu", "resume"), backend="nccl", timeout_s=400))
    assert out["installed"] and out["tracker"] == str(g.FIRST), out
    assert out["resumed_during_save"] == 0 and out["resumed_after"] == 1, out  # saved asleep, woken after
    assert resumed["start_iteration"] == g.FIRST
    assert resumed["losses"] == full[0]["losses"][g.FIRST:], (resumed["losses"], full[0]["losses"])
