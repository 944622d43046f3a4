"""Body of the GPU slime test (tests/gpu/test_slime_offloaded_actors.py): one scenario of an offloaded train
actor (slime's `--offload-train`: state in a torch_memory_saver region with a CPU backup),
driven either through Ray actors (the mirror's RayTrainGroup) or through the same actor
class living in one rank spawned by tests/helpers/mp.py, where this process plays the driver.

Everything goes through slime's path as mirrored in tests/slime_mirror: `install()` as the
--custom-megatron-init-path hook, `save_model` -> `model.save` -> the rebound
`save_checkpoint`, with the `--safe-ckpt-*` flags read from the actors' args.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from tests.helpers.paths import REPO

# Megatron-shaped and small: 2 layers (so the fused fc1 factory builds strided views), TP-sharded
# weights, distributed-optimizer buckets split into irregular pieces.
SPEC = dict(hidden=128, ffn=512, vocab=1024, layers=2, seq=32, buckets=2, bucket_numel=300_000, pieces_per_rank=3)
MODEL_MODULE = "tests.slime_mirror.backends.megatron_utils.model"
POLICY = "safe_ckpt_unmapped_policy"
STAND_INS = os.path.join(REPO, "tests", "stand_ins")


def make_args(save_dir: str, tp: int) -> argparse.Namespace:
    """slime's argument parsing in miniature: Megatron-style flags, --offload-train, add_arguments()."""
    from safe_ckpt.integrations import slime as integration

    parser = argparse.ArgumentParser()
    for flag in ("--save", "--custom-megatron-init-path", "--save-hf"):
        parser.add_argument(flag, default=None)
    parser.add_argument("--ckpt-format", default="torch_dist")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    for flag in ("--async-save", "--no-save-optim", "--no-save-rng", "--use-distributed-optimizer",
                 "--offload-train", "--debug-rollout-only", "--overlap-param-gather"):
        parser.add_argument(flag, action="store_true")
    integration.add_arguments(parser)
    args = parser.parse_args([
        "--save", save_dir, "--ckpt-backend", "safe", "--use-distributed-optimizer", "--offload-train",
        "--tensor-model-parallel-size", str(tp), "--custom-megatron-init-path", integration.INIT_HOOK,
        "--safe-ckpt-io-threads", "2", "--safe-ckpt-timeout-s", "60", "--safe-ckpt-staging-budget-gib", "0.25",
        "--safe-ckpt-unmapped-policy", "error",
    ])
    args.safe_ckpt_model_module = MODEL_MODULE  # where slime's save module lives in the mirror
    # This scenario is the save as slime v0.2.x made it (in place, groups alive, no wake-up):
    # save_in_place, and the mirror keeps its groups across sleep. The asleep save of slime's
    # current save_model is tests/helpers/bodies/gpu_slime_asleep.py.
    args.mirror_keep_groups = True
    return args


def ray_env() -> dict:
    """The actors' environment: the repo and the megatron.training stand-in first, then whatever
    this process had on PYTHONPATH (on the GPU machine: the carried wheels)."""
    from tests.slime_mirror.ray.actor_group import repo_env

    env = repo_env()
    inherited = os.environ.get("PYTHONPATH")
    if inherited:
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], inherited])
    return env


class RayCalls:
    """The driver's calls with Ray: the group's own fan-out methods, or one method on every actor."""

    def __init__(self, group):
        import ray

        self._ray, self.group = ray, group

    def save_model(self, rollout_id):
        return self.each("save_in_place", rollout_id)

    def offload(self):
        return self.group.offload()

    def onload(self):
        return self.group.onload()

    def each(self, method, *args):
        return self._ray.get([getattr(a, method).remote(*args) for a in self.group._actor_handlers])


class LocalCalls:
    """The same calls on actor objects living in this process (one spawned rank)."""

    def __init__(self, actors):
        self.actors = actors

    def save_model(self, rollout_id):
        return [a.save_in_place(rollout_id) for a in self.actors]

    def offload(self):
        return [a.sleep() for a in self.actors]

    def onload(self):
        return [a.wake_up() for a in self.actors]

    def each(self, method, *args):
        return [getattr(a, method)(*args) for a in self.actors]


def _error(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__], "message": str(exc),
            "traceback": traceback.format_exc()[-4000:]}


def _tracker(save_dir):
    path = os.path.join(save_dir, "latest_checkpointed_iteration.txt")
    return open(path).read().strip() if os.path.exists(path) else None


def scenario(calls, save_dir: str) -> dict:
    """Every step's outcome, {"ok": True, "value": ...} or {"ok": False, "error": {...}}, plus the
    tracker and directory after each save. Steps go on after a failure, to show what else holds."""
    out: dict = {}

    def step(name, fn, *args):
        try:
            out[name] = {"ok": True, "value": fn(*args)}
        except BaseException as exc:  # asserted on by the test
            out[name] = {"ok": False, "error": _error(exc)}

    def saved(name):
        out[f"{name}_tracker"] = _tracker(save_dir)
        out[f"{name}_listing"] = sorted(os.listdir(save_dir))

    step("probe_awake", calls.each, "probe")
    # 1. awake: a normal save
    step("save1", calls.save_model, 1)
    saved("save1")
    step("save1_residences", calls.each, "last_save")
    step("load1", calls.each, "check_load", 1)
    # 2. asleep (paused, CPU backup held by torch_memory_saver), policy error: refused everywhere
    step("sleep", calls.offload)
    step("probe_asleep", calls.each, "probe")
    step("save2", calls.save_model, 2)
    saved("save2")
    step("probe_after_refusal", calls.each, "probe")  # the actors are alive and still asleep
    # 3. still asleep, --safe-ckpt-unmapped-policy cpu_backup: written from the backup
    step("policy_backup", calls.each, "update_args", {POLICY: "cpu_backup"})
    step("save3", calls.save_model, 3)
    saved("save3")
    step("save3_residences", calls.each, "last_save")
    step("probe_after_backup_save", calls.each, "probe")
    # 4. awake again: the state came back intact, and saves as before
    step("wake_up", calls.onload)
    step("probe_woken", calls.each, "probe")
    step("load1_after", calls.each, "check_load", 1)
    step("load3", calls.each, "check_load", 3)
    step("policy_error", calls.each, "update_args", {POLICY: "error"})
    step("save4", calls.save_model, 4)
    saved("save4")
    step("save4_residences", calls.each, "last_save")
    step("load4", calls.each, "check_load", 4)
    return out


def spawned_scenario(rank: int, world: int, save_dir: str, device: str = "cuda") -> dict:
    """In a rank spawned by tests/helpers/mp.py (gloo group already up): the actor object, then the scenario."""
    if STAND_INS not in sys.path:  # before anything imports megatron.training (the real one may be installed)
        sys.path.insert(0, STAND_INS)
    from tests.slime_mirror.backends.megatron_utils.actor import MegatronTrainRayActor

    actor = MegatronTrainRayActor(world, rank, None, None)
    actor.init(make_args(save_dir, tp=world), "actor", SPEC, device=device)
    actor.watch_saves()
    return scenario(LocalCalls([actor]), save_dir)
