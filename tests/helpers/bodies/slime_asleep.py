"""Bodies of the asleep-save tests (tests/integrations/test_slime_asleep_save.py) that run in ranks spawned by
tests/helpers/mp.py: each rank holds one mirrored slime train actor (tests/slime_mirror) and plays
slime's driver itself, so a test can act while one of the actor's calls is still waiting."""

from __future__ import annotations

import os
import sys
import threading

from tests.helpers.paths import REPO

STAND_INS = os.path.join(REPO, "tests", "stand_ins")
SPEC = dict(hidden=64, ffn=256, vocab=512, layers=2, seq=32, buckets=2, bucket_numel=20_000, pieces_per_rank=3)
MODEL_MODULE = "tests.slime_mirror.backends.megatron_utils.model"
CHECKPOINT_MODULE = "tests.slime_mirror.backends.megatron_utils.checkpoint"
ACTOR_MODULE = "tests.slime_mirror.backends.megatron_utils.actor"
RELOADABLE_MODULE = "tests.slime_mirror.utils.reloadable_process_group"
BOUND_S = 120  # every wait here is bounded; a hang fails the test


def slime_args(save_dir, backend="safe", extra=()):
    """slime's argument parsing in miniature: Megatron-style flags plus add_arguments()."""
    import argparse

    from safe_ckpt.integrations import slime as integration

    parser = argparse.ArgumentParser()
    for flag in ("--save", "--load", "--custom-megatron-init-path", "--save-hf"):
        parser.add_argument(flag, default=None)
    parser.add_argument("--ckpt-format", default="torch_dist")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=2)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--ckpt-step", type=int, default=None)
    parser.add_argument("--dist-ckpt-strictness", default="assume_ok_unexpected")
    for flag in ("--async-save", "--no-save-optim", "--no-save-rng", "--use-distributed-optimizer", "--offload-train",
                 "--debug-rollout-only", "--overlap-param-gather", "--release-train",
                 "--no-load-optim", "--no-load-rng", "--finetune", "--verify-integrity", "--fp16", "--bf16",
                 "--data-parallel-random-init"):  # the second line: what Megatron's load_checkpoint reads
        parser.add_argument(flag, action="store_true")
    integration.add_arguments(parser)
    args = parser.parse_args(["--save", save_dir, "--ckpt-backend", backend, "--use-distributed-optimizer",
                              "--custom-megatron-init-path", integration.INIT_HOOK, "--safe-ckpt-io-threads", "2",
                              "--safe-ckpt-timeout-s", "30", *extra])
    # Megatron's default, and what slime's _set_default_megatron_args forces
    args.ckpt_load_validate_sharding_integrity = True
    args.ckpt_assume_constant_structure = args.ckpt_fully_parallel_load = True
    if args.release_train:  # as slime's parse_args: the train actors are released, not offloaded
        args.offload_train = False
    # as slime's parse_args with --offload-train: the patched DDP allocates the parameter and
    # gradient buffers in torch_memory_saver regions without CPU backup (the mirror lays them out so)
    args.disable_grad_buffers_cpu_backup = args.disable_param_buffers_cpu_backup = args.offload_train
    args.safe_ckpt_model_module = MODEL_MODULE  # where slime's modules live in the mirror
    args.safe_ckpt_checkpoint_module = CHECKPOINT_MODULE
    args.safe_ckpt_actor_module = ACTOR_MODULE
    args.safe_ckpt_reloadable_module = RELOADABLE_MODULE
    return args


def _actor(rank, world, save_dir, extra=(), mirror=None):
    """A mirrored train actor; ``mirror``: attributes set on its args before init (mirror-only knobs)."""
    if STAND_INS not in sys.path:
        sys.path.insert(0, STAND_INS)
    from tests.slime_mirror.backends.megatron_utils.actor import MegatronTrainRayActor

    actor = MegatronTrainRayActor(world, rank, None, None)
    args = slime_args(save_dir, extra=["--offload-train", *extra])
    for name, value in (mirror or {}).items():
        setattr(args, name, value)
    actor.init(args, "actor", SPEC, device="cpu")
    return actor


def _tracker(save_dir):
    path = os.path.join(save_dir, "latest_checkpointed_iteration.txt")
    return open(path).read().strip() if os.path.exists(path) else None


