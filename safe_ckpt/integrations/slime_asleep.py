"""Save while asleep: slime's train actor checkpoints from where offload left its state.

One job: with `--ckpt-backend safe`, replace slime's actor-level save path (`MegatronTrainRayActor`'s
`wake_up`/`sleep` around its `save_model`, and the `save_checkpoint` its `save` calls; in the
actor's process, without editing slime) so that an actor whose training state is asleep saves it
*without waking up*.

slime (since v0.3.0) brackets every checkpoint with `wake_up()` (torch_memory_saver.resume(): the
whole CPU backup copied back to the device, every process group rebuilt) and `sleep()`. The
asleep save instead reads every byte from where slime keeps it while asleep: the model weights
from slime's own host copies (its `TensorBackuper`, `slime_sources`: in slime's layout the
parameters' region has no CPU backup), other paused regions from torch_memory_saver's CPU backup
(`unmapped_policy="cpu_backup"`), and host-resident optimizer state where it lives; it coordinates over
a gloo backend that slime's group cycle cannot reach (`slime_groups.DetachedGloo`), answers
Megatron's rank queries from the groups as they were before sleep (`slime_groups.pinned_ranks`),
and returns at once: the state dict is built and planned in a thread (`StartingSave`; the RNG
state is taken first, in the caller) and the writes run in the background, at the writers' nice
level, while the rollout proceeds.

Which path a save takes (`awake_reason`): the asleep one when `--offload-train` is on, the actor is
asleep (its last `sleep()` has not been followed by `wake_up()`), and none of these holds, each of
which keeps slime's own wake-up path (a log line names the reason):
- `--safe-ckpt-save-awake`: the asleep save is turned off;
- `--save-hf` (actor role): the HF export reads the live model, which needs it awake;
- `--overlap-param-gather` with the distributed optimizer: the model's weights on the device are
  not current until the next forward's parameter all-gather (slime's `save` forces it with NCCL);
- some tensor of the training state has no readable source while asleep (`slime_sources`: paused
  memory with neither a backup nor a matched copy of slime's, e.g. a disk-backed region or a
  backuper without host copies): a WARNING names the tensors. The ranks agree on the path over
  the detached group, so every rank wakes up or none does.

What is held back, and why (the rule): the asleep save reads bytes that the next `wake_up()` and
training step change or free: `torch_memory_saver.resume()` copies the CPU backup back to the
device, after which the backup buffer the save reads from is the saver's to free or reuse, and
the next step changes host-resident optimizer state (and, once resumed, the device copy). So `wake_up()` first waits until the in-flight asleep save has finished: every
byte written and the checkpoint committed (its last votes run on the detached group, which
outlives the reload, but the backup does not outlive the resume). Nothing else waits:
`update_weights()` (which reloads and destroys the process groups, and reads the rollout weights
from slime's own host copy) and the rollout run beside the save. A save that failed raises its
`CheckpointError` from that `wake_up()` (or from the next `save_model`, or a forced sync), as
Megatron's async saves raise at finalize: one rollout and `update_weights()` after the failure,
which is logged at once. The ranks vote on their state-dict builds before planning, so a build
that fails on one rank fails every rank with the same error. A failure that nobody is told about
before the process exits (no later `wake_up`, forced save or `save_model`) counts at exit like
a failed asynchronous save: the process exits with status 1 (`safe_ckpt.saving.handle`).

"Asleep" is what the actor's own code did last: slime calls `self.sleep()` at the end of `init`,
`train` and `save_model` and `self.wake_up()` at the start of `train` (and in `update_weights` when
it reconnects a non-colocated critic); those calls are hooked. A call the driver sends through Ray
(`RayTrainGroup.offload()` / `onload()`) runs the method Ray resolved when it created the actor
and is not seen: an `offload()` leaves the next save on slime's wake-up path (safe); an `onload()`
reaches `torch_memory_saver.resume()`, which is guarded (`slime_resume_guard`): it waits for the
asleep save like a hooked `wake_up()`, and the next save takes slime's wake-up path.

Must not: wake the actor, touch paused device memory, use NCCL, or change slime's behaviour with
`--ckpt-backend megatron` or `--safe-ckpt-save-awake`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import sys
import threading
import time
from dataclasses import dataclass

from .. import compat
from ..coord import dist as safe_dist
from ..residence import classify as residence
from ..errors import ValidationError, failure_from_exception
from . import slime_groups, slime_load, slime_sources
from .slime_resume_guard import guard_resume
from .slime_starting import StartingSave, build_failure, checkpoint_dir

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


def capture_rng_state(args, snapshot):
    """The RNG state the checkpoint records, taken now: a state dict built later, in the
    background, would otherwise record whatever the process's generators hold by then."""
    from megatron.training import checkpointing as mck

    from ..megatron import training

    with slime_groups.pinned_ranks(snapshot):
        return training._rng_state(mck, args, {})


