"""slime with `--offload-train` on the GPU: the train actor's
state lives in a real torch_memory_saver region with a CPU backup (torch hook mode), slime's
`sleep()` pauses it, and `save_model` through `install()` and slime's save path either
refuses it with the documented ResidenceError (`--safe-ckpt-unmapped-policy error`) or
writes it from the backup (`cpu_backup`); the actor survives, wakes up, and saves again.
Every checkpoint is checked bit-exact with stock Megatron `dist_checkpointing.load`.

Two launchers run the same actor class (tests/slime_mirror) and the same scenario
(tests/helpers/bodies/gpu_slime.py):
- with Ray installed: the mirror's RayTrainGroup, 2 actors (sharing the GPU at 0.5 GPU each
  on a one-GPU machine), so the refusal and the commit are collective across actors and the
  error reaches the driver through `ray.get`;
- always (also where Ray is missing: the GPU image has none, it is carried there): one rank
  spawned by tests/helpers/mp.py `run_world`, holding the actor object; that process plays the
  driver and calls the actor's methods directly.
Marked `gpu` (skipped without CUDA, tests/conftest.py) and skipped without torch_memory_saver.
"""

import importlib.util
import os
import re

import pytest

from tests.helpers.mp import run_world, values

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("torch_memory_saver") is None,
                       reason="torch_memory_saver not installed"),
]

HAVE_RAY = importlib.util.find_spec("ray") is not None


def _value(out, name):
    r = out[name]
    if not r["ok"]:
        e = r["error"]
        raise AssertionError(f"step {name!r} failed: {e['type']}: {e['message']}\n{e['traceback']}")
    return r["value"]


def _all_loaded(out, name, iteration):
    for mismatches, got in _value(out, name):
        assert mismatches == [], (name, mismatches[:5])
        assert got == iteration, (name, got)


def check_scenario(out: dict, n_actors: int, awake: str = "cuda") -> None:
    """The acceptance item, step by step (``awake``: the residence of the state when resumed)."""
    awake_probe = _value(out, "probe_awake")
    assert len(awake_probe) == n_actors
    pids = [p["pid"] for p in awake_probe]
    keys = set().union(*(p["keys"] for p in awake_probe))
    for p in awake_probe:
        assert set(p["residences"]) == {awake} and p["device_ok"], p

    # 1. awake
    _value(out, "save1")
    assert out["save1_tracker"] == "1", out["save1_listing"]
    for residences in _value(out, "save1_residences"):
        assert residences and awake in residences and "offload_backup" not in residences, residences
    _all_loaded(out, "load1", 1)

    # 2. asleep, policy error: the documented error in the driver, nothing published
    _value(out, "sleep")
    for p in _value(out, "probe_asleep"):
        assert set(p["residences"]) == {"cuda_unmapped"}, ("sleep() did not pause the state", p)
    r = out["save2"]
    assert not r["ok"], "a save of paused memory with --safe-ckpt-unmapped-policy error succeeded"
    err = r["error"]
    msg = err["message"]
    assert "ResidenceError" in err["mro"] or "ResidenceError" in msg, err
    named = re.search(r"key '([^']+)'", msg)
    assert named and any(named.group(1) == k or named.group(1).startswith(k + ".") for k in keys), msg[:2000]
    assert "paused" in msg and "not mapped" in msg, msg[:2000]
    assert "resume" in msg and "cpu_backup" in msg, ("the message names no remedy", msg[:2000])
    assert out["save2_tracker"] == "1", out["save2_listing"]
    assert "iter_0000002" not in out["save2_listing"], out["save2_listing"]
    # ... and the actors are alive, the same processes, still asleep
    after = _value(out, "probe_after_refusal")
    assert [p["pid"] for p in after] == pids
    for p in after:
        assert p["device_ok"] and set(p["residences"]) == {"cuda_unmapped"}, p

    # 3. asleep, policy cpu_backup: written from torch_memory_saver's backup
    _value(out, "policy_backup")
    _value(out, "save3")
    assert out["save3_tracker"] == "3", out["save3_listing"]
    for residences in _value(out, "save3_residences"):
        assert "offload_backup" in residences, residences
        assert not {"cuda", "cuda_unmapped"} & set(residences), residences  # nothing read from paused memory
    for p in _value(out, "probe_after_backup_save"):
        assert set(p["residences"]) == {"cuda_unmapped"}, p

    # 4. woken up: the state is back, every checkpoint loads bit-exact, and saving works as before
    _value(out, "wake_up")
    woken = _value(out, "probe_woken")
    assert [p["pid"] for p in woken] == pids
    for p in woken:
        assert set(p["residences"]) == {awake} and p["device_ok"], p
    _all_loaded(out, "load1_after", 1)
    _all_loaded(out, "load3", 3)
    _value(out, "policy_error")
    _value(out, "save4")
    assert out["save4_tracker"] == "4", out["save4_listing"]
    for residences in _value(out, "save4_residences"):
        assert awake in residences and "offload_backup" not in residences, residences
    _all_loaded(out, "load4", 4)
    assert "iter_0000002" not in out["save4_listing"]