def wake_up_waits_for_the_asleep_save(rank, world, save_dir):
    """sleep -> save_model (writes held at a gate) -> wake_up in a thread: it must wait, without
    calling slime's wake_up, until the gate opens and the save is committed."""
    import torch.distributed as dist

    from safe_ckpt.integrations.slime_asleep import installed

    actor = _actor(rank, world, save_dir)
    saves = installed(type(actor))
    actor.gate_writes()
    actor.sleep()
    actor.save_model(9)
    returned_before_writing = not actor.writes_released.is_set()
    assert actor.writes_reached.wait(BOUND_S), "no write reached the gate"
    woke = threading.Thread(target=actor.wake_up, name="wake_up")
    woke.start()
    assert saves.waiting.wait(BOUND_S), "wake_up did not wait for the asleep save"
    during = {"wake_up_calls": actor.calls["wake_up"], "tracker": _tracker(save_dir),
              "thread_alive": woke.is_alive(), "asleep": saves.asleep}
    actor.release_writes()
    woke.join(BOUND_S)
    after = {"thread_alive": woke.is_alive(), "wake_up_calls": actor.calls["wake_up"], "asleep": saves.asleep}
    dist.barrier()
    after["tracker"] = _tracker(save_dir)
    mismatches, iteration = actor.check_load(9)
    return {"returned_before_writing": returned_before_writing, "during": during, "after": after,
            "mismatches": mismatches[:5], "iteration": iteration, "calls": actor.call_counts()}


def resume_waits_for_the_asleep_save(rank, world, save_dir):
    """sleep -> save_model (writes held at a gate) -> torch_memory_saver.resume() in a thread, as
    slime's original wake_up calls it when the driver's `onload()` reaches an actor through the
    method Ray resolved at creation (not hooked): the resume must wait until the save is
    committed, and the next save must take slime's wake-up path."""
    import torch.distributed as dist

    from safe_ckpt.integrations.slime_asleep import installed

    tms_dir = os.path.join(REPO, "tests", "stand_ins_tms")
    if tms_dir not in sys.path:
        sys.path.insert(0, tms_dir)
    from torch_memory_saver import torch_memory_saver  # as slime's actor module imports it

    actor = _actor(rank, world, save_dir)
    saves = installed(type(actor))
    actor.gate_writes()
    actor.sleep()
    actor.save_model(9)
    assert actor.writes_reached.wait(BOUND_S), "no write reached the gate"
    resumed = threading.Thread(target=torch_memory_saver.resume, name="onload")
    resumed.start()
    assert saves.waiting.wait(BOUND_S), "torch_memory_saver.resume did not wait for the asleep save"
    during = {"resumes": torch_memory_saver.calls.count(("resume", None)), "tracker": _tracker(save_dir),
              "thread_alive": resumed.is_alive(), "asleep": saves.asleep}
    actor.release_writes()
    resumed.join(BOUND_S)
    after = {"resumes": torch_memory_saver.calls.count(("resume", None)), "thread_alive": resumed.is_alive(),
             "asleep": saves.asleep}
    dist.barrier()
    after["tracker"] = _tracker(save_dir)
    actor.save_model(10)  # awake now: slime's own path, its wake_up and sleep called
    dist.barrier()
    after["next"] = {"tracker": _tracker(save_dir), "wake_up_calls": actor.calls["wake_up"],
                     "sleep_calls": actor.calls["sleep"]}
    mismatches, iteration = actor.check_load(10)
    return {"during": during, "after": after, "mismatches": mismatches[:5], "iteration": iteration}


def detached_group_survives_the_cycles(rank, world, save_dir, cycles=2):
    """The asleep save's group works before, during and after slime's destroy/reload cycles; a gloo group made with `new_group` before sleep does not survive one."""
    import torch.distributed as dist

    from safe_ckpt.coord import dist as safe_dist
    from safe_ckpt.integrations.slime_asleep import installed
    from tests.slime_mirror.utils import reloadable_process_group as rpg

    actor = _actor(rank, world, save_dir)
    saves = installed(type(actor))
    coord = safe_dist.coordinator(saves.group, 30.0)
    registered = dist.new_group(backend="gloo")
    seen = [coord.exchange("awake", rank)]
    registered_after_sleep = None
    for cycle in range(cycles):
        actor.sleep()
        seen.append(coord.exchange(f"asleep{cycle}", rank + 10 * cycle))
        if registered_after_sleep is None:
            try:
                registered_after_sleep = f"rank {dist.get_rank(registered)}"
            except ValueError as exc:  # expected: slime's sleep destroyed it with WORLD
                registered_after_sleep = str(exc)
        rpg.reload_process_groups()  # update_weights() does this alone, while the save writes
        seen.append(coord.exchange(f"reloaded{cycle}", rank))
        rpg.destroy_process_groups()
        actor.wake_up()
        seen.append(coord.exchange(f"woken{cycle}", rank))
    return {"seen": seen, "registered_after_sleep": registered_after_sleep}


