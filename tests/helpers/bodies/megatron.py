"""Rank bodies for the Megatron adapter tests (see mp.py)."""

from __future__ import annotations

import os

import torch

from safe_ckpt_lab.synthetic import StateSpec, build_state, reference_tensors
from tests.helpers.bodies.common import SMALL, compare_loaded, small_options
from tests.helpers.mp import describe_exception
from tests.helpers.paths import STAND_INS

CONTENT = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
           "chained_optim_avoid_prefix": True}


def _load_and_compare(rank, world, tp, spec, refs, path):
    from megatron.core import dist_checkpointing

    target = build_state(rank, world, tp=tp, spec=spec, layout="alt", empty=True, references=refs, saved_tp=tp)
    expected = build_state(rank, world, tp=tp, spec=spec, layout="alt", references=refs, saved_tp=tp)
    return compare_loaded(dist_checkpointing.load(target, path), expected)


def _tracker(save_dir):
    path = os.path.join(save_dir, "latest_checkpointed_iteration.txt")
    return open(path).read() if os.path.exists(path) else None


def training_layout(rank, world, save_dir, use_async) -> dict:
    """save_state: iter dir, content_metadata, tracker last; then a failing save keeps all of it."""
    from megatron.core import dist_checkpointing

    from safe_ckpt.megatron import finalize_async_saves, save_state
    from safe_ckpt.sinks.faults import Fault, FaultySink
    from safe_ckpt.sinks.posix import PosixSink

    spec = StateSpec(**SMALL)
    refs = reference_tensors(spec, world)
    state = build_state(rank, world, tp=world, spec=spec, references=refs)
    iter_dir = os.path.join(save_dir, "iter_0000042")
    out = {"tracker_before": _tracker(save_dir)}
    save_state(state, save_dir, iter_dir, "42", content_metadata=dict(CONTENT), options=small_options(),
                     async_save=use_async)
    if use_async:
        out["tracker_while_pending"] = None  # may or may not exist yet; only the final state matters
        finalize_async_saves(blocking=True)
    torch.distributed.barrier()
    out["tracker"] = _tracker(save_dir)
    out["files"] = sorted(os.listdir(iter_dir))
    out["content_metadata"] = dist_checkpointing.load_content_metadata(iter_dir)
    common = dist_checkpointing.load_common_state_dict(iter_dir)
    out["common_keys"] = sorted(k for k in common if k != "content_metadata")
    out["mismatches"] = _load_and_compare(rank, world, world, spec, refs, iter_dir)

    # A later save that fails on the last rank leaves the tracker and iteration 42 alone.
    fault = Fault(after_bytes=10_000)
    opts = small_options(sink_factory=(lambda d: FaultySink(PosixSink(d), fault)) if rank == world - 1 else None)
    try:
        save_state(build_state(rank, world, tp=world, spec=spec, references=refs), save_dir,
                   os.path.join(save_dir, "iter_0000043"), "43", content_metadata=dict(CONTENT), options=opts,
                   async_save=use_async)
        if use_async:
            finalize_async_saves(blocking=True)
        out["failed_save_error"] = None
    except BaseException as exc:
        out["failed_save_error"] = describe_exception(exc)
    torch.distributed.barrier()
    out["tracker_after_failure"] = _tracker(save_dir)
    out["iter43_exists"] = os.path.exists(os.path.join(save_dir, "iter_0000043"))
    return out


def strategy_roundtrip(rank, world, root, use_async) -> dict:
    """Stock dist_checkpointing.save with the safe strategy, then stock load."""
    from megatron.core import dist_checkpointing

    from safe_ckpt.megatron import SafeTorchDistSaveStrategy

    spec = StateSpec(**SMALL)
    refs = reference_tensors(spec, world)
    path = os.path.join(root, "ckpt")
    if rank == 0:
        os.makedirs(path, exist_ok=True)  # as Megatron's training loop does before saving
    torch.distributed.barrier()
    strategy = SafeTorchDistSaveStrategy(options=small_options())
    state = build_state(rank, world, tp=world, spec=spec, references=refs)
    request = dist_checkpointing.save(state, path, sharded_strategy=strategy, validate_access_integrity=False,
                                      async_sharded_save=use_async)
    if use_async:
        request.execute_sync()
    torch.distributed.barrier()
    return {"is_torch_dist_strategy": type(strategy).__mro__[1].__name__, "files": sorted(os.listdir(path)),
            "mismatches": _load_and_compare(rank, world, world, spec, refs, path)}


def default_strategy(rank, world, root) -> dict:
    """On megatron-core <= 0.16: install as default; a plain dist_checkpointing.save then uses it
    (stock saving could not even run on a CPU-only torch)."""
    from megatron.core import dist_checkpointing

    from safe_ckpt.megatron import install_as_default

    installed = install_as_default(small_options())
    if not installed:
        return {"installed": False}
    spec = StateSpec(**SMALL)
    refs = reference_tensors(spec, world)
    path = os.path.join(root, "ckpt")
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(build_state(rank, world, tp=world, spec=spec, references=refs), path)
    return {"installed": True, "mismatches": _load_and_compare(rank, world, world, spec, refs, path)}


