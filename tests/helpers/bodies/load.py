"""Rank bodies of the load tests (see mp.py): save a Megatron-shaped state (with safe_ckpt, or
with stock Megatron's own writer path), load it with `safe_ckpt.load` and with stock
`dist_checkpointing.load` into fresh templates of another layout, and return every mismatch."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch

import safe_ckpt
from safe_ckpt import compat, names
from safe_ckpt_lab.synthetic import StateSpec, bits_equal, build_state, reference_tensors
from tests.helpers.bodies.common import SMALL, compare_loaded, small_options
from tests.helpers.mp import describe_exception


def stock_write(state: dict, path: str) -> None:
    """Write ``state`` the way stock Megatron's torch_dist save does, through stock DCP's writer:
    megatron-core's save preprocessing, its ShardedTensor translation and save planner, the
    common state as the installed version stores it, and `metadata.json` last. (Stock
    `dist_checkpointing.save` itself cannot run on a CPU-only torch: its async writer calls
    `torch.cuda.synchronize()`.)"""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    sharded, common = save_preprocess(state, validate_access_integrity=False)
    if compat.common_state_as_sharded_object():
        sharded["common_state"] = ShardedObject("common_state", common, (1,), (0,), replica_id=rank)
    elif rank == 0:
        torch.save(common, os.path.join(path, names.COMMON_STATE_FILE))
    flat, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(sharded, keep_only_main_replica=True)
    pyt = mcore_torch.mcore_to_pyt_state_dict(flat, False)
    dcp.save(pyt, storage_writer=dcp.FileSystemWriter(path, thread_count=2),
             planner=mcore_torch.MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False))
    dist.barrier()
    if rank == 0:
        save_config(CheckpointingConfig("torch_dist", 1), path)
    dist.barrier()


def write(writer: str, state: dict, path: str) -> None:
    if writer == "safe":
        safe_ckpt.save(state, path, options=small_options())
    else:
        stock_write(state, path)


def load_options(reports: list | None = None, **kw) -> safe_ckpt.LoadOptions:
    """Small pieces and batches, so that a small state takes every path (batches, pieces, pool)."""
    base = dict(staging_budget_bytes=1 << 20, piece_bytes=64 << 10, batch_bytes=16 << 10,
                on_read=reports.append if reports is not None else None)
    base.update(kw)
    return safe_ckpt.LoadOptions(**base)


def _pin(tree):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    for v in (tree.values() if isinstance(tree, dict) else tree):
        if isinstance(v, (dict, list)):
            _pin(v)
        elif isinstance(v, ShardedTensor) and v.data is not None:
            v.data = v.data.pin_memory()


@contextlib.contextmanager
def _through_the_pool(on: bool):
    """Make host templates travel as GPU ones do (pieces of the pinned pool, then byte copies):
    the copy path of GPU destinations, run on a CPU-only machine."""
    from safe_ckpt.loading import plan

    stock_destination = plan.destination
    if on:
        plan.destination = lambda sh_ten: dataclasses.replace(stock_destination(sh_ten), memory=None)
    try:
        yield
    finally:
        plan.destination = stock_destination


def reshard(rank, world, root, writer, tp, load_tp, memory) -> dict:
    """Save at TP=tp, load at TP=load_tp in the other layout, with safe_ckpt and with stock.
    ``memory``: the templates' "pageable" or "pinned" host memory, "cuda", or "pool" (host
    memory reached the way GPU memory is)."""
    from megatron.core import dist_checkpointing

    spec = StateSpec(**SMALL)
    refs = reference_tensors(spec, max(tp, load_tp))
    path = os.path.join(root, "ckpt")
    write(writer, build_state(rank, world, tp=tp, spec=spec, references=refs), path)

    def target():
        device = f"cuda:{rank % max(1, torch.cuda.device_count())}" if memory == "cuda" else "cpu"
        t = build_state(rank, world, tp=load_tp, spec=spec, layout="alt", empty=True, references=refs, saved_tp=tp,
                        device=device)
        if memory == "pinned":
            _pin(t)
        return t

    expected = build_state(rank, world, tp=load_tp, spec=spec, layout="alt", references=refs, saved_tp=tp)
    reports: list = []
    with _through_the_pool(memory == "pool"):
        ours = safe_ckpt.load(target(), path, load_options(reports))
    stock = dist_checkpointing.load(target(), path)
    return {
        "mismatches": compare_loaded(ours, expected),
        "stock_mismatches": compare_loaded(stock, expected),
        "same_as_stock": same_tree(ours, stock),
        "report": reports[0].__dict__ if reports else None,
        "pinned": memory != "pinned" or _all_pinned(ours),
        "device": memory != "cuda" or _all_cuda(ours),
    }


def _all_pinned(tree) -> bool:
    if isinstance(tree, dict):
        return all(_all_pinned(v) for v in tree.values())
    if isinstance(tree, list):
        return all(_all_pinned(v) for v in tree)
    return not isinstance(tree, torch.Tensor) or tree.is_pinned()


def _all_cuda(tree) -> bool:
    if isinstance(tree, dict):
        return all(_all_cuda(v) for v in tree.values())
    if isinstance(tree, list):
        return all(_all_cuda(v) for v in tree)
    return not isinstance(tree, torch.Tensor) or tree.is_cuda


def same_tree(a, b, path="") -> list[str]:
    """Every difference between two loaded state dicts: structure, tensors (bits), other values."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in ours" for k in a.keys() - b.keys()]
        out += [f"{path}.{k}: only in stock's" for k in b.keys() - a.keys()]
        return out + [m for k in a.keys() & b.keys() for m in same_tree(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} entries, stock's {len(b)}"]
        return [m for i, (x, y) in enumerate(zip(a, b)) for m in same_tree(x, y, f"{path}[{i}]")]
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and bits_equal(a, b)
        return [] if ok else [f"{path}: tensors differ"]
    try:
        equal = a == b
        equal = bool(equal) if not isinstance(equal, bool) else equal
    except Exception:
        equal = repr(a) == repr(b)
    return [] if equal else [f"{path}: {a!r:.60} != {b!r:.60}"]


def suite(rank, world, root, cases) -> dict:
    """Several cases in one world (starting ranks is what takes time): {name: result}."""
    bodies = {"reshard": reshard, "save_dp": save_dp, "load_dp": load_dp, "strictness": strictness,
              "odd_templates": odd_templates, "via_strategy": via_strategy}
    out = {}
    for name, body, args in cases:
        if args and args[-1] in ("pinned", "cuda") and not torch.cuda.is_available():
            continue
        out[name] = bodies[body](rank, world, os.path.join(root, name), *args)
    return out


def via_strategy(rank, world, root, writer) -> dict:
    """Stock `dist_checkpointing.load` with safe_ckpt's load strategy (stock runs the rest)."""
    from megatron.core import dist_checkpointing

    from safe_ckpt.megatron import SafeTorchDistLoadStrategy

    spec = StateSpec(**SMALL)
    refs = reference_tensors(spec, world)
    path = os.path.join(root, "ckpt")
    write(writer, build_state(rank, world, tp=world, spec=spec, references=refs), path)
    reports: list = []
    strategy = SafeTorchDistLoadStrategy(load_options(reports))
    target = build_state(rank, world, tp=1, spec=spec, layout="alt", empty=True, references=refs, saved_tp=world)
    expected = build_state(rank, world, tp=1, spec=spec, layout="alt", references=refs, saved_tp=world)
    loaded = dist_checkpointing.load(target, path, sharded_strategy=strategy)
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    stock_metadata = load_sharded_metadata(path)
    return {"mismatches": compare_loaded(loaded, expected), "reports": len(reports),
            "metadata_keys_equal": sorted(strategy.load_sharded_metadata(path)) == sorted(stock_metadata)}


def save_dp(rank, world, root, writer) -> dict:
    """A TP=1 state, so every rank holds 1/world of each optimizer bucket (dp_reshardable)."""
    spec = StateSpec(**SMALL)
    write(writer, build_state(rank, world, tp=1, spec=spec, references=reference_tensors(spec, 1)),
          os.path.join(root, "ckpt"))
    return {}


def load_dp(rank, world, root, saved_root) -> dict:
    """Load at another data-parallel size with safe_ckpt and stock (buckets cut elsewhere)."""
    from megatron.core import dist_checkpointing

    spec = StateSpec(**SMALL)
    refs = reference_tensors(spec, 1)

    def state(empty):
        s = build_state(rank, world, tp=1, spec=spec, layout="alt", empty=empty, references=refs, saved_tp=1)
        s.pop("rank_info")  # one object per saving rank: no counterpart at another world size
        return s

    path = os.path.join(saved_root, "ckpt")
    reports: list = []
    ours = safe_ckpt.load(state(True), path, load_options(reports))
    stock = dist_checkpointing.load(state(True), path)
    return {"mismatches": compare_loaded(ours, state(False)), "same_as_stock": same_tree(ours, stock),
            "report": reports[0].__dict__}


def strictness(rank, world, root) -> dict:
    """A state dict with a key the checkpoint lacks and one it lacks from the checkpoint: the
    strict modes return (and raise) what stock returns."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    spec = StateSpec(**SMALL)
    refs = reference_tensors(spec, world)
    path = os.path.join(root, "ckpt")
    safe_ckpt.save(build_state(rank, world, tp=world, spec=spec, references=refs), path, options=small_options())

    def target():
        from tests.helpers.bodies.common import _st

        t = build_state(rank, world, tp=world, spec=spec, layout="alt", empty=True, references=refs)
        del t["model"]["output_layer.weight"]  # in the checkpoint, not asked for
        t["model"]["extra"] = _st("extra", torch.empty(2, 4), (2 * world, 4), (2 * rank, 0))  # asked, not there
        return t

    out = {}
    for mode in (StrictHandling.RETURN_ALL, StrictHandling.RETURN_UNEXPECTED):
        ours, ours_missing, ours_unexpected = safe_ckpt.load(target(), path, load_options(), strict=mode)
        stock, stock_missing, stock_unexpected = dist_checkpointing.load(target(), path, strict=mode)
        out[mode.value] = {"ours": (sorted(ours_missing), sorted(ours_unexpected)),
                           "stock": (sorted(stock_missing), sorted(stock_unexpected)),
                           "same_as_stock": same_tree(ours, stock)}
    ours = safe_ckpt.load(target(), path, load_options(), strict=StrictHandling.IGNORE_ALL)
    out["ignore_all"] = same_tree(ours, dist_checkpointing.load(target(), path, strict=StrictHandling.IGNORE_ALL))
    for mode in (StrictHandling.RAISE_ALL, StrictHandling.ASSUME_OK_UNEXPECTED):
        try:
            safe_ckpt.load(target(), path, load_options(), strict=mode)
            out[mode.value] = None
        except BaseException as exc:
            out[mode.value] = describe_exception(exc)
    return out


def odd_templates(rank, world, root, writer) -> dict:
    """Templates stock also fills: a non-contiguous one (strided copy), another dtype (converted),
    one with no data (made on the host), one padded with allow_shape_mismatch (the rest zero)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from tests.helpers.bodies.common import _rows

    path = os.path.join(root, "ckpt")
    rows, cols = 6 * world, 8

    def full(seed, dtype=torch.bfloat16):
        return _rows(seed, rows, cols, dtype)

    def st(key, data, shape, offset, **kw):
        return ShardedTensor(key, data, data.dtype if data is not None else kw.pop("dtype"), tuple(
            data.shape if data is not None else kw.pop("local_shape")), tuple(shape), tuple(offset),
            axis_fragmentations=None, replica_id=0, **kw)

    base = {k: full(i) for i, k in enumerate(("a", "b", "c", "d"))}
    mine = slice(6 * rank, 6 * rank + 6)
    write(writer, {k: st(k, v[mine].clone(), (rows, cols), (6 * rank, 0)) for k, v in base.items()}
          | {"iteration": 3}, path)

    def target():
        half = cols // 2
        first = half * (rank % 2) if world > 1 else 0
        width = half if world > 1 else cols
        columns = torch.empty(cols, rows, dtype=torch.bfloat16).t()[:, first:first + width]  # non-contiguous
        return {
            # columns, not rows: each rank reads part of every stored chunk, through a strided copy
            "a": st("a", columns, (rows, cols), (0, first)),
            "b": st("b", torch.empty(6, cols, dtype=torch.float32), (rows, cols), (6 * rank, 0)),
            "c": st("c", None, (rows, cols), (6 * rank, 0), dtype=torch.bfloat16, local_shape=(6, cols)),
            "d": st("d", torch.full((6, cols + 2), 7.0, dtype=torch.bfloat16), (rows, cols + 2), (6 * rank, 0),
                    allow_shape_mismatch=True),
        }

    ours = safe_ckpt.load(target(), path, load_options())
    stock = dist_checkpointing.load(target(), path)
    half = cols // 2
    a_cols = slice(half * (rank % 2), half * (rank % 2) + half) if world > 1 else slice(None)
    expected = {"a": base["a"][:, a_cols], "b": base["b"][mine].float(), "c": base["c"][mine],
                "d": torch.cat([base["d"][mine], torch.zeros(6, 2, dtype=torch.bfloat16)], dim=1)}
    return {"mismatches": [k for k, v in expected.items() if not bits_equal(ours[k], v)],
            "stock_mismatches": [k for k, v in expected.items() if not bits_equal(stock[k], v)],
            "same_as_stock": same_tree(ours, stock)}


def object_store(rank, world, bucket_spec, root, dead_endpoint) -> dict:
    """Load from a real S3 API (the local moto server): a safe_ckpt save made there (one item per
    key), and a stock-written checkpoint copied there (many items per key: ranged reads); the same
    stock checkpoint through a `file://` URL; an unreachable endpoint fails within the deadline."""
    import time

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from safe_ckpt.tools.copy import copy

    spec = StateSpec(**SMALL)
    refs = reference_tensors(spec, 2)
    state = build_state(rank, world, tp=1, spec=spec, references=refs)
    safe_ckpt.save(state, "run/iter_0000001", options=small_options(kvstore_spec=bucket_spec))
    local = os.path.join(root, "stock")
    stock_write(build_state(rank, world, tp=1, spec=spec, references=refs), local)
    if rank == 0:
        copy(local, "stock/iter_0000001", dst_spec=bucket_spec)
    dist.barrier()

    def target():
        return build_state(rank, world, tp=2, spec=spec, layout="alt", empty=True, references=refs, saved_tp=1)

    expected = build_state(rank, world, tp=2, spec=spec, layout="alt", references=refs, saved_tp=1)
    stock = dist_checkpointing.load(target(), local)
    out = {}
    for name, where, kv in (("safe_s3", "run/iter_0000001", bucket_spec), ("stock_s3", "stock/iter_0000001", bucket_spec),
                            ("stock_file_url", "file://" + local, None)):
        reports: list = []
        loaded = safe_ckpt.load(target(), where, load_options(reports, kvstore_spec=kv))
        out[name] = {"mismatches": compare_loaded(loaded, expected), "same_as_stock": same_tree(loaded, stock),
                     "report": reports[0].__dict__}
    dead = {**bucket_spec, "endpoint": dead_endpoint}
    t0 = time.monotonic()
    try:
        safe_ckpt.load(target(), "run/iter_0000001", load_options(kvstore_spec=dead, kvstore_request_timeout_s=3))
        out["dead"] = None
    except BaseException as exc:
        out["dead"] = describe_exception(exc)
    out["dead_s"] = time.monotonic() - t0
    return out
