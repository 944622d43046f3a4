"""Prove that what the bench times is a real checkpoint: one more, untimed safe_ckpt save of
the bench state, loaded back with stock `megatron.core.dist_checkpointing.load` into fresh
host tensors and compared bit for bit with the state, on every rank.

One job: that round trip for one saver, run after a target's timed runs so it cannot change
what they measure, and its outcome summed over the ranks (`across_ranks`). Must not: time a save for the report, or copy anything host-to-device
(the state is read device-to-host to compare it).
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verified:
    """One rank's round trip of one saver's checkpoint."""

    tensors: int  # ShardedTensors compared
    objects: int  # ShardedObjects and plain values compared
    mismatched: tuple[str, ...]  # keys whose loaded value differs from the state's (empty: exact)
    load_s: float  # stock Megatron's load, for the report (not a benchmark figure)


def _empty_like_sharded(sharded: dict) -> dict:
    """The same sharded state with every tensor replaced by an uninitialised host tensor."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    out = {}
    for key, value in sharded.items():
        if isinstance(value, ShardedTensor):
            out[key] = dataclasses.replace(value, data=torch.empty(value.local_shape, dtype=value.dtype))
        elif isinstance(value, ShardedObject):
            out[key] = dataclasses.replace(value, data=None)
        else:
            out[key] = value
    return out


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. a tensor where a plain value was saved
        return False


def compare(loaded: dict, expected: dict, stored: dict | None = None) -> Verified:
    """Every tensor, object and plain value of ``expected`` (a sharded state) against ``loaded``;
    with ``stored`` (`load_tensors_metadata` of the checkpoint, by tensor key) also each
    tensor's stored dtype and global shape, which a load into typed buffers would convert
    or hide."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from ..synthetic import bits_equal

    tensors = objects = 0
    bad = []
    for key, value in expected.items():
        if key not in loaded:
            bad.append(f"{key} (not loaded)")
            continue
        if isinstance(value, ShardedTensor):
            tensors += 1
            meta = None if stored is None else stored.get(value.key)
            if stored is not None and (meta is None or meta.dtype != value.dtype
                                       or tuple(meta.global_shape) != tuple(value.global_shape)):
                bad.append(f"{key} (stored as {None if meta is None else (meta.dtype, tuple(meta.global_shape))})")
                continue
            ok = isinstance(loaded[key], torch.Tensor) and bits_equal(loaded[key], value.data)
        else:
            objects += 1
            ok = _same(loaded[key], value.data if isinstance(value, ShardedObject) else value)
        if not ok:
            bad.append(key)
    return Verified(tensors, objects, tuple(bad), 0.0)


def round_trip(state, path: str, save, agree) -> Verified | None:
    """``save(state, path)`` once more, load it back with stock Megatron and compare.

    Call order, the same on every rank: the save (collective; every rank fails it together),
    the host buffers to load into, then ``agree(ok)`` (True only where every rank got that
    far: a rank that failed alone must not leave the others in the load's collectives), then
    the load (collective) and the comparison. Returns None where another rank failed before
    the load; raises this rank's own failure. The caller removes ``path`` once every rank is done."""
    from megatron.core import dist_checkpointing

    target = None
    try:
        save(state, path)
        target = _empty_like_sharded(state.make_sharded())
    finally:
        everyone_ok = agree(target is not None)
    if not everyone_ok:
        return None
    t0 = time.perf_counter()
    loaded = dist_checkpointing.load(target, path)
    load_s = time.perf_counter() - t0
    del target
    stored = dist_checkpointing.load_tensors_metadata(path)
    return dataclasses.replace(compare(loaded, state.make_sharded(), stored), load_s=load_s)


def across_ranks(state, path: str, save, everyone, rank: int, unavailable=()) -> dict:
    """`round_trip` on every rank, its outcome the same dict on every rank: ``tensors`` and
    ``objects`` summed, ``load_s`` the slowest, ``ranks``, and ``failed`` (each failing rank's
    note: keys that differ, or its exception) or ``skipped`` (an exception in ``unavailable``:
    the saver cannot run here). ``everyone(x)`` is every rank's ``x`` in rank order (an
    all-gather). Every rank reaches the same collectives whichever rank fails, and ``path``
    is removed only once every rank is done with it."""
    note, skipped, result = None, None, None
    try:
        result = round_trip(state, path, save, lambda ok: all(everyone(ok)))
        if result is not None and result.mismatched:
            note = f"rank {rank}: {len(result.mismatched)} differ, first {', '.join(result.mismatched[:3])}"
    except unavailable as exc:
        skipped = str(exc)
    except Exception as exc:
        note = f"rank {rank}: {type(exc).__name__}: {exc}"[:300]
    gathered = everyone({"note": note, "skipped": skipped, "result": None if result is None else {
        "tensors": result.tensors, "objects": result.objects, "load_s": result.load_s}})
    shutil.rmtree(path, ignore_errors=True)
    done = [e["result"] for e in gathered if e["result"]]
    notes = [e["note"] for e in gathered if e["note"]]
    skips = [e["skipped"] for e in gathered if e["skipped"]]
    entry = {"tensors": sum(d["tensors"] for d in done), "objects": sum(d["objects"] for d in done),
             "load_s": max((d["load_s"] for d in done), default=None), "ranks": len(gathered)}
    if notes:
        entry["failed"] = "; ".join(notes)
    elif skips:
        entry["skipped"] = skips[0]
    elif len(done) < len(gathered):  # cannot happen without a note; never report it as passed
        entry["failed"] = f"{len(gathered) - len(done)} rank(s) returned no result"
    return entry