def test_offloaded_actor_in_a_spawned_rank_refuses_or_reads_backup_and_survives(tmp_path):
    from tests.helpers.bodies import gpu_slime as cases

    save_dir = str(tmp_path / "ckpt")
    os.makedirs(save_dir)
    (out,) = values(run_world(1, cases.spawned_scenario, (save_dir,), timeout_s=400))
    check_scenario(out, 1)


@pytest.mark.skipif(not HAVE_RAY, reason="Ray is not installed (the spawned-rank test covers the scenario)")
def test_offloaded_ray_actors_refuse_or_read_backup_and_survive(tmp_path):
    import ray
    import torch

    from tests.helpers.bodies import gpu_slime as cases
    from tests.slime_mirror.ray.actor_group import RayTrainGroup

    save_dir = str(tmp_path / "ckpt")
    os.makedirs(save_dir)
    gpus = torch.cuda.device_count()
    n_actors = 2
    per_actor = 1 if gpus >= n_actors else 0.5  # two actors share one GPU (saving coordinates over gloo)
    env = cases.ray_env()
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=4, num_gpus=gpus, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 << 20, runtime_env={"env_vars": env})
    group = None
    try:
        group = RayTrainGroup(cases.make_args(save_dir, tp=n_actors), n_actors, cases.SPEC, env_vars=env,
                              num_gpus_per_actor=per_actor, device="cuda")
        calls = cases.RayCalls(group)
        calls.each("watch_saves")
        out = cases.scenario(calls, save_dir)
    finally:
        for a in (group._actor_handlers if group is not None else []):
            ray.kill(a)
        ray.shutdown()
    check_scenario(out, n_actors)


