"""Bodies of the multi-process tests; each runs on every rank of a gloo world (see mp.py).

They return plain data (mismatch lists, error descriptions) and let the parent assert,
so a failure shows every rank's view.
"""

from __future__ import annotations

import errno
import os

import torch

import safe_ckpt
from safe_ckpt_lab.synthetic import StateSpec, bits_equal, build_state, reference_tensors
from tests.helpers.mp import describe_exception

SMALL = dict(hidden=64, ffn=256, vocab=512, layers=2, seq=32, buckets=2, bucket_numel=20_000, pieces_per_rank=3)


def small_options(**kw) -> safe_ckpt.SaveOptions:
    base = dict(chunk_bytes=16 * 1024, io_threads=3, staging_budget_bytes=1 << 20, progress_interval_s=0)
    base.update(kw)
    return safe_ckpt.SaveOptions(**base)


def _has_sharded(tree) -> bool:
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    if isinstance(tree, dict):
        return any(_has_sharded(v) for v in tree.values())
    if isinstance(tree, list):
        return any(_has_sharded(v) for v in tree)
    return isinstance(tree, ShardedBase)


def compare_loaded(loaded, expected, path="") -> list[str]:
    """Walk Megatron's loaded dict beside the expected sharded dict; list every mismatch."""
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject, ShardedObject, ShardedTensor, ShardedTensorFactory,
    )

    if isinstance(expected, dict):
        out = []
        for k, v in expected.items():
            if k not in loaded:
                if _has_sharded(v):
                    out.append(f"{path}.{k}: missing from the loaded state")
            else:
                out += compare_loaded(loaded[k], v, f"{path}.{k}")
        return out
    if isinstance(expected, list):
        if len(loaded) != len(expected):
            return [f"{path}: {len(loaded)} entries, expected {len(expected)}"]
        return [m for i, (a, b) in enumerate(zip(loaded, expected)) for m in compare_loaded(a, b, f"{path}[{i}]")]
    if isinstance(expected, (ShardedTensor, ShardedTensorFactory)):
        ok = isinstance(loaded, torch.Tensor) and bits_equal(loaded, expected.data)
        return [] if ok else [f"{path}: tensor differs ({getattr(expected, 'key', '')})"]
    if isinstance(expected, ShardedObject):
        return [] if loaded == expected.data else [f"{path}: object {loaded!r} != {expected.data!r}"]
    if isinstance(expected, LocalNonpersistentObject):
        return [] if loaded == expected.unwrap() else [f"{path}: nonpersistent {loaded!r}"]
    return []  # common state is checked against the saved one by the caller


def compare_common(loaded, saved) -> list[str]:
    return [f"common {k}: {loaded.get(k)!r} != {saved[k]!r}" for k in ("iteration", "checkpoint_version", "args")
            if loaded.get(k) != saved[k]]