def save_data_parallel(rank, world, path) -> dict:
    """Megatron-shaped state at TP=1, so every rank holds 1/world of each optimizer bucket
    (the distributed optimizer's dp_reshardable layout), saved by safe_ckpt."""
    import safe_ckpt

    spec = StateSpec(**SMALL)
    result = safe_ckpt.save(build_state(rank, world, tp=1, spec=spec, references=reference_tensors(spec, 1)), path,
                            options=small_options())
    return {"items": result.items}


def load_data_parallel(rank, world, path) -> dict:
    """Stock Megatron loads it at another data-parallel size: each rank's buckets cut elsewhere.
    The one object kept per saving rank (`rank_info`, sharded by the world size) has no
    counterpart at another size, as Megatron's per-rank objects have none: it is not asked for."""
    from megatron.core import dist_checkpointing

    spec = StateSpec(**SMALL)
    refs = reference_tensors(spec, 1)
    target, expected = (build_state(rank, world, tp=1, spec=spec, layout="alt", empty=empty, references=refs,
                                    saved_tp=1) for empty in (True, False))
    for state in (target, expected):
        state.pop("rank_info")
    pieces = sum(len(v) if isinstance(v, list) else 1 for v in expected["optimizer"]["distributed"].values())
    return {"mismatches": compare_loaded(dist_checkpointing.load(target, path), expected),
            "optimizer_entries": pieces, "model_keys": len(expected["model"])}


class _LogLines:
    """Collects safe_ckpt's log records of one level and above (to assert on what a user reads)."""

    def __init__(self, level):
        import logging

        self.lines = []
        self.handler = logging.Handler(level)
        self.handler.emit = lambda record: self.lines.append(record.getMessage())
        logging.getLogger("safe_ckpt").addHandler(self.handler)


def megatron_run(rank, world, root, iterations, flags) -> dict:
    """One training process of a Megatron run that saves through `safe_ckpt.megatron.save_checkpoint`
    (Megatron-LM's `megatron.training` from tests/stand_ins): ``flags`` are its Megatron args
    (`load`, `ckpt_step`, `finetune`, `safe_ckpt_keep_last`, ...); it saves ``iterations`` in order
    and reports the iteration directories after each save."""
    import logging
    import sys

    if STAND_INS not in sys.path:
        sys.path.insert(0, STAND_INS)
    from argparse import Namespace

    from megatron.core import mpu
    from megatron.training.global_vars import set_args

    mpu.initialize_model_parallel(world, 1)
    args = Namespace(save=root, load=None, ckpt_step=None, finetune=False, pretrained_checkpoint=None,
                     ckpt_format="torch_dist", no_save_optim=False, no_save_rng=False, no_load_optim=False,
                     no_load_rng=False, use_distributed_optimizer=True, async_save=False, safe_ckpt_io_threads=2,
                     safe_ckpt_timeout_s=60, safe_ckpt_keep_last=None, safe_ckpt_keep_every=None,
                     save_retain_interval=None)
    for name, value in flags.items():
        setattr(args, name, value)
    set_args(args)
    spec = StateSpec(**SMALL)
    state = build_state(rank, world, tp=world, spec=spec, references=reference_tensors(spec, world))
    logs = _LogLines(logging.WARNING)
    _RUN["state"] = state
    after = megatron_run_more(rank, root, iterations)
    return {"after": after, "tracker": _tracker(root), "warnings": logs.lines}


_RUN = {}  # the state of this rank's `megatron_run`


def megatron_run_more(rank, root, iterations) -> list:
    """Save ``iterations`` in the run `megatron_run` started in this process; the iteration
    directories after each save."""
    from safe_ckpt.megatron import save_checkpoint
    from tests.slime_mirror.backends.megatron_utils.actor import _Scheduler, _SyntheticModel, _SyntheticOptimizer

    state = _RUN["state"]
    after = []
    for iteration in iterations:
        save_checkpoint(iteration, [_SyntheticModel(state)], _SyntheticOptimizer(state), _Scheduler())
        torch.distributed.barrier()
        after.append(sorted(n for n in os.listdir(root) if n.startswith("iter_")))
    return after


def megatron_integrity_json(path) -> bytes:
    """`integrity.json` as megatron-core >= 0.18's `save_integrity_manifest` writes it, computed here
    from the files (on versions that have it, the tests also compare with the stock function)."""
    import hashlib
    import json

    files = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full) and name != "integrity.json":
            with open(full, "rb") as f:
                files[name] = hashlib.sha256(f.read()).hexdigest()
    return json.dumps({"algorithm": "sha256", "files": files}, indent=2).encode()


def stock_integrity_json(path, scratch) -> bytes | None:
    """What the installed megatron-core's own `save_integrity_manifest` writes for ``path`` (run on a
    copy), or None where it has none."""
    import shutil

    from safe_ckpt import compat

    if not compat.stock_integrity_manifest():
        return None
    from megatron.core.dist_checkpointing.validation import save_integrity_manifest

    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(path, scratch)
    os.unlink(os.path.join(scratch, "integrity.json"))
    save_integrity_manifest(scratch)
    with open(os.path.join(scratch, "integrity.json"), "rb") as f:
        return f.read()


