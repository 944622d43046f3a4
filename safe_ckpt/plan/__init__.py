"""Plan: from a sharded state dict to the list of items every rank will write.

Call order: `collect` (per rank) → residence classification (by the caller) →
`rank_plan` → exchange among ranks → `build_global_plan` (same result on every rank).
Must not: touch CUDA or files.
"""

from __future__ import annotations

import logging
from functools import partial

from .chunking import balanced_cuts, cut_rows, slot_of, split_box, tail_chunk_bytes, tail_start
from .collect import DraftShard, LocalState, collect
from .memo import PlanMemo, TensorPlan, process_memo, signature
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
    UNSENT_PATH,
)
from .validate import validate

log = logging.getLogger("safe_ckpt")

__all__ = [
    "Box", "ChunkSpec", "DraftShard", "GlobalPlan", "LocalState", "ObjectRef", "ObjectSpec", "Problem",
    "PlanMemo", "RankPlan", "ShardRef", "TensorPlan", "TensorSpec", "build_global_plan", "collect", "process_memo",
    "rank_plan", "validate",
]


def rank_plan(local: LocalState, residences: list[str], extra_problems: list[Problem],
              with_paths: bool = True) -> RankPlan:
    """The exchanged record of one rank; ``residences`` is aligned with ``local.shards``. Without
    ``with_paths`` it is the plan as exchanged (`RankPlan.without_paths`), built once."""
    rank = local.rank
    shards = [
        ShardRef(d.key, rank, i, d.dtype, d.global_shape, d.box, d.is_main, residences[i],
                 d.path if with_paths else UNSENT_PATH)
        for i, d in enumerate(local.shards)
    ]
    return RankPlan(local.rank, shards, list(local.objects), list(local.problems) + list(extra_problems))


def build_global_plan(plans: list[RankPlan], chunk_bytes: int, files_per_rank: int = 1,
                      remember: PlanMemo | None = None) -> GlobalPlan | list[Problem]:
    """The checkpoint's items, or the problems that prevent it (identical on every rank).
    Each rank's chunks are spread over up to ``files_per_rank`` file slots of equal bytes, and
    cut when first asked for (`GlobalPlan.chunks_of`). With ``remember`` (`process_memo`), shards
    equal to the last accepted plan's reuse its checked tensor keys and cut chunks (`memo`)."""
    sig = signature(plans, chunk_bytes, files_per_rank) if remember is not None else None
    known = remember.get(sig) if remember is not None else None
    problems = validate(plans, tensor_keys_checked=known is not None)
    if problems:
        return problems
    objects = [ObjectSpec(o.fqn, o.rank, o.payload_bytes) for plan in plans for o in plan.objects if o.is_main]
    mains = {plan.rank: [s for s in plan.shards if s.is_main] for plan in plans}
    chunker = partial(_chunks_of_rank, mains, chunk_bytes, files_per_rank)
    if known is not None:
        log.debug("planning: the shards equal the previous save's; its checked and cut tensor plan is reused")
        return GlobalPlan(len(plans), known.tensors, objects, chunker, known.chunks)
    tensors: dict[str, TensorSpec] = {}
    for plan in plans:
        for s in plan.shards:
            if s.key not in tensors:
                tensors[s.key] = TensorSpec(s.key, s.dtype, s.global_shape)
    ordered = [tensors[k] for k in sorted(tensors)]
    cut: dict = {}  # shared with the memo: chunks are a pure function of its signature
    if remember is not None:
        remember.put(TensorPlan(sig, ordered, cut))
    return GlobalPlan(len(plans), ordered, objects, chunker, cut)


def _chunks_of_rank(mains: dict, chunk_bytes: int, files_per_rank: int, rank: int) -> list[ChunkSpec]:
    return _rank_chunks(mains.get(rank, []), chunk_bytes, files_per_rank)


def _rank_chunks(shards: list[ShardRef], chunk_bytes: int, files_per_rank: int) -> list[ChunkSpec]:
    sizes = [s.box.numel * s.dtype.itemsize for s in shards]
    whole = sum(len(split_box(s.box.sizes, s.dtype.itemsize, chunk_bytes)) for s in shards)
    slots = max(1, min(files_per_rank, whole))
    total = sum(sizes)
    # A cut costs one more item; pieces of chunk_bytes/256 (1 MiB by default) still write at full speed.
    cuts = balanced_cuts(sizes, slots, max(1, chunk_bytes // 256)) if slots > 1 else [[] for _ in shards]
    pieces, pos = [], 0  # (shard, piece box, slot)
    slot_bytes = [0] * slots
    for s, shard_cuts in zip(shards, cuts):
        for piece in cut_rows(s.box.sizes, s.dtype.itemsize, shard_cuts):
            piece_bytes = piece.numel * s.dtype.itemsize
            # By its middle: an uncut shard across a run's end goes where most of it lies.
            slot = slot_of(pos + piece_bytes // 2, total, slots)
            pieces.append((s, piece, slot))
            slot_bytes[slot] += piece_bytes
            pos += piece_bytes
    tails = [tail_start(n, chunk_bytes) if slots > 1 else n for n in slot_bytes]
    chunks, in_slot = [], [0] * slots
    for s, piece, slot in pieces:
        for sub in split_box(piece.sizes, s.dtype.itemsize, chunk_bytes):
            sub_bytes = sub.numel * s.dtype.itemsize
            ends_in_tail = in_slot[slot] + sub_bytes > tails[slot]
            in_slot[slot] += sub_bytes
            parts = split_box(sub.sizes, s.dtype.itemsize, tail_chunk_bytes(chunk_bytes)) if ends_in_tail else [None]
            for part in parts:
                offsets = tuple(p + d for p, d in zip(piece.offsets, sub.offsets))
                box = sub
                if part is not None:
                    offsets = tuple(o + d for o, d in zip(offsets, part.offsets))
                    box = part
                global_offsets = tuple(o + d for o, d in zip(s.box.offsets, offsets))
                chunks.append(ChunkSpec(s.key, s.dtype, s.rank, s.local_index, Box(global_offsets, box.sizes),
                                        Box(offsets, box.sizes), slot))
    return chunks