def load_whole_with_dcp(ckpt_dir: str) -> dict:
    """Every tensor of the checkpoint as one whole tensor, through stock DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(ckpt_dir).read_metadata()
    whole = {
        k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for k, md in meta.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    dcp.load(whole, checkpoint_id=ckpt_dir)
    return whole


def roundtrip(rank, world, tp, load_tp, ckpt_dir, spec_kwargs=None, options_kwargs=None) -> dict:
    """Save a Megatron-shaped state, load it with stock Megatron (other sharding) and DCP."""
    from megatron.core import dist_checkpointing

    spec = StateSpec(**(spec_kwargs or SMALL))
    refs = reference_tensors(spec, max(tp, load_tp))
    state = build_state(rank, world, tp=tp, spec=spec, references=refs)
    result = safe_ckpt.save(state, ckpt_dir, options=small_options(**(options_kwargs or {})))
    saved_common = {k: state[k] for k in ("iteration", "checkpoint_version", "args")}

    ckpt_dir = ckpt_dir.removeprefix("file://")  # stock loaders read local paths
    target = build_state(rank, world, tp=load_tp, spec=spec, layout="alt", empty=True, references=refs, saved_tp=tp)
    expected = build_state(rank, world, tp=load_tp, spec=spec, layout="alt", references=refs, saved_tp=tp)
    loaded = dist_checkpointing.load(target, ckpt_dir)
    mismatches = compare_loaded(loaded, expected) + compare_common(loaded, saved_common)

    whole = load_whole_with_dcp(ckpt_dir)
    saved_keys = set(reference_tensors(spec, tp))
    if set(whole) != saved_keys:
        mismatches.append(f"DCP keys differ: extra {set(whole) - saved_keys}, missing {saved_keys - set(whole)}")
    for key in saved_keys & set(whole):
        if not bits_equal(whole[key], refs[key]):
            mismatches.append(f"DCP whole tensor {key} differs")
    return {
        "mismatches": mismatches,
        "bytes_by_residence": result.bytes_by_residence,
        "files": sorted(os.listdir(ckpt_dir)),
        "items": result.items,
        "tensors_checked": len(saved_keys),
    }


# ------------------------------------------------------------------ hostile input


def _st(key, data, global_shape, offset, replica_id=0, **kw):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return ShardedTensor(key, data, data.dtype, tuple(data.shape), tuple(global_shape), tuple(offset),
                         axis_fragmentations=None, replica_id=replica_id, **kw)


def _rows(seed, n, cols=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, cols, generator=g).to(dtype)


def hostile_state(case: str, rank: int, world: int) -> tuple[dict, str, list[int]]:
    """A state dict that must be refused; returns (state, offending key, ranks to be named)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    good = {"ok": _st("ok", _rows(rank, 2), (2 * world, 4), (2 * rank, 0))}
    last = world - 1
    if case == "overlap":
        # Every rank's 3 rows start 2 apart: neighbours share a row.
        return {**good, "x": _st("x", _rows(10 + rank, 3), (2 * world + 1, 4), (2 * rank, 0))}, "x", \
            list(range(world))
    if case == "gap":
        # The last rank leaves out the final row.
        n = 1 if rank == last else 2
        return {**good, "x": _st("x", _rows(10 + rank, n), (2 * world, 4), (2 * rank, 0))}, "x", list(range(world))
    if case == "dtype_disagree":
        dtype = torch.bfloat16 if rank == last else torch.float32
        return {**good, "x": _st("x", _rows(10 + rank, 2, dtype=dtype), (2 * world, 4), (2 * rank, 0))}, "x", \
            list(range(world))
    if case == "shape_disagree":
        cols = 8 if rank == last else 4
        return {**good, "x": _st("x", _rows(10 + rank, 2), (2 * world, cols), (2 * rank, 0))}, "x", \
            list(range(world))
    if case == "lying_local_shape":
        sh = _st("x", _rows(10 + rank, 2), (2 * world, 4), (2 * rank, 0))
        if rank == last:
            sh.data = _rows(10 + rank, 3)  # claims 2 rows, holds 3
        return {**good, "x": sh}, "x", [last]
    if case == "out_of_bounds":
        off = (2 * rank + (3 if rank == last else 0), 0)
        return {**good, "x": _st("x", _rows(10 + rank, 2), (2 * world, 4), off)}, "x", [last]
    if case == "data_none":
        sh = _st("x", _rows(10 + rank, 2), (2 * world, 4), (2 * rank, 0))
        if rank == last:
            sh.data = None
        return {**good, "x": sh}, "x", [last]
    if case == "meta_tensor":
        data = torch.empty(2, 4, device="meta") if rank == last else _rows(10 + rank, 2)
        return {**good, "x": _st("x", data, (2 * world, 4), (2 * rank, 0))}, "x", [last]
    if case == "two_main_replicas":
        # Ranks 0 and 1 both claim rows 0-1 as the main replica; others hold the rest.
        off = (0, 0) if rank < 2 else (2 * rank - 2, 0)
        return {**good, "x": _st("x", _rows(10, 2), (2 * max(world - 1, 1), 4), off)}, "x", [0, 1]
    if case == "object_two_main":
        return {**good, "o": ShardedObject("o", {"r": rank}, (1,), (0,), replica_id=0)}, "o", list(range(world))
    if case == "options_disagree":  # the last rank asks for other writer threads (see `hostile`)
        return good, "<SaveOptions.io_threads>", [last]
    raise ValueError(case)


HOSTILE_CASES = [
    "overlap", "gap", "dtype_disagree", "shape_disagree", "lying_local_shape", "out_of_bounds",
    "data_none", "meta_tensor", "two_main_replicas", "object_two_main", "options_disagree",
]


def _leftovers(parent: str) -> list[str]:
    return sorted(n for n in os.listdir(parent) if ".safe_ckpt-" in n)


def hostile(rank, world, root) -> dict:
    """Every hostile case in turn; each must raise the same error on every rank, commit nothing."""
    out = {}
    for case in HOSTILE_CASES:
        state, key, ranks = hostile_state(case, rank, world)
        target = os.path.join(root, case)
        record = {"key": key, "expected_ranks": ranks}
        try:
            odd = case == "options_disagree" and rank == world - 1
            safe_ckpt.save(state, target, options=small_options(io_threads=5) if odd else small_options())
            record["error"] = None
        except BaseException as exc:
            record["error"] = describe_exception(exc)
        torch.distributed.barrier()
        record["committed"] = os.path.exists(target)
        record["leftovers"] = _leftovers(root)
        torch.distributed.barrier()  # nobody starts the next case while others still look
        out[case] = record
    return out


