"""The previous save's tensor plan, reused when the next save's shards are the same.

One job: remember, for the last accepted set of exchanged rank plans, what depends only on
their tensor shards (the checked tensor keys, the global tensor list and every rank's chunks),
and hand it back when a later save brings shards equal in every field the plan reads (key,
local index, dtype, global shape, box, main replica, residence) with the same ``chunk_bytes``
and file slots. A training loop saves the same model every time: cutting and checking 1217
shards per rank is most of a save's planning, in the caller's thread. Objects (whose payload
sizes change from save to save) are never remembered here: the caller checks them each time.

Only a plan that passed validation is remembered, so a hit skips nothing that could refuse.
One entry per process; any difference is a miss and replaces it.
Must not: touch tensors, devices or files, or remember problems.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .records import ChunkSpec, RankPlan, TensorSpec


@dataclass(frozen=True)
class TensorPlan:
    """What the shards alone decide: valid keys, the global tensors and each rank's chunks."""

    signature: tuple
    tensors: list[TensorSpec]
    chunks: dict[int, list[ChunkSpec]]  # rank -> its chunks, those cut so far


def signature(plans: list[RankPlan], chunk_bytes: int, files_per_rank: int) -> tuple:
    """Every field of every shard the plan reads (paths, which only word errors, left out)."""
    rows = tuple(
        tuple((s.key, s.rank, s.local_index, s.dtype, s.global_shape, s.box.offsets, s.box.sizes, s.is_main,
               s.residence) for s in plan.shards)
        for plan in plans)
    return (chunk_bytes, files_per_rank, rows)


class PlanMemo:
    """The process's one remembered `TensorPlan` (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: TensorPlan | None = None

    def get(self, sig: tuple) -> TensorPlan | None:
        with self._lock:
            last = self._last
        return last if last is not None and last.signature == sig else None

    def put(self, plan: TensorPlan) -> None:
        with self._lock:
            self._last = plan

    def clear(self) -> None:
        with self._lock:
            self._last = None


process_memo = PlanMemo()
