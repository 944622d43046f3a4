"""Plan: from a sharded state dict to the list of items every rank will write.

Call order: `collect` (per rank) → residence classification (by the caller) →
`rank_plan` → exchange among ranks → `build_global_plan` (same result on every rank).
Must not: touch CUDA or files.
"""

from __future__ import annotations

from .chunking import split_box
from .collect import DraftShard, LocalState, collect
from .records import (
    Box,
    ChunkSpec,
    GlobalPlan,
    ObjectRef,
    ObjectSpec,
    Problem,
    RankPlan,
    ShardRef,
    TensorSpec,
)
from .validate import validate

__all__ = [
    "Box", "ChunkSpec", "DraftShard", "GlobalPlan", "LocalState", "ObjectRef", "ObjectSpec", "Problem",
    "RankPlan", "ShardRef", "TensorSpec", "build_global_plan", "collect", "rank_plan", "validate",
]


def rank_plan(local: LocalState, residences: list[str], extra_problems: list[Problem]) -> RankPlan:
    """The exchanged record of one rank; ``residences`` is aligned with ``local.shards``."""
    shards = [
        ShardRef(
            key=d.key, rank=local.rank, local_index=i, dtype=d.dtype, global_shape=d.global_shape,
            box=d.box, is_main=d.is_main, residence=residences[i], path=d.path,
        )
        for i, d in enumerate(local.shards)
    ]
    return RankPlan(local.rank, shards, list(local.objects), list(local.problems) + list(extra_problems))


def build_global_plan(plans: list[RankPlan], chunk_bytes: int) -> GlobalPlan | list[Problem]:
    """The checkpoint's items, or the problems that prevent it (identical on every rank)."""
    problems = validate(plans)
    if problems:
        return problems
    tensors: dict[str, TensorSpec] = {}
    chunks: list[ChunkSpec] = []
    objects: list[ObjectSpec] = []
    for plan in plans:
        for s in plan.shards:
            tensors.setdefault(s.key, TensorSpec(s.key, s.dtype, s.global_shape))
            if not s.is_main:
                continue
            for sub in split_box(s.box.sizes, s.dtype.itemsize, chunk_bytes):
                global_offsets = tuple(o + d for o, d in zip(s.box.offsets, sub.offsets))
                chunks.append(
                    ChunkSpec(s.key, s.dtype, s.rank, s.local_index, Box(global_offsets, sub.sizes), sub)
                )
        for o in plan.objects:
            if o.is_main:
                objects.append(ObjectSpec(o.fqn, o.rank, o.payload_bytes))
    ordered = [tensors[k] for k in sorted(tensors)]
    return GlobalPlan(len(plans), ordered, chunks, objects)