# ------------------------------------------------------------------ injected faults


def failing_write(rank, world, root, fail_rank, fault_kw) -> dict:
    """A good checkpoint, then a re-save of it whose sink fails on ``fail_rank``."""
    from safe_ckpt.sinks.faults import Fault, FaultySink
    from safe_ckpt.sinks.posix import PosixSink

    spec = StateSpec(**SMALL)
    refs = reference_tensors(spec, 1)
    target = os.path.join(root, "ckpt")
    safe_ckpt.save(build_state(rank, world, tp=1, spec=spec, references=refs), target, options=small_options())
    before = {n: open(os.path.join(target, n), "rb").read() for n in sorted(os.listdir(target))}

    fault = Fault(**fault_kw)
    opts = small_options(sink_factory=(lambda d: FaultySink(PosixSink(d), fault)) if rank == fail_rank else None)
    changed = {**SMALL, "seed": 999}
    record = {}
    try:
        safe_ckpt.save(build_state(rank, world, tp=1, spec=StateSpec(**changed)), target, options=opts)
        record["error"] = None
    except BaseException as exc:
        record["error"] = describe_exception(exc)
    torch.distributed.barrier()
    after = {n: open(os.path.join(target, n), "rb").read() for n in sorted(os.listdir(target))}
    record["previous_intact"] = before == after
    record["leftovers"] = _leftovers(root)
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(
        build_state(rank, world, tp=1, spec=spec, layout="alt", empty=True, references=refs), target
    )
    record["mismatches"] = compare_loaded(
        loaded, build_state(rank, world, tp=1, spec=spec, layout="alt", references=refs)
    )
    return record


ENOSPC = errno.ENOSPC


# ------------------------------------------------------------------ grid checksums without a GPU


def _host_grid_stager(deferred: list | None = None):
    """A `Stager` that treats large contiguous host chunks the way the real one treats device
    chunks (copy into a pool lease, grid sums beside it, deferred while the writers wait), so
    the CPU suite exercises the writer, manifest and verify path of device checksums and the
    deferral's bookkeeping; it stands for the CUDA copy stream and its sums, which the GPU test
    `test_device_checksums` exercises for real. ``deferred`` gets one entry per deferred sum issued."""
    from safe_ckpt.integrity import grid_bytes, grid_sums
    from safe_ckpt.staging.stager import Stager

    class HostGridStager(Stager):
        """Only the device-specific steps are replaced: which chunks take the device path,
        the copy and the sums; leases, deferral and flushes are the real stager's."""

        def _device_path(self, chunk, nbytes, contiguous):
            return chunk.device.type != "cpu" or self._sums_offset(chunk, nbytes, contiguous) is not None

        def _enqueue_copy(self, chunk, lease, contiguous, runs):
            if chunk.device.type != "cpu":
                return super()._enqueue_copy(chunk, lease, contiguous, runs)
            lease.tensor[:chunk.numel() * chunk.element_size()].copy_(chunk.reshape(-1).view(torch.uint8))
            return None  # landed already: ready() has nothing to wait for

        def _issue_sums(self, pending):
            staged = pending.staged
            lease = staged._lease
            try:
                if lease is not None:
                    sums = grid_sums(pending.chunk)
                    lease.tensor[staged._sums_at:staged._sums_at + grid_bytes(staged.nbytes)] \
                        .view(torch.int32).copy_(sums)
                    staged._sums = sums
                    if staged._sums_issued is not None and deferred is not None:
                        deferred.append(staged.nbytes)
            finally:
                if staged._sums_issued is not None:
                    staged._sums_issued.set()

    return HostGridStager


def gridded_roundtrip(rank, world, tp, load_tp, ckpt_dir, spec_kwargs, options_kwargs,
                      as_device: bool = False) -> dict:
    """``as_device``: every source reported as device memory, so the writers wait for the last
    "copy" and the sums are deferred until then (or until the pool runs out)."""
    from safe_ckpt.residence import classify as residence
    from safe_ckpt.saving import job as save_job
    from safe_ckpt.staging import stager

    deferred: list = []
    save_job.Stager = _host_grid_stager(deferred)
    stager.GRID_MIN_PAYLOAD_BYTES = 1 << 20  # so a state small enough for CI has device-summed chunks
    if as_device:
        residence.classify = lambda t, **kw: residence.Classified(residence.Residence.CUDA.value)
    out = roundtrip(rank, world, tp, load_tp, ckpt_dir, spec_kwargs, options_kwargs)
    out["deferred_sums"] = len(deferred)
    return out