def ranks_of_destroyed_wrappers(rank, world, save_dir):
    """slime's wrapped subgroups after sleep: `rank()` fails and torch no longer knows the group;
    under `pinned_ranks` both answer as before sleep (the queries Megatron's state dict makes)."""
    import torch.distributed as dist

    from safe_ckpt.integrations import slime_groups
    from tests.slime_mirror.utils.reloadable_process_group import ReloadableProcessGroup

    single = [ReloadableProcessGroup(dist.new_group([r], backend="gloo"), [r]) for r in range(world)][rank]
    both = ReloadableProcessGroup(dist.new_group(list(range(world)), backend="gloo"), list(range(world)))
    awake = {"single": (single.rank(), single.size()), "both": (both.rank(), both.size(), dist.get_rank(both.group))}
    snapshot = slime_groups.snapshot_groups(RELOADABLE_MODULE)
    single.destroy(), both.destroy()
    try:
        both.rank()
        unpinned = "answered"
    except AttributeError as exc:
        unpinned = str(exc)
    with slime_groups.pinned_ranks(snapshot):
        pinned = {"single": (single.rank(), single.size()),
                  "both": (both.rank(), both.size(), dist.get_rank(both)),
                  "ranks": dist.get_process_group_ranks(both), "world": dist.get_rank()}
    restored = ReloadableProcessGroup.rank is not None and "answer" not in ReloadableProcessGroup.rank.__qualname__
    return {"awake": awake, "unpinned": unpinned, "pinned": pinned, "restored": restored}


def save_model_returns_while_the_build_is_held(rank, world, save_dir):
    """The state dict is built in a thread: with Megatron's `generate_state_dict` held at a gate,
    `save_model` still returns; a `wake_up` then waits for the build and the writes; once the
    gate opens the checkpoint commits and loads back."""
    import torch.distributed as dist

    from safe_ckpt.integrations.slime_asleep import installed

    actor = _actor(rank, world, save_dir)
    from megatron.training import checkpointing as mck  # the stand-in, on the path once the actor is made

    saves = installed(type(actor))
    reached, release = threading.Event(), threading.Event()
    original = mck.generate_state_dict

    def held(*args, **kwargs):
        reached.set()
        assert release.wait(BOUND_S), "the gate was never opened"
        return original(*args, **kwargs)

    mck.generate_state_dict = held
    import torch

    try:
        actor.sleep()
        rng_at_save = torch.get_rng_state().clone()
        actor.save_model(7)
        assert reached.wait(BOUND_S), "the build never started"
        torch.manual_seed(1234 + rank)  # the process goes on drawing while the build waits
        torch.rand(8)
        returned = {"build_held": not release.is_set(), "hold_s_bounded": saves.last_hold_s < BOUND_S,
                    "tracker": _tracker(save_dir)}
        woke = threading.Thread(target=actor.wake_up, name="wake_up")
        woke.start()
        assert saves.waiting.wait(BOUND_S), "wake_up did not wait for the asleep save"
        during = {"wake_up_calls": actor.calls["wake_up"], "thread_alive": woke.is_alive()}
        release.set()
        woke.join(BOUND_S)
    finally:
        mck.generate_state_dict = original
        release.set()
    dist.barrier()
    mismatches, iteration = actor.check_load(7)
    # the checkpoint's RNG state is the one at save_model's call, not the one the build saw later
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    tp = actor.args.tensor_model_parallel_size
    template = {"rng_state": ShardedObject("rng_state", None, (1, tp), (0, rank % tp), replica_id=0)}
    saved = dist_checkpointing.load(template, os.path.join(save_dir, "iter_0000007"))["rng_state"]
    return {"returned": returned, "during": during, "woke": not woke.is_alive(),
            "wake_up_calls": actor.calls["wake_up"], "tracker": _tracker(save_dir),
            "mismatches": mismatches[:5], "iteration": iteration,
            "rng_as_at_save_model": torch.equal(saved[0]["torch_rng_state"], rng_at_save),
            "rng_moved_meanwhile": not torch.equal(torch.get_rng_state(), rng_at_save)}


