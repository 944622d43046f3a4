"""Save while asleep: slime's train actor checkpoints from where offload left its state.

One job: with `--ckpt-backend safe`, replace slime's actor-level `save_model` (and wrap `sleep` and
`wake_up` of `MegatronTrainRayActor`, in the actor's process, without editing slime) so that an
actor whose training state is asleep saves it *without waking up*.

slime (since v0.3.0) brackets every checkpoint with `wake_up()` (torch_memory_saver.resume(): the
whole CPU backup copied back to the device, every process group rebuilt) and `sleep()`. The
asleep save instead reads paused regions from torch_memory_saver's CPU backup
(`unmapped_policy="cpu_backup"`) and host-resident optimizer state where it lives, coordinates over
a gloo backend that slime's group cycle cannot reach (`slime_groups.DetachedGloo`), answers
Megatron's rank queries from the groups as they were before sleep (`slime_groups.pinned_ranks`),
and returns as soon as the state dict is planned: the writes run in the background, at the
writers' nice level, while the rollout proceeds.

Which path a save takes (`awake_reason`): the asleep one when `--offload-train` is on, the actor is
asleep (its last `sleep()` has not been followed by `wake_up()`), and none of these holds, each of
which keeps slime's own wake-up path (a log line names the reason):
- `--safe-ckpt-save-awake`: the asleep save is turned off;
- `--save-hf` (actor role): the HF export reads the live model, which needs it awake;
- `--overlap-param-gather` with the distributed optimizer: the model's weights on the device are
  not current until the next forward's parameter all-gather (slime's `save` forces it with NCCL).

What is held back, and why (the rule): the asleep save reads bytes that the next `wake_up()` and
training step change or free: `torch_memory_saver.resume()` copies the CPU backup back to the
device and releases the backup the save reads from, and the next step changes host-resident
optimizer state. So `wake_up()` first waits until the in-flight asleep save has finished: every
byte written and the checkpoint committed (its last votes run on the detached group, which
outlives the reload, but the backup does not outlive the resume). Nothing else waits:
`update_weights()` (which reloads and destroys the process groups, and reads the rollout weights
from slime's own host copy) and the rollout run beside the save. A save that failed raises its
`CheckpointError` from that `wake_up()` (or from the next `save_model`, or a forced sync), as
Megatron's async saves raise at finalize.

Must not: wake the actor, touch paused device memory, use NCCL, or change slime's behaviour with
`--ckpt-backend megatron` or `--safe-ckpt-save-awake`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import threading
import time

from .. import compat
from . import slime_groups

log = logging.getLogger("safe_ckpt")

SLIME_ACTOR_MODULE = "slime.backends.megatron_utils.actor"
ACTOR_CLASS = "MegatronTrainRayActor"
WAIT_LOG_INTERVAL_S = 30.0


def awake_reason(args, asleep: bool, role: str | None) -> str | None:
    """Why this save must take slime's wake-up path, or None for the asleep save."""
    if not getattr(args, "offload_train", False):
        return "the training state is not offloaded (--offload-train is off)"
    if getattr(args, "safe_ckpt_save_awake", False):
        return "--safe-ckpt-save-awake is set"
    if getattr(args, "save_hf", None) is not None and role == "actor":
        return "--save-hf writes the HF model from the live weights, which needs the model awake"
    if getattr(args, "use_distributed_optimizer", False) and getattr(args, "overlap_param_gather", False):
        return ("--overlap-param-gather leaves the model's weights stale until a parameter all-gather "
                "on the device")
    if not asleep:
        return "the actor is awake"
    return None


def start_asleep_save(args, model, optimizer, opt_param_scheduler, iteration, group, snapshot):
    """Build Megatron's state dict for ``iteration`` with the ranks pinned to ``snapshot``, plan it
    over ``group`` and return the `SaveHandle` writing it in the background (tracker, retention)."""
    from megatron.training import checkpointing as mck

    from ..megatron import training

    if not getattr(args, "save", None):
        raise ValueError("--save is not set: there is nowhere to save the checkpoint")
    options = dataclasses.replace(training.options_from_args(args), unmapped_policy="cpu_backup")
    with slime_groups.pinned_ranks(snapshot):
        model = mck.unwrap_model(model)
        metadata = training._sharding_metadata(mck, args, None)
        training.check_sharding_type(args, optimizer, metadata)
        rng_state = training._rng_state(mck, args, {})
        state_dict = mck.generate_state_dict(
            args, model, optimizer, opt_param_scheduler, rng_state,
            **training._accepted(mck.generate_state_dict, {
                "iteration": iteration,
                "optim_sd_kwargs": dict(metadata=metadata),
                "model_sd_kwargs": dict(metadata=metadata),
                "rerun_state": training._rerun_state(args, None),
            }),
        )
        state_dict["num_floating_point_operations_so_far"] = 0  # what slime's save passes
        checkpoint_name = mck.get_checkpoint_name(args.save, iteration, release=False, return_base_dir=True)
        log.info("safe_ckpt: saving iteration %s asleep to %s (no wake-up; paused bytes from the CPU backup)",
                 iteration, checkpoint_name)
        return training.save_state(
            state_dict, args.save, checkpoint_name, str(iteration),
            content_metadata=compat.clean_content_metadata(metadata), options=options, async_save=True,
            process_group=group, retention=training.retention_from_args(args))


