"""slime integration on CPU: real Ray actors (2) mirroring slime's actor group and save_model path
(tests/slime_mirror), `install()` as the --custom-megatron-init-path hook, and the checkpoint
loaded back with stock Megatron."""

import argparse
import errno
import os
import signal

import pytest

ray = pytest.importorskip("ray")

from safe_ckpt.integrations import slime as integration  # noqa: E402
from tests.slime_mirror.ray.actor_group import RayTrainGroup, repo_env  # noqa: E402

SPEC = dict(hidden=64, ffn=256, vocab=512, layers=2, seq=32, buckets=2, bucket_numel=20_000, pieces_per_rank=3)
MODEL_MODULE = "tests.slime_mirror.backends.megatron_utils.model"
ACTOR_MODULE = "tests.slime_mirror.backends.megatron_utils.actor"
RELOADABLE_MODULE = "tests.slime_mirror.utils.reloadable_process_group"


def _args(save_dir, backend="safe", extra=()):
    """slime's argument parsing in miniature: Megatron-style flags plus add_arguments()."""
    parser = argparse.ArgumentParser()
    for flag in ("--save", "--custom-megatron-init-path", "--save-hf"):
        parser.add_argument(flag, default=None)
    parser.add_argument("--ckpt-format", default="torch_dist")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=2)
    for flag in ("--async-save", "--no-save-optim", "--no-save-rng", "--use-distributed-optimizer", "--offload-train",
                 "--debug-rollout-only", "--overlap-param-gather"):
        parser.add_argument(flag, action="store_true")
    integration.add_arguments(parser)
    args = parser.parse_args(["--save", save_dir, "--ckpt-backend", backend, "--use-distributed-optimizer",
                              "--custom-megatron-init-path", integration.INIT_HOOK, "--safe-ckpt-io-threads", "2",
                              "--safe-ckpt-timeout-s", "30", *extra])
    args.safe_ckpt_model_module = MODEL_MODULE  # where slime's modules live in the mirror
    args.safe_ckpt_actor_module = ACTOR_MODULE
    args.safe_ckpt_reloadable_module = RELOADABLE_MODULE
    return args


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": repo_env()})
    yield
    ray.shutdown()


def _tracker(save_dir):
    path = os.path.join(save_dir, "latest_checkpointed_iteration.txt")
    return open(path).read() if os.path.exists(path) else None


def test_safe_backend_saves_through_slime_path_and_loads_with_stock_megatron(ray_cluster, tmp_path):
    save_dir = str(tmp_path)
    group = RayTrainGroup(_args(save_dir), 2, SPEC, env_vars=repo_env())
    group.save_model(3)
    assert _tracker(save_dir) == "3"
    results = ray.get([a.check_load.remote(3) for a in group._actor_handlers])
    for mismatches, iteration in results:
        assert mismatches == [], mismatches[:5]
        assert iteration == 3
    for a in group._actor_handlers:
        ray.kill(a)


def test_async_save_is_finalized_by_slimes_own_call(ray_cluster, tmp_path):
    save_dir = str(tmp_path)
    group = RayTrainGroup(_args(save_dir, extra=["--async-save"]), 2, SPEC, env_vars=repo_env())
    group.save_model(5, force_sync=True)  # slime calls maybe_finalize_async_save(blocking=True) after it
    assert _tracker(save_dir) == "5"
    assert all(m == [] for m, _ in ray.get([a.check_load.remote(5) for a in group._actor_handlers]))
    for a in group._actor_handlers:
        ray.kill(a)


def test_megatron_backend_is_left_alone(ray_cluster, tmp_path):
    group = RayTrainGroup(_args(str(tmp_path), backend="megatron"), 2, SPEC, env_vars=repo_env())
    with pytest.raises(ray.exceptions.RayTaskError, match="stock megatron.training save_checkpoint was called"):
        group.save_model(1)
    for a in group._actor_handlers:
        ray.kill(a)


def _second_save_fails(tmp_path, fault, expected):
    """Iteration 1 saves; iteration 2 fails on actor 1; tracker and iteration 1 stay current."""
    save_dir = str(tmp_path)
    group = RayTrainGroup(_args(save_dir), 2, SPEC, env_vars=repo_env())
    group.save_model(1)
    ray.get(group._actor_handlers[1].arm_fault.remote(fault))
    with pytest.raises(expected) as info:
        group.save_model(2)
    assert _tracker(save_dir) == "1" and not os.path.exists(os.path.join(save_dir, "iter_0000002"))
    for a in group._actor_handlers:
        ray.kill(a)
    return save_dir, info.value


def test_failing_actor_error_reaches_the_driver(ray_cluster, tmp_path):
    _, error = _second_save_fails(tmp_path, {"after_bytes": 10_000, "errno": errno.ENOSPC},
                                  ray.exceptions.RayTaskError)
    assert "CheckpointError" in str(error) or "WriteError" in str(error)
    assert "rank 1" in str(error) and "No space left" in str(error)


def test_killed_actor_leaves_the_previous_checkpoint_current(ray_cluster, tmp_path):
    save_dir, _ = _second_save_fails(tmp_path, {"after_bytes": 10_000, "kill_signal": signal.SIGKILL},
                                     (ray.exceptions.RayActorError, ray.exceptions.RayTaskError))
    # the previous checkpoint still loads, with stock Megatron, in a fresh group of actors
    fresh = RayTrainGroup(_args(save_dir), 2, SPEC, env_vars=repo_env())
    assert all(m == [] for m, _ in ray.get([a.check_load.remote(1) for a in fresh._actor_handlers]))
    for a in fresh._actor_handlers:
        ray.kill(a)


def test_launcher_puts_the_hook_on_the_command_line_and_chains_the_users():
    argv = integration._launcher_argv(["--save", "/x"])
    assert argv[-2:] == ["--custom-megatron-init-path", integration.INIT_HOOK]
    argv = integration._launcher_argv(["--custom-megatron-init-path", "my.hook", "--save", "/x"])
    assert argv[:2] == ["--custom-megatron-init-path", integration.INIT_HOOK]
    assert argv[-2:] == ["--safe-ckpt-chained-init-path", "my.hook"]