def start_asleep_save(args, model, optimizer, opt_param_scheduler, iteration, group, snapshot, rng_state=None,
                      copies: slime_sources.WeightCopies | None = None,
                      without_backup: slime_sources.RegionsWithoutBackup | None = None):
    """Build Megatron's state dict for ``iteration`` with the ranks pinned to ``snapshot``, plan it
    over ``group`` and return the `SaveHandle` writing it in the background (tracker, retention).
    ``rng_state``: from `capture_rng_state` when the call runs later than the save was asked for.
    ``copies``: slime's host copies of the weights (`slime_sources.check_sources`), read in place
    of the parameters. ``without_backup``: the regions torch_memory_saver must not be asked about.

    Collective from the start: every rank votes on its build before planning, so a build that
    fails on one rank fails every rank at once with the same error (naming that rank, the
    iteration and the cause), not only after the planning exchange's timeout."""
    from megatron.training import checkpointing as mck

    from ..megatron import training

    if not getattr(args, "save", None):
        raise ValidationError("--save is not set: there is nowhere to save the checkpoint")
    # asleep, nothing trains until the save ends (it holds wake_up): no copy window to overlap
    options = training.options_from_args(args)
    options = dataclasses.replace(options, unmapped_policy="cpu_backup", return_after="staged",
                                  safe_globals=(*options.safe_globals, *slime_load.classes_in_args(args)))
    stage = f"building the asleep state dict of iteration {iteration}"
    coord = group.coordinator(f"asleep build {iteration}") if isinstance(group, slime_groups.DetachedGloo) \
        else safe_dist.coordinator(group, options.collective_timeout_s, f"asleep build {iteration}")
    failure = state_dict = metadata = None
    try:
        with slime_groups.pinned_ranks(snapshot):
            model = mck.unwrap_model(model)
            metadata = training._sharding_metadata(mck, args, None)
            training.check_sharding_type(args, optimizer, metadata)
            if rng_state is None:
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
    except Exception as exc:  # voted below: every rank raises it
        failure = failure_from_exception(coord.rank, stage, exc)
    coord.vote(stage, failure)
    state_dict["num_floating_point_operations_so_far"] = 0  # what slime's save passes
    checkpoint_name = mck.get_checkpoint_name(args.save, iteration, release=False, return_base_dir=True)
    log.info("saving iteration %s asleep to %s (no wake-up; %spaused bytes from the CPU backup)",
             iteration, checkpoint_name, "weights from slime's TensorBackuper, " if copies is not None else "")
    reading = residence.host_copies(copies.lookup, slime_sources.COPIES_WHAT) if copies is not None \
        else contextlib.nullcontext()
    with slime_groups.pinned_ranks(snapshot), reading, slime_sources.guarded(without_backup):  # classified while planning
        return training.save_state(
            state_dict, args.save, checkpoint_name, str(iteration),
            content_metadata=compat.clean_content_metadata(metadata), options=options, async_save=True,
            process_group=group, retention=training.retention_from_args(args))


@dataclass(frozen=True)
class Bracket:
    """A `save_model` whose `wake_up()` was skipped: its `save` goes asleep, its `sleep()` is a no-op."""

    iteration_started_s: float
    force_sync: bool
    copies: slime_sources.WeightCopies | None = None  # slime's host copies of the weights, if it keeps them
    without_backup: slime_sources.RegionsWithoutBackup | None = None


def _is_save_model_body(frame, module_file: str | None) -> bool:
    """Whether ``frame`` runs slime's `MegatronTrainRayActor.save_model` itself (slime's `@timer`
    wraps the method from outside, so its own `self.wake_up()` call comes straight from the body)."""
    code = frame.f_code if frame is not None else None
    return code is not None and code.co_name == "save_model" and (module_file is None or code.co_filename == module_file)