def _have_megatron_training():
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _have_megatron_training(), reason="needs Megatron-LM's megatron.training on the path")
@pytest.mark.parametrize("variant", ["gpu", "cpu_offload_pinned"])
def test_asleep_save_of_a_real_gpt_resumes_bit_exact_with_no_device_work(tmp_path, variant):
    """train -> pause -> asleep save (profiled) -> rollout stand-in fills the freed memory -> resume ->
    train on; a fresh process resumes from the asleep checkpoint with stock load_checkpoint; both
    equal the uninterrupted run bit for bit, and the save made no host-to-device copy, launched no
    kernel and called no NCCL."""
    import torch

    from tests.helpers.bodies import gpu_megatron as g
    from tests.helpers.bodies import gpu_slime_asleep as a
    from tests.helpers.megatron_evidence import diff_digests

    world = max(1, min(int(os.environ.get("SAFE_CKPT_GPU_WORLD", "2")), torch.cuda.device_count()))
    root = str(tmp_path)
    full = values(run_world(world, g.run, (root + "/full", variant, "full"), backend="nccl", timeout_s=400))
    asleep = values(run_world(world, a.run, (root, variant), backend="nccl", timeout_s=400))
    resumed = values(run_world(world, g.run, (root, variant, "resume"), backend="nccl", timeout_s=400))
    for r_full, r_asleep, r_resumed in zip(full, asleep, resumed):  # evidence first
        print(variant, "asleep save", r_asleep["asleep_save_profile"], "held", r_asleep["save_model_held_s"],
              "durable", r_asleep["durable_s"], "residences", r_asleep["bytes_by_residence"], "freed",
              r_asleep["freed_bytes"], "rollout", r_asleep["rollout_bytes"])
    for r_full, r_asleep, r_resumed in zip(full, asleep, resumed):
        prof = r_asleep["asleep_save_profile"]
        assert prof["HtoD"] == 0 and prof["kernels"] == 0 and prof["nccl"] == 0, prof
        assert r_asleep["tracker"] == str(g.FIRST)
        assert r_asleep["bytes_by_residence"].get("offload_backup", 0) > 0, r_asleep["bytes_by_residence"]
        assert r_asleep["bytes_by_residence"].get("cuda", 0) == 0, r_asleep["bytes_by_residence"]
        assert r_asleep["freed_bytes"] > 0 and r_asleep["rollout_bytes"] > 0
        assert r_asleep["losses_first"] == r_full["losses"][:g.FIRST]
        # woken up after the rollout took the memory: training goes on exactly as if never asleep
        assert r_asleep["losses_second"] == r_full["losses"][g.FIRST:], (r_asleep["losses_second"], r_full["losses"])
        # the asleep checkpoint, loaded by stock Megatron in a fresh process, resumes exactly too
        assert r_resumed["start_iteration"] == g.FIRST
        assert diff_digests(r_asleep["opt_digest"], r_resumed["opt_digest"]) == [], r_resumed.get("adam_step_repair")
        assert r_resumed["losses"] == r_full["losses"][g.FIRST:], (r_resumed["losses"], r_full["losses"])


@pytest.mark.skipif(not _have_megatron_training(), reason="needs Megatron-LM's megatron.training on the path")
def test_asleep_save_holds_a_direct_resume_until_durable(tmp_path):
    """The asleep save started through the actor's route, then torch_memory_saver.resume() at once
    (the driver's onload(), which no hooked wake_up() sees): the guard holds the resume until the
    checkpoint is durable; training goes on bit-exact and the checkpoint resumes bit-exact."""
    import torch

    from tests.helpers.bodies import gpu_megatron as g
    from tests.helpers.bodies import gpu_slime_asleep as a
    from tests.helpers.megatron_evidence import diff_digests

    world = max(1, min(int(os.environ.get("SAFE_CKPT_GPU_WORLD", "2")), torch.cuda.device_count()))
    root = str(tmp_path)
    full = values(run_world(world, g.run, (root + "/full", "gpu", "full"), backend="nccl", timeout_s=400))
    asleep = values(run_world(world, a.run, (root, "gpu", True), backend="nccl", timeout_s=400))
    resumed = values(run_world(world, g.run, (root, "gpu", "resume"), backend="nccl", timeout_s=400))
    for r in asleep:
        print("resume at once: guarded", r["guarded"], "held", r["save_model_held_s"], "resume returned",
              r["resume_returned_s"], "waited", r["resume_waited_s"], "residences", r["bytes_by_residence"])
    for r_full, r_asleep, r_resumed in zip(full, asleep, resumed):
        assert r_asleep["guarded"] is True
        assert r_asleep["in_flight_at_resume"] is True  # else this run proves nothing about the guard
        assert r_asleep["done_when_resumed"] is True  # the resume did not return before the save was durable
        assert r_asleep["asleep_after"] is False
        assert r_asleep["bytes_by_residence"].get("offload_backup", 0) > 0, r_asleep["bytes_by_residence"]
        assert r_asleep["bytes_by_residence"].get("cuda", 0) == 0, r_asleep["bytes_by_residence"]
        assert r_asleep["tracker"] == str(g.FIRST)
        assert r_asleep["losses_second"] == r_full["losses"][g.FIRST:], (r_asleep["losses_second"], r_full["losses"])
        assert r_resumed["start_iteration"] == g.FIRST
        assert diff_digests(r_asleep["opt_digest"], r_resumed["opt_digest"]) == [], r_resumed.get("adam_step_repair")
        assert r_resumed["losses"] == r_full["losses"][g.FIRST:], (r_resumed["losses"], r_full["losses"])