def _stock_verified_load(rank, world, spec, refs, path) -> dict:
    """Stock `load(..., verify_integrity=True)` (every rank), as a result or an error description."""
    from megatron.core import dist_checkpointing

    target = build_state(rank, world, tp=world, spec=spec, layout="alt", empty=True, references=refs, saved_tp=world)
    expected = build_state(rank, world, tp=world, spec=spec, layout="alt", references=refs, saved_tp=world)
    try:
        return {"mismatches": compare_loaded(dist_checkpointing.load(target, path, verify_integrity=True), expected)}
    except Exception as exc:
        return {"error": describe_exception(exc)}


INTEGRITY_MODES = {"fused": dict(checksum_threads=0), "threads": dict(checksum_threads=2), "nosum": dict(checksums=False),
                   "async": dict(checksum_threads=0), "kv": dict()}


def integrity_modes() -> list:
    """`INTEGRITY_MODES` this environment can run (the kvstore one needs tensorstore)."""
    import importlib.util

    return [m for m in INTEGRITY_MODES if m != "kv" or importlib.util.find_spec("tensorstore") is not None]


def integrity_saves(rank, world, root) -> dict:
    """For each write path (`integrity_modes`): save with `SaveOptions(integrity_manifest=True)`,
    compare `integrity.json` with Megatron's; where stock Megatron verifies integrity, load with
    `verify_integrity=True`, flip one byte of a data file and load again."""
    return {mode: _integrity_save(rank, world, os.path.join(root, mode), mode) for mode in integrity_modes()}


def _integrity_save(rank, world, root, mode) -> dict:
    import safe_ckpt
    from safe_ckpt import compat

    spec = StateSpec(**SMALL)
    refs = reference_tensors(spec, world)
    path = os.path.join(root, "ckpt")
    options = small_options(integrity_manifest=True, **INTEGRITY_MODES[mode])
    state = build_state(rank, world, tp=world, spec=spec, references=refs)
    if mode == "async":
        safe_ckpt.async_save(state, path, options=options).wait()
    else:
        safe_ckpt.save(state, ("file://" + path) if mode == "kv" else path, options=options)
    torch.distributed.barrier()
    out = {"files": sorted(os.listdir(path))}
    if rank == 0:
        with open(os.path.join(path, "integrity.json"), "rb") as f:
            out["written"] = f.read()
        out["expected"] = megatron_integrity_json(path)
        out["stock"] = stock_integrity_json(path, os.path.join(root, "stock_copy"))
    if not compat.stock_integrity_manifest():
        return out
    out["load"] = _stock_verified_load(rank, world, spec, refs, path)
    torch.distributed.barrier()
    if rank == 0:
        data = sorted(n for n in out["files"] if n.endswith(".distcp"))[-1]
        with open(os.path.join(path, data), "r+b") as f:
            f.seek(os.path.getsize(os.path.join(path, data)) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
        out["flipped"] = data
    torch.distributed.barrier()
    out["load_after_flip"] = _stock_verified_load(rank, world, spec, refs, path)
    return out


def integrity_strategy(rank, world, root) -> dict:
    """Stock `dist_checkpointing.save` with the safe strategy and `integrity_manifest`: the manifest
    also covers what Megatron's save writes around the strategy (`common.pt` up to 0.16, and
    `metadata.json`, written after the strategy returns)."""
    from megatron.core import dist_checkpointing

    from safe_ckpt.megatron import SafeTorchDistSaveStrategy

    spec = StateSpec(**SMALL)
    refs = reference_tensors(spec, world)
    path = os.path.join(root, "ckpt")
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    strategy = SafeTorchDistSaveStrategy(options=small_options(integrity_manifest=True))
    dist_checkpointing.save(build_state(rank, world, tp=world, spec=spec, references=refs), path,
                            sharded_strategy=strategy, validate_access_integrity=False)
    torch.distributed.barrier()
    out = {"files": sorted(os.listdir(path))}
    if rank == 0:
        with open(os.path.join(path, "integrity.json"), "rb") as f:
            out["written"] = f.read()
        out["expected"] = megatron_integrity_json(path)
    return out


def integrity_training(rank, world, root) -> dict:
    """`safe_ckpt.megatron.save_checkpoint` with Megatron's `--verify-integrity` set (iteration 7),
    then without it (iteration 8)."""
    out = megatron_run(rank, world, root, [7], {"verify_integrity": True})
    from megatron.training.global_vars import get_args  # from the stand-ins megatron_run put on the path

    get_args().verify_integrity = False
    megatron_run_more(rank, root, [8])
    for it in (7, 8):
        path = os.path.join(root, f"iter_{it:07d}")
        out[it] = {"files": sorted(os.listdir(path))}
    if rank == 0:
        path = os.path.join(root, "iter_0000007")
        with open(os.path.join(path, "integrity.json"), "rb") as f:
            out[7]["written"] = f.read()
        out[7]["expected"] = megatron_integrity_json(path)
        out[7]["stock"] = stock_integrity_json(path, os.path.join(root, "stock_copy"))
    return out