class AsleepSaves:
    """The asleep path of one train actor's process: whether it sleeps, the groups as they were
    before, the detached gloo group, the save in flight, and the `save_model` under way.

    It hooks what slime's `save_model` calls, not `save_model` itself: Ray resolves an actor's
    methods once, when the actor is created (before `install` runs in its `init`), so a replaced
    `save_model` would never be called from the driver; the calls inside it look the methods up
    on every call. `save_model`'s `self.wake_up()` is skipped (the `Bracket` begins), its
    `save(...)` reaches `save_checkpoint`, which starts the asleep save, and its `self.sleep()` is
    skipped (the bracket ends; with `force_sync` the save is finished first).
    """

    def __init__(self, group: slime_groups.DetachedGloo, reloadable_module: str | None = None,
                 actor_file: str | None = None) -> None:
        self.group = group
        self.reloadable_module = reloadable_module
        self.actor_file = actor_file
        self.asleep = False
        self.snapshot: slime_groups.RankSnapshot | None = None
        self.bracket: Bracket | None = None
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
            log.info("%s waits for the asleep save of iteration %s to finish writing",
                     why, self.inflight_iteration)
            while not handle.done():
                try:
                    handle.wait(timeout=WAIT_LOG_INTERVAL_S)
                except TimeoutError:
                    log.info("%s still waiting for the asleep save of iteration %s (%.0f s)",
                             why, self.inflight_iteration, time.monotonic() - start)
                except Exception:  # its error is raised below, once it is taken off the pending list
                    break
        if self.inflight is handle:  # a waiter in another thread may have moved on to a later save
            self.inflight = None
        self.last_wake_wait_s = time.monotonic() - start
        self.waiting.clear()
        if self.last_wake_wait_s > 0.001:
            log.info("%s held %.3f s by the asleep save of iteration %s", why,
                     self.last_wake_wait_s, self.inflight_iteration)
        failure = build_failure(handle)
        if failure is not None:
            log.error("%s", failure)
            raise failure
        training.finalize_async_saves(blocking=True)

    def before_resume(self) -> None:
        """torch_memory_saver is about to copy the backup back (and free or reuse it), from any
        caller: the save in flight finishes first, and the actor counts as awake after."""
        while self.inflight is not None:  # a save started while this one waited is waited for too
            self.finish_inflight("torch_memory_saver.resume")
        self.asleep = False

    def wake_up(self, actor, original, caller, *args, **kwargs):
        if _is_save_model_body(caller, self.actor_file):
            reason = awake_reason(actor.args, self.asleep, getattr(actor, "role", None))
            if reason is None:
                called = time.monotonic()  # a wait for the previous save holds the loop too
                self.finish_inflight("save_model")  # one save at a time
                check, reason = self.check_sources(actor)
                if reason is None:
                    self.bracket = Bracket(called, bool(caller.f_locals.get("force_sync", False)), check.copies,
                                           check.without_backup)
                    return None
                log.warning("save_model wakes the actor up, as slime does: %s", reason)
            elif self.asleep:
                log.info("save_model wakes the actor up, as slime does: %s", reason)
        self.bracket = None
        self.finish_inflight("wake_up")
        self.asleep = False
        return original(actor, *args, **kwargs)

    def check_sources(self, actor):
        """Every rank's sources checked (`slime_sources`), and agreed on over the detached group:
        (check, None) when every rank can save asleep, else (check, the reason to wake up)."""
        try:
            with slime_groups.pinned_ranks(self.snapshot):  # slime's getter asks the model-parallel ranks
                check = slime_sources.check_sources(actor, actor.args)
            mine = check.reason() if check.unreadable else None
        except Exception as exc:  # a layout this code does not know: slime's own path is always safe
            check, mine = None, f"the sources could not be checked ({type(exc).__name__}: {exc})"
        if isinstance(self.group, slime_groups.DetachedGloo):
            theirs = self.group.coordinator("asleep sources").exchange("asleep sources", mine)
            others = [f"rank {r}: {why}" for r, why in enumerate(theirs) if why is not None and r != self.group.rank]
            if others and mine is None:
                mine = "; ".join(others)
            elif others:
                mine = f"{mine}; and {'; '.join(others)}"
        if check is not None and check.copies is not None and mine is None:
            log.info("the model weights are read from %s (%d bytes)", slime_sources.COPIES_WHAT,
                     check.copies.copy_bytes)
        return check, mine

    def sleep(self, actor, original, caller, *args, **kwargs):
        bracket = self.bracket
        if bracket is not None and _is_save_model_body(caller, self.actor_file):
            self.bracket = None
            if bracket.force_sync:
                self.finish_inflight("save_model(force_sync=True)")
            self.last_hold_s = time.monotonic() - bracket.iteration_started_s
            log.info("save_model returned after %.3f s without waking up%s", self.last_hold_s,
                     "" if bracket.force_sync else "; the writes go on while the actor sleeps")
            return None
        snapshot = slime_groups.snapshot_groups(self.reloadable_module)  # before sleep destroys them
        result = original(actor, *args, **kwargs)
        self.snapshot, self.asleep = snapshot, True
        guard_resume(self)  # slime has imported torch_memory_saver by now, if it uses it
        return result

    def routing(self, awake_save_checkpoint):
        """The `save_checkpoint` slime's `save` calls: the asleep save inside a bracket, else ``awake_save_checkpoint``."""

        @functools.wraps(awake_save_checkpoint)
        def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, *args, **kwargs):
            if self.bracket is None or self.inflight is not None:
                return awake_save_checkpoint(iteration, model, optimizer, opt_param_scheduler, *args, **kwargs)
            from megatron.training.global_vars import get_args

            args, snapshot, group, bracket = get_args(), self.snapshot, self.group, self.bracket
            rng_state = capture_rng_state(args, snapshot)
            self.inflight = StartingSave(lambda: start_asleep_save(
                args, model, optimizer, opt_param_scheduler, iteration, group, snapshot, rng_state=rng_state,
                copies=bracket.copies, without_backup=bracket.without_backup), iteration, checkpoint_dir(args, iteration))
            self.inflight_iteration = iteration
            return self.inflight

        save_checkpoint._safe_ckpt_asleep = self
        return save_checkpoint