class AsleepSaves:
    """The asleep path of one train actor's process: whether it sleeps, the groups as they were
    before, the detached gloo group, and the save in flight."""

    def __init__(self, group: slime_groups.DetachedGloo, reloadable_module: str | None = None) -> None:
        self.group = group
        self.reloadable_module = reloadable_module
        self.asleep = False
        self.snapshot: slime_groups.RankSnapshot | None = None
        self.inflight = None
        self.inflight_iteration = None
        self.waiting = threading.Event()  # set while a wake_up waits for the save (observable)
        self.last_hold_s = 0.0  # save_model's own time on the asleep path
        self.last_wake_wait_s = 0.0

    def finish_inflight(self, why: str) -> None:
        """Wait for the asleep save in flight (logging while it runs); raise its error."""
        from ..megatron import training

        handle = self.inflight
        if handle is None:
            return
        start = time.monotonic()
        if not handle.done():
            self.waiting.set()
            log.info("safe_ckpt: %s waits for the asleep save of iteration %s to finish writing",
                     why, self.inflight_iteration)
            while not handle.done():
                try:
                    handle.wait(timeout=WAIT_LOG_INTERVAL_S)
                except TimeoutError:
                    log.info("safe_ckpt: %s still waiting for the asleep save of iteration %s (%.0f s)",
                             why, self.inflight_iteration, time.monotonic() - start)
                except Exception:  # its error is raised below, once it is taken off the pending list
                    break
        self.inflight = None
        self.last_wake_wait_s = time.monotonic() - start
        self.waiting.clear()
        if self.last_wake_wait_s > 0.001:
            log.info("safe_ckpt: %s held %.3f s by the asleep save of iteration %s", why,
                     self.last_wake_wait_s, self.inflight_iteration)
        training.finalize_async_saves(blocking=True)

    def save_model(self, actor, original, rollout_id, force_sync=False):
        args = actor.args
        if getattr(args, "debug_rollout_only", False):
            return original(actor, rollout_id, force_sync=force_sync)
        reason = awake_reason(args, self.asleep, getattr(actor, "role", None))
        if reason is not None:
            level = logging.INFO if getattr(args, "offload_train", False) and self.asleep else logging.DEBUG
            log.log(level, "safe_ckpt: saving iteration %s through slime's wake-up path: %s", rollout_id, reason)
            return original(actor, rollout_id, force_sync=force_sync)
        start = time.monotonic()
        self.finish_inflight("save_model")
        if args.async_save:
            from megatron.training.async_utils import maybe_finalize_async_save

            maybe_finalize_async_save(blocking=True)
        self.inflight = start_asleep_save(args, actor.model, actor.optimizer, actor.opt_param_scheduler,
                                          rollout_id, self.group, self.snapshot)
        self.inflight_iteration = rollout_id
        self.last_hold_s = time.monotonic() - start
        log.info("safe_ckpt: save_model(%s) returned after %.3f s; writing goes on while the actor sleeps",
                 rollout_id, self.last_hold_s)
        if force_sync:
            self.finish_inflight("save_model(force_sync=True)")

    def sleep(self, actor, original, *args, **kwargs):
        snapshot = slime_groups.snapshot_groups(self.reloadable_module)  # before sleep destroys them
        result = original(actor, *args, **kwargs)
        self.snapshot, self.asleep = snapshot, True
        return result

    def wake_up(self, actor, original, *args, **kwargs):
        self.finish_inflight("wake_up")
        self.asleep = False
        return original(actor, *args, **kwargs)


def _wrap(cls, name: str, saves: AsleepSaves) -> None:
    original = getattr(cls, name)
    if getattr(original, "_safe_ckpt_asleep", None) is not None:
        original = original._safe_ckpt_original
    handler = getattr(saves, name)

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        return handler(self, original, *args, **kwargs)

    method._safe_ckpt_asleep = saves
    method._safe_ckpt_original = original
    setattr(cls, name, method)


def install_on_actor(args, actor_module: str | None = None) -> AsleepSaves | None:
    """Put the asleep path on slime's train actor class in this process (collective: every train
    actor creates the detached group together). None when it does not apply."""
    if not getattr(args, "offload_train", False) or getattr(args, "safe_ckpt_save_awake", False):
        return None
    name = actor_module or getattr(args, "safe_ckpt_actor_module", None) or SLIME_ACTOR_MODULE
    try:
        cls = getattr(importlib.import_module(name), ACTOR_CLASS)
    except (ImportError, AttributeError) as exc:
        log.warning("safe_ckpt: no %s.%s to put the asleep save on (%s): saves wake the actor up as slime does",
                    name, ACTOR_CLASS, exc)
        return None
    slime_groups.install_detached_support()
    timeout_s = float(getattr(args, "safe_ckpt_timeout_s", None) or 600.0)
    saves = AsleepSaves(slime_groups.create_detached_gloo(timeout_s),
                        getattr(args, "safe_ckpt_reloadable_module", None))
    for method in ("save_model", "sleep", "wake_up"):
        _wrap(cls, method, saves)
    log.info("safe_ckpt: %s.%s saves asleep without waking up (--safe-ckpt-save-awake turns it off)",
             name, ACTOR_CLASS)
    return saves


def installed(cls) -> AsleepSaves | None:
    """The asleep path installed on ``cls`` in this process, if any."""
    return getattr(getattr(cls, "save_model", None), "_safe_ckpt_asleep", None)