def failed_build_raises_at_wake_up(rank, world, save_dir, failing=None):
    """A build that fails (Megatron's `generate_state_dict` raises on the ranks in ``failing``,
    every rank by default) publishes nothing; the next `wake_up` raises the same
    `CheckpointError` on every rank, naming the iteration, the failing rank and the cause, at
    once (the ranks vote on their builds; a waiting rank does not sit out the group's timeout);
    the next save, awake, succeeds."""
    import time

    import torch.distributed as dist

    from safe_ckpt.errors import CheckpointError

    actor = _actor(rank, world, save_dir)
    from megatron.training import checkpointing as mck  # the stand-in, on the path once the actor is made

    original = mck.generate_state_dict

    def broken(*args, **kwargs):
        raise RuntimeError(f"state dict construction broke on rank {rank}")

    if failing is None or rank in failing:
        mck.generate_state_dict = broken
    try:
        actor.sleep()
        actor.save_model(5)
        start = time.monotonic()
        try:
            actor.wake_up()
            raised = None
        except CheckpointError as exc:
            raised = str(exc)
        waited_s = time.monotonic() - start
    finally:
        mck.generate_state_dict = original
    dist.barrier()
    after_failure = {"tracker": _tracker(save_dir), "entries": sorted(os.listdir(save_dir))}
    if raised is not None:  # the failed wake_up left the actor asleep: wake it as slime would retry
        actor.wake_up()
    actor.save_model(6, force_sync=True)
    dist.barrier()
    mismatches, iteration = actor.check_load(6)
    return {"raised": raised, "after_failure": after_failure, "mismatches": mismatches[:5], "iteration": iteration,
            "waited_s": waited_s}


def _weights_residences(actor):
    """Once the asleep save in flight is committed: what it read, by residence."""
    from safe_ckpt.integrations.slime_asleep import installed

    saves = installed(type(actor))
    inflight = saves.inflight if saves else None
    return None if inflight is None else dict(inflight.wait(BOUND_S).bytes_by_residence)


def asleep_save_equals_the_wake_up_path(rank, world, save_dir, awake_dir):
    """slime's layout after a train step: the asleep save reads the weights from slime's
    TensorBackuper (the parameters' region lost its bytes at sleep); slime's own wake-up path then
    saves the same iteration elsewhere; both checkpoints hold the same tensors, bit for bit."""
    import torch.distributed as dist

    from safe_ckpt.integrations.slime_asleep import installed

    actor = _actor(rank, world, save_dir)
    actor.capture_logs()
    actor.update_args({"mirror_train_step": True})
    actor.train(0)  # wake_up, a training step, the weights backed up, sleep
    poisoned = bool(actor._param_data.float().isnan().all())
    saves = installed(type(actor))
    actor.save_model(3)
    residences = _weights_residences(actor)
    asleep = {"wake_up_calls": actor.calls["wake_up"], "sleep_calls": actor.calls["sleep"]}
    actor.update_args({"safe_ckpt_save_awake": True, "save": awake_dir})
    actor.save_model(3)  # slime's path: wake_up (weights restored from the backuper), save, sleep
    dist.barrier()
    actor.update_args({"save": save_dir})
    differ = actor.check_same_as(3, awake_dir)
    return {"poisoned_while_asleep": poisoned, "residences": residences, "asleep": asleep,
            "after_awake": {"wake_up_calls": actor.calls["wake_up"]}, "differ": differ[:5], "n_differ": len(differ),
            "logged": [m for m in actor.logged() if "TensorBackuper" in m or "wakes the actor up" in m],
            "saves_installed": saves is not None}


def no_readable_source_takes_the_wake_up_path(rank, world, save_dir, ranks_without_copies):
    """On the ranks in ``ranks_without_copies`` a layout this code does not read while asleep: the
    parameters' region spills to disk at pause (`enable_disk_backup`) and the backuper keeps no
    host copies (slime's `_TensorBackuperNoop`). Every rank takes slime's wake-up path, with a
    WARNING naming the weights, and the checkpoint loads back as saved."""
    import torch.distributed as dist

    from tests.slime_mirror.utils.tensor_backper import TensorBackuper

    unknown = rank in ranks_without_copies
    actor = _actor(rank, world, save_dir, mirror={"mirror_param_buffer_backup": "disk" if unknown else None})
    actor.capture_logs()
    if unknown:
        getter = actor.weights_backuper._source_getter
        actor.weights_backuper = TensorBackuper.create(source_getter=getter, single_tag="actor")
        actor.weights_backuper.backup("actor")
    actor.sleep()
    actor.save_model(4)
    dist.barrier()
    warnings = [m for m in actor.logged() if "no readable source" in m]
    mismatches, iteration = actor.check_load(4)
    return {"wake_up_calls": actor.calls["wake_up"], "sleep_calls": actor.calls["sleep"], "warnings": warnings,
            "tracker": _tracker(save_dir), "mismatches": mismatches[:5], "iteration": iteration}