def _wrap(cls, name: str, saves: AsleepSaves) -> None:
    original = getattr(cls, name)
    if getattr(original, "_safe_ckpt_asleep", None) is not None:
        original = original._safe_ckpt_original
    handler = getattr(saves, name)

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        return handler(self, original, sys._getframe(1), *args, **kwargs)

    method._safe_ckpt_asleep = saves
    method._safe_ckpt_original = original
    setattr(cls, name, method)


def _with_subclasses(cls) -> list:
    """``cls`` and every subclass that exists now. Ray runs an actor as an instance of a subclass it
    makes of the class, with its own copy of each method (resolved when the actor was created):
    the methods the actor's own code calls must be replaced there too."""
    found, todo = [], [cls]
    while todo:
        current = todo.pop()
        if current not in found:
            found.append(current)
            todo.extend(current.__subclasses__())
    return found


def install_on_actor(args, actor_module: str | None = None) -> AsleepSaves | None:
    """Put the asleep path on slime's train actor class in this process (collective: every train
    actor creates the detached group together). None when it does not apply."""
    if not getattr(args, "offload_train", False) or getattr(args, "safe_ckpt_save_awake", False):
        return None
    name = actor_module or getattr(args, "safe_ckpt_actor_module", None) or SLIME_ACTOR_MODULE
    try:
        module = importlib.import_module(name)
        cls = getattr(module, ACTOR_CLASS)
    except (ImportError, AttributeError) as exc:
        log.warning("no %s.%s to put the asleep save on (%s): saves wake the actor up as slime does",
                    name, ACTOR_CLASS, exc)
        return None
    slime_groups.install_detached_support()
    timeout_s = float(getattr(args, "safe_ckpt_timeout_s", None) or 600.0)
    saves = AsleepSaves(slime_groups.create_detached_gloo(timeout_s),
                        getattr(args, "safe_ckpt_reloadable_module", None), getattr(module, "__file__", None))
    for target in _with_subclasses(cls):
        for method in ("sleep", "wake_up"):
            if method in vars(target):
                _wrap(target, method, saves)
    guard_resume(saves)
    log.info("%s.%s saves asleep without waking up (--safe-ckpt-save-awake turns it off)",
             name, ACTOR_CLASS)
    return saves


def installed(cls) -> AsleepSaves | None:
    """The asleep path installed on ``cls`` in this process, if any."""
    return getattr(getattr(cls, "wake_up", None), "_safe_ckpt_asleep", None)
