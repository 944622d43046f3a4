"""Drop-in for `megatron.training.checkpointing.save_checkpoint` (`--ckpt-format torch_dist`).

One job: build the state dict exactly as Megatron's own save does (its
`generate_state_dict`, `get_rng_state`, sharding metadata, rerun state) and write it
with safe_ckpt: `iter_XXXXXXX/` with the common state, `content_metadata`, then the
tracker file `latest_checkpointed_iteration.txt` last, all with no NCCL collective and
no host-to-device copy. Megatron-LM's `megatron.training` must be importable (as it is
wherever Megatron training runs); the core of the path, `save_state`, needs only
megatron-core.

Must not: call Megatron's `dist_checkpointing.save`, NCCL barriers, or anything that
moves tensors to the device.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import threading

from .. import compat
from . import overlap, resume
from .. import targets
from .. import saving as save_mod
from ..errors import MissingDependencyError, ValidationError, failure_from_exception
from ..names import RELEASE_DIR, SHARDED_BACKEND
from ..options import GiB, SaveOptions, checked as checked_save_options
from .loading import optimizer_classes
from ..results import SaveResult
from ..targets.retention import Retention, prune
from ..sinks.tensorstore import resolve_target
from ..staging import gates

log = logging.getLogger("safe_ckpt")

# Distributed-optimizer formats whose state-dict construction is safe: no gathers, no device copies.
SAFE_SHARDING_TYPES = ("dp_reshardable",)
REFUSED_SHARDING_TYPES = {
    "fully_reshardable": (
        "its state dict is built by gathering every rank's optimizer state through .cuda() and an NCCL "
        "all_gather (or a gloo gather to data-parallel rank 0), i.e. host-to-device copies into memory "
        "the offloader may have paused; save with the default dp_reshardable format (drop "
        "--dist-ckpt-optim-fully-reshardable) and reshard offline with stock Megatron if needed"
    ),
    "dp_zero_gather_scatter": (
        "its state dict is built by gathering optimizer state to data-parallel rank 0 over NCCL; "
        "save with the default dp_reshardable format"
    ),
    "fully_sharded_model_space": (
        "it stores flattened-range shards (megatron-core <= 0.15) that need device gathers; "
        "save with dp_reshardable (megatron-core >= 0.15)"
    ),
}

_pending_lock = threading.Lock()
_pending: list = []


def options_from_args(args, model=None) -> SaveOptions:
    """SaveOptions from Megatron args (the `--safe-ckpt-*` flags, where registered).
    `--safe-ckpt-overlap-copy` with `--async-save` sets ``return_after="planned"`` where the save is
    eligible (`overlap`; ``model``: Megatron's model chunks, for its param-gather rule)."""
    budget = getattr(args, "safe_ckpt_staging_budget_gib", None)
    integrity = bool(getattr(args, "verify_integrity", False))
    if integrity and not compat.stock_integrity_manifest():
        log.warning("--verify-integrity is set but the installed megatron-core (%s) cannot check "
                    "integrity.json on load (0.18 and later can); it is written anyway", compat.megatron_version())
    return SaveOptions(
        io_threads=getattr(args, "safe_ckpt_io_threads", None),  # None: from the rank's share of its host
        staging_budget_bytes=int(budget * GiB) if budget else None,
        unmapped_policy=getattr(args, "safe_ckpt_unmapped_policy", None) or "error",
        collective_timeout_s=float(getattr(args, "safe_ckpt_timeout_s", None) or 600.0),
        writer_nice=getattr(args, "safe_ckpt_writer_nice", None),
        integrity_manifest=integrity,  # Megatron's --verify-integrity: integrity.json as its own save writes it
        return_after=overlap.return_after(args, model),
        safe_globals=optimizer_classes(),  # what `load_options_from_args` admits: a save it cannot read is refused
    )


def save_target(save: str, options: SaveOptions, environ) -> tuple:
    """``--save`` as (save root, options), by the rule every entry point follows
    (`safe_ckpt.targets.endpoints`): an `s3://bucket/prefix` URL with `AWS_ENDPOINT_URL_S3` (or
    `AWS_ENDPOINT_URL`) set goes to that S3-compatible endpoint; the root is then the prefix
    inside `options.kvstore_spec`. Other URLs and paths pass unchanged."""
    return _endpoints().save_target(save, options, environ)


def _endpoints():
    from ..targets import endpoints  # the one rule for every entry point

    return endpoints


def check_sharding_type(args, optimizer, metadata: dict | None) -> None:
    """Refuse distributed-optimizer formats whose construction would use the device."""
    if optimizer is None or getattr(args, "no_save_optim", False):
        return
    if not getattr(args, "use_distributed_optimizer", False):
        return
    kind = (metadata or {}).get("distrib_optim_sharding_type")
    if kind in REFUSED_SHARDING_TYPES:
        raise ValidationError(
            f"safe_ckpt cannot save the distributed optimizer in the {kind!r} format: "
            f"{REFUSED_SHARDING_TYPES[kind]}"
        )
    if kind is not None and kind not in SAFE_SHARDING_TYPES:
        raise ValidationError(f"unknown distributed-optimizer sharding type {kind!r}; safe_ckpt writes "
                              f"{', '.join(SAFE_SHARDING_TYPES)}")


def retention_from_args(args) -> Retention:
    """--safe-ckpt-keep-last / --safe-ckpt-keep-every, or Megatron's --save-retain-interval
    (keep the newest and every interval-th, as Megatron does)."""
    keep_last = getattr(args, "safe_ckpt_keep_last", None)
    keep_every = getattr(args, "safe_ckpt_keep_every", None)
    if keep_last is None and keep_every is None and getattr(args, "save_retain_interval", None):
        return Retention(keep_last=1, keep_every=args.save_retain_interval)
    return Retention(keep_last=keep_last, keep_every=keep_every)


def note_loaded_from_args(args) -> None:
    """Record the checkpoint Megatron's `load_checkpoint` read with ``args`` (`--load` or
    `--pretrained-checkpoint`, `--ckpt-step` or the tracker; see `resume`), unless this process
    already said what it loaded (`resume.note_loaded`). `save_checkpoint` calls it before its
    first save; a load path may call it right after loading, when the tracker it reads is still
    the one the load read."""
    if resume.noted():
        return

    def place(path: str) -> targets.Target:  # the load root resolved as the save root is (an s3:// URL at an endpoint)
        root, opts = save_target(path, SaveOptions(), os.environ)
        return targets.resolve(root, spec=opts.kvstore_spec, settings=targets.TargetSettings.of(opts))

    loaded = resume.loaded_from_args(args, read_tracker=lambda d: resume.tracker_text(place(d)))
    if loaded is None:
        resume.note_loaded(None)
        return
    checkpoint = place(loaded)
    resume.note_loaded(checkpoint.location.path, kvstore_spec=checkpoint.location.spec)


def save_state(state_dict: dict, save_dir: str, checkpoint_dir: str, tracker_value: str, *,
               content_metadata: dict | None = None, options: SaveOptions | None = None,
               async_save: bool = False, process_group=None, retention: Retention | None = None,
               copy_start: str = "now"):
    """Write a Megatron training state dict to ``checkpoint_dir``, then point the tracker file
    in ``save_dir`` at it (rank 0, after every rank's data is durable), then apply
    ``retention`` to older iterations. Collective.

    Returns the `SaveResult`, or with ``async_save`` a `SaveHandle` that finishes in the
    background (tracker and retention included); `finalize_async_saves()` waits for it.
    ``copy_start``: with ``options.return_after="planned"``, when the copies start ("deferred": at
    the next `staging.gates.open_deferred()`, e.g. the optimizer's `zero_grad`; see `saving.start`).
    """
    options = checked_save_options(options)
    save_dir, checkpoint_dir, options = _endpoints().save_state_targets(save_dir, checkpoint_dir, options)
    root = targets.resolve(save_dir, spec=options.kvstore_spec, settings=targets.TargetSettings.of(options))
    resumed = resume.protected(root)  # before this save moves the tracker

    def write_tracker(coord) -> None:
        failure = None
        if coord.rank == 0:
            try:
                root.write_tracker(tracker_value)
            except Exception as exc:
                failure = failure_from_exception(0, "tracker", exc)
        coord.vote("tracker", failure)
        if coord.rank == 0 and retention is not None and tracker_value.isdigit():
            prune(root, int(tracker_value), retention, resumed_from=resumed)  # once the new one is current

    job = save_mod.start(state_dict, checkpoint_dir, process_group=process_group, options=options,
                         content_metadata=content_metadata, post_commit=write_tracker, asynchronous=async_save,
                         copy_start=copy_start)
    if not async_save:
        return job.finish()
    handle = job.in_background()
    with _pending_lock:
        _pending.append(handle)
    return handle


def finalizing_too(maybe_finalize_async_save):
    """Megatron's ``maybe_finalize_async_save`` made to finish safe_ckpt's asynchronous saves too
    (they are not in Megatron's queue), for ``pretrain()``'s loop:
    ``megatron_training.maybe_finalize_async_save = finalizing_too(megatron_training.maybe_finalize_async_save)``.
    Wrapping twice is a no-op."""
    if getattr(maybe_finalize_async_save, "_safe_ckpt", False):
        return maybe_finalize_async_save

    def finalizing(*args, **kwargs):
        blocking = kwargs.get("blocking", args[0] if args else False)
        try:
            finalize_async_saves(blocking=bool(blocking))
        finally:  # Megatron's own saves are finished (and terminated at the end) whatever ours did
            result = maybe_finalize_async_save(*args, **kwargs)
        return result

    finalizing._safe_ckpt = True
    return finalizing


def finalize_async_saves(blocking: bool = True) -> list[SaveResult]:
    """Finish the asynchronous saves started here; raises the first failure.

    Call it where Megatron calls `maybe_finalize_async_save` (safe_ckpt's saves are not in
    Megatron's queue). With ``blocking=False`` only finished saves are collected. A save whose
    copies still wait for the next training step (`--safe-ckpt-overlap-copy`) starts them first.
    """
    gates.open_deferred()
    with _pending_lock:
        handles = list(_pending)
    results = []
    for handle in handles:
        if not blocking and not handle.done():
            continue
        with _pending_lock:
            if handle in _pending:
                _pending.remove(handle)
        results.append(handle.wait())
    return results


def _accepted(fn, kwargs: dict) -> dict:
    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _sharding_metadata(mck, args, dp_cp_group):
    build = getattr(mck, "_build_sharded_state_dict_metadata", None)
    if build is None:
        return None
    return build(args, **_accepted(build, {"dp_cp_group": dp_cp_group}))


def _rng_state(mck, args, groups: dict):
    from megatron.core import mpu

    if getattr(args, "data_parallel_random_init", False) and mpu.get_data_parallel_world_size() > 1:
        raise ValidationError(
            "--data-parallel-random-init makes Megatron gather RNG states over the data-parallel NCCL "
            "group while saving; the safe backend does not support it (save with --no-save-rng, or use "
            "the same RNG across data-parallel ranks)"
        )
    get = mck.get_rng_state
    kwargs = {"tp_group": groups.get("tp_group") or mpu.get_tensor_model_parallel_group(),
              "pp_group": groups.get("pp_group") or mpu.get_pipeline_model_parallel_group()}
    for name in ("dp_cp_group", "dp_group"):
        if groups.get(name) is not None:
            kwargs[name] = groups[name]
    return get(args.ckpt_format, **_accepted(get, kwargs))


def _rerun_state(args, data_iterator):
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    machine = get_rerun_state_machine()
    return machine.state_dict(**_accepted(machine.state_dict, {"data_iterator": data_iterator,
                                                               "ckpt_format": args.ckpt_format}))


def _megatron_training():
    """Megatron-LM's `checkpointing` module and `get_args`, or an error naming the remedy."""
    try:
        from megatron.training import checkpointing as mck
        from megatron.training.global_vars import get_args
    except ModuleNotFoundError as exc:
        if exc.name not in ("megatron", "megatron.training"):
            raise MissingDependencyError(
                f"safe_ckpt.megatron.save_checkpoint: importing Megatron-LM's megatron.training failed: no module "
                f"named {exc.name!r}, which it needs; install it (see Megatron-LM's requirements)") from exc
        raise MissingDependencyError(
            "safe_ckpt.megatron.save_checkpoint needs Megatron-LM's megatron.training, which is not installed "
            f"(megatron-core {compat.package_version('megatron-core') or 'is not installed either'}): install "
            "megatron-core >= 0.19, which ships megatron.training, or put a Megatron-LM checkout on PYTHONPATH; "
            "safe_ckpt.megatron.save_state needs megatron-core only") from exc
    from .loading import remember_stock_loader

    remember_stock_loader(mck)  # before a user installs safe_ckpt's loader in its place
    return mck, get_args


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far=0,
                    checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None,
                    pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False,
                    train_data_iterator=None, preprocess_common_state_dict_fn=None, release=False,
                    safe_globals: tuple = (), **kwargs):
    """`megatron.training.checkpointing.save_checkpoint`, written by safe_ckpt.

    Same arguments and the same on-disk result for `--ckpt-format torch_dist`; honours
    `--save`, `--no-save-optim`, `--no-save-rng`, `--verify-integrity` (`integrity.json`) and
    `--async-save` (then it returns a handle and finishes in the background: call
    `finalize_async_saves()`). Retention keeps the checkpoint this run loaded (`resume`).
    With `--safe-ckpt-overlap-copy` too it returns right after planning; the copies start at the
    optimizer's next `zero_grad()` and its next step waits for what is left (`overlap`).
    ``safe_globals``: classes the state may hold beyond those Megatron's loader admits, for a
    caller whose loaders admit them too (`SaveOptions.safe_globals`).
    """
    mck, get_args = _megatron_training()
    args = get_args()
    if getattr(args, "ckpt_format", SHARDED_BACKEND) != SHARDED_BACKEND:
        raise ValidationError(f"safe_ckpt writes --ckpt-format {SHARDED_BACKEND}, not {args.ckpt_format!r}")
    if non_persistent_ckpt:
        raise ValidationError("non-persistent checkpoints are not supported by the safe backend")
    if not getattr(args, "save", None):
        raise ValidationError("--save is not set: there is nowhere to save the checkpoint")
    finalize_async_saves(blocking=True)  # one save at a time, as Megatron's queue enforces
    options = options_from_args(args)
    if safe_globals:
        options = dataclasses.replace(options, safe_globals=(*options.safe_globals, *safe_globals))
    if options.return_after == "planned" and overlap.return_after(args, model) != "planned":
        options = dataclasses.replace(options, return_after="staged")  # before unwrapping: the DDP buckets
    deferred = bool(getattr(args, "async_save", False)) and options.return_after == "planned"
    if deferred:
        overlap.install_trigger(optimizer)

    model = mck.unwrap_model(model)
    metadata = _sharding_metadata(mck, args, kwargs.get("dp_cp_group"))
    check_sharding_type(args, optimizer, metadata)
    rng_state = _rng_state(mck, args, kwargs)
    state_dict = mck.generate_state_dict(
        args, model, optimizer, opt_param_scheduler, rng_state,
        **_accepted(mck.generate_state_dict, {
            "iteration": iteration,
            "optim_sd_kwargs": dict(metadata=metadata),
            "model_sd_kwargs": dict(metadata=metadata),
            "rerun_state": _rerun_state(args, train_data_iterator),
        }),
    )
    state_dict["num_floating_point_operations_so_far"] = num_floating_point_operations_so_far
    save_root, options = save_target(args.save, options, os.environ)
    note_loaded_from_args(args)
    checkpoint_name = mck.get_checkpoint_name(save_root, iteration, release=release, return_base_dir=True)
    log.info("saving iteration %s to %s (sharding %s)", iteration, checkpoint_name,
             (metadata or {}).get("distrib_optim_sharding_type"))
    return save_state(
        state_dict, save_root, checkpoint_name, RELEASE_DIR if release else str(iteration),
        content_metadata=compat.clean_content_metadata(metadata), options=options,
        async_save=bool(getattr(args, "async_save", False)), retention=retention_from_args(args),
        copy_start="deferred" if deferred else "now",
    )
