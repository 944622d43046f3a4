"""Prove that what the bench times is a real checkpoint: one more, untimed safe_ckpt save of
the bench state, loaded back with stock `megatron.core.dist_checkpointing.load` into fresh
host tensors and compared bit for bit with the state, on every rank.

One job: that round trip for one saver, run after a target's timed runs so it cannot change
what they measure. Must not: time a save for the report, keep the checkpoint, or copy
anything host-to-device (the state is read device-to-host to compare it).
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


def compare(loaded: dict, expected: dict) -> Verified:
    """Every tensor, object and plain value of ``expected`` (a sharded state) against ``loaded``."""
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
            ok = isinstance(loaded[key], torch.Tensor) and bits_equal(loaded[key], value.data)
        else:
            objects += 1
            ok = loaded[key] == (value.data if isinstance(value, ShardedObject) else value)
        if not ok:
            bad.append(key)
    return Verified(tensors, objects, tuple(bad), 0.0)


def round_trip(state, path: str, save) -> Verified:
    """``save(state, path)`` once more, load it back with stock Megatron, compare, remove it."""
    from megatron.core import dist_checkpointing

    try:
        save(state, path)
        t0 = time.perf_counter()
        loaded = dist_checkpointing.load(_empty_like_sharded(state.make_sharded()), path)
        load_s = time.perf_counter() - t0
        return dataclasses.replace(compare(loaded, state.make_sharded()), load_s=load_s)
    finally:
        shutil.rmtree(path, ignore_errors=True)
