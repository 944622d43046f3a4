"""slime integration on CPU: real Ray actors (2) mirroring slime's actor group and save_model path
(tests/slime_mirror), `install()` as the --custom-megatron-init-path hook, and the checkpoint
loaded back with stock Megatron."""

import errno
import os
import signal

import pytest

ray = pytest.importorskip("ray")

from safe_ckpt.integrations import slime as integration  # noqa: E402
from tests.helpers.bodies.slime_asleep import SPEC, slime_args  # noqa: E402
from tests.slime_mirror.ray.actor_group import RayTrainGroup, repo_env  # noqa: E402


def _args(save_dir, backend="safe", extra=()):
    return slime_args(save_dir, backend=backend, extra=extra)


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


def _each(group, method, *args):
    return ray.get([getattr(a, method).remote(*args) for a in group._actor_handlers])


def _asleep_group(save_dir, extra=()):
    """Two actors with --offload-train after one train() (wake_up, sleep): asleep, as slime's train()
    leaves them. (The actor's own calls are what the asleep path sees: a driver-side
    `RayTrainGroup.offload()` goes to the methods Ray resolved when it created the actor.)"""
    group = RayTrainGroup(_args(save_dir, extra=["--offload-train", *extra]), 2, SPEC, env_vars=repo_env())
    _each(group, "capture_logs")
    _each(group, "train", 0)
    assert [(c["wake_up"], c["sleep"]) for c in _each(group, "call_counts")] == [(1, 1), (1, 1)]
    return group


def test_asleep_actor_saves_without_waking_up_and_loads_with_stock_megatron(ray_cluster, tmp_path):
    save_dir = str(tmp_path)
    group = _asleep_group(save_dir)
    group.save_model(7)  # returns while the writes go on in the background
    for state in _each(group, "asleep_state"):
        assert state["asleep"], state
    assert [(c["wake_up"], c["sleep"]) for c in _each(group, "call_counts")] == [(1, 1), (1, 1)]
    _each(group, "train", 8)  # the next train() begins with wake_up: it finishes the save first
    assert [c["wake_up"] for c in _each(group, "call_counts")] == [2, 2]
    assert _tracker(save_dir) == "7"
    for mismatches, iteration in _each(group, "check_load", 7):
        assert mismatches == [], mismatches[:5]
        assert iteration == 7
    # asleep again (train() ends with sleep), a forced save: committed when save_model returns, no wake-up
    group.save_model(8, force_sync=True)
    assert _tracker(save_dir) == "8"
    assert [c["wake_up"] for c in _each(group, "call_counts")] == [2, 2]
    assert all(m == [] for m, _ in _each(group, "check_load", 8))
    for messages in _each(group, "logged"):
        assert any("saving iteration 7 asleep" in m for m in messages), messages
    for a in group._actor_handlers:
        ray.kill(a)


def test_save_hf_and_save_awake_keep_slimes_wake_up_path(ray_cluster, tmp_path):
    for extra, reason in ((["--save-hf", str(tmp_path / "hf_{rollout_id}")], "--save-hf"),
                          (["--safe-ckpt-save-awake"], None)):
        save_dir = str(tmp_path / extra[0].strip("-"))
        group = _asleep_group(save_dir, extra)
        group.save_model(4)
        counts = _each(group, "call_counts")
        assert [(c["wake_up"], c["sleep"]) for c in counts] == [(2, 2), (2, 2)], counts
        assert _tracker(save_dir) == "4"
        assert all(m == [] for m, _ in _each(group, "check_load", 4))
        if reason:
            assert [c["save_hf"] for c in counts] == [1, 1]
            assert os.path.isfile(tmp_path / "hf_4" / "config.json")
            for messages in _each(group, "logged"):
                assert any("wakes the actor up" in m and reason in m for m in messages), messages
        else:  # turned off: the asleep path is not even installed
            assert _each(group, "asleep_state") == [None, None]
        for a in group._actor_handlers:
            ray.kill(a)


def test_release_train_cycles_save_through_safe_ckpt_and_the_next_actors_load_it(ray_cluster, tmp_path):
    """slime's `--release-train` loop (train.py, 624b824a): each step creates new actors (their
    `init` installs safe_ckpt through the init hook and loads `args.load` through slime's
    `load_checkpoint`, which the hook routed to safe_ckpt), trains, `save_model(force_sync=True)`
    (awake: --offload-train is ignored in this mode), and kills the actors. With --async-save the
    forced save is durable and the tracker written before the kill; the next actors load exactly
    what was saved, through safe_ckpt, with the args' own classes (an enum, a dataclass) in the
    common state; retention keeps the newest two."""
    from safe_ckpt.names import MANIFEST_FILE
    from tests.helpers.slime_arg_types import RewardSpec, RolloutMode

    save_dir = str(tmp_path)
    args = _args(save_dir, extra=["--release-train", "--offload-train", "--async-save",
                                  "--safe-ckpt-keep-last", "2"])
    args.mirror_train_step = True
    args.rollout_mode, args.reward_specs = RolloutMode.ASYNC, (RewardSpec("format", 0.25),)  # slime-side types
    assert args.offload_train is False  # as slime's parse_args leaves it with --release-train
    group = RayTrainGroup(args, 2, SPEC, env_vars=repo_env(), create=False)
    saved = None
    cycles = 3
    for rollout_id in range(cycles):
        start_ids = group.create()
        assert start_ids == [rollout_id, rollout_id], start_ids  # resumed after the previous step's save
        loaded = _each(group, "state_digest")
        if saved is not None:
            assert loaded == saved, f"step {rollout_id}: the new actors did not load what the last ones saved"
            assert _each(group, "loaded_by_safe_ckpt") == [(os.path.abspath(save_dir), rollout_id - 1)] * 2
        ray.get(group.async_train(rollout_id))
        saved = _each(group, "state_digest")
        assert saved != loaded  # the step changed the state
        group.save_model(rollout_id, force_sync=True)
        group.release()  # at once, as slime's update_weights does after the disk weight sync
        assert _tracker(save_dir) == str(rollout_id)
        assert os.path.isfile(os.path.join(save_dir, f"iter_{rollout_id:07d}", MANIFEST_FILE))  # safe_ckpt wrote it
        assert args.load == save_dir
    iters = sorted(n for n in os.listdir(save_dir) if n.startswith("iter_"))
    assert iters == [f"iter_{cycles - 2:07d}", f"iter_{cycles - 1:07d}"], iters
