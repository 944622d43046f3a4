"""The frozen records the plan stage hands on, and that ranks exchange.

Everything here is metadata only (no tensors), small and picklable, so the same
objects travel over the gloo group and feed the later stages (a rank plan travels
`without_paths`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import errors


def volume(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


@dataclass(frozen=True)
class Box:
    """A rectangular region: ``offsets`` and ``sizes`` per axis."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return volume(self.sizes)

    def end(self, axis: int) -> int:
        return self.offsets[axis] + self.sizes[axis]


@dataclass(frozen=True)
class ShardRef:
    """One tensor shard as one rank holds it."""

    key: str
    rank: int
    local_index: int  # position of its source tensor in that rank's source list
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    box: Box  # in global coordinates, prepended axes included (size 1 there)
    is_main: bool
    residence: str
    path: str  # where it sits in the caller's state dict, for messages

    @property
    def payload_bytes(self) -> int:
        return self.box.numel * self.dtype.itemsize


@dataclass(frozen=True)
class ObjectRef:
    """One ShardedObject as one rank holds it; its payload is already encoded."""

    fqn: str  # f"{key}/shard_{offsets}_{shape}"
    key: str
    rank: int
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    is_main: bool
    payload_bytes: int
    path: str


@dataclass(frozen=True)
class Problem:
    """Something that makes the state unsaveable; turned into an error on every rank."""

    kind: type | str  # the error's class (a CheckpointError subclass); stored as its shown family's name
    key: str
    ranks: tuple[int, ...]
    message: str
    lineage: tuple[str, ...] = field(default=(), compare=False)  # the class's CheckpointError names, most specific first

    def __post_init__(self) -> None:
        if isinstance(self.kind, type):  # kept as plain strings: the wire carries no class objects
            object.__setattr__(self, "lineage", errors.lineage(self.kind))
            object.__setattr__(self, "kind", errors.shown_kind(self.kind))

    @property
    def error(self) -> type:
        """The class every rank raises for this problem (the most specific one it knows)."""
        return errors.error_class(self.lineage or (self.kind,))


@dataclass(frozen=True)
class RankPlan:
    """What one rank contributes to the plan exchange."""

    rank: int
    shards: list[ShardRef] = field(default_factory=list)
    objects: list[ObjectRef] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    def __reduce__(self):
        # Every rank unpickles every rank's plan: shards as rows of plain values load about
        # twice as fast as ShardRef and Box objects restored field by field, and pickle five
        # times as fast (figures: benchmarks/results/HISTORY.md).
        rows = [(s.key, s.rank, s.local_index, s.dtype, s.global_shape, s.box.offsets, s.box.sizes, s.is_main,
                 s.residence, s.path) for s in self.shards]
        return _plan_from_rows, (self.rank, rows, self.objects, self.problems)

    def paths(self) -> list[str]:
        """Where each shard sits in its caller's dict, in shard order."""
        return [s.path for s in self.shards]

    def without_paths(self) -> "RankPlan":
        """This plan as it is exchanged: every shard's path the one UNSENT_PATH object, which
        pickles once for the whole plan (the paths are most of a plan's bytes and are read only
        to word the errors of a refused plan; `with_paths` puts them back)."""
        return self.with_paths([UNSENT_PATH] * len(self.shards))

    def with_paths(self, paths: list[str]) -> "RankPlan":
        """This plan with its shards' paths replaced by ``paths`` (that rank's `paths`)."""
        if len(paths) != len(self.shards):
            raise ValueError(f"rank {self.rank} sent {len(paths)} paths for {len(self.shards)} shards")
        shards = [ShardRef(s.key, s.rank, s.local_index, s.dtype, s.global_shape, s.box, s.is_main, s.residence, p)
                  for s, p in zip(self.shards, paths)]
        return RankPlan(self.rank, shards, self.objects, self.problems)


UNSENT_PATH = "<path not exchanged>"


def _plan_from_rows(rank: int, rows: list, objects: list, problems: list) -> RankPlan:
    new = object.__new__
    shards = []
    for key, shard_rank, local_index, dtype, global_shape, offsets, sizes, is_main, residence, path in rows:
        box = new(Box)
        box.__dict__.update(offsets=offsets, sizes=sizes)  # frozen: the fields as __init__ would set them
        shard = new(ShardRef)
        shard.__dict__.update(key=key, rank=shard_rank, local_index=local_index, dtype=dtype,
                              global_shape=global_shape, box=box, is_main=is_main, residence=residence, path=path)
        shards.append(shard)
    return RankPlan(rank, shards, objects, problems)


@dataclass(frozen=True)
class ChunkSpec:
    """One stored tensor item: a bounded sub-box of a main-replica shard."""

    fqn: str
    dtype: torch.dtype
    rank: int  # the rank that writes it
    local_index: int
    global_box: Box  # where the chunk sits in the global tensor
    shard_box: Box  # where it sits inside the shard (prepended axes included)
    file_slot: int = 0  # which of the writing rank's files (balanced by bytes) it goes to

    @property
    def payload_bytes(self) -> int:
        return self.global_box.numel * self.dtype.itemsize


@dataclass(frozen=True)
class ObjectSpec:
    """One stored bytes item."""

    fqn: str
    rank: int
    payload_bytes: int


@dataclass(frozen=True)
class TensorSpec:
    """One global tensor of the checkpoint."""

    fqn: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]


@dataclass(frozen=True)
class GlobalPlan:
    """The whole checkpoint's content: identical on every rank.

    A rank's chunks are cut when first asked for (``chunker(rank)``, a pure function of the
    exchanged plans, so the same everywhere): to start writing a rank needs its own only;
    every rank's are needed for the index, which rank 0 builds while its writers write. At 8
    ranks of 1217 shards, cutting all of them is most of the planning's time."""

    world_size: int
    tensors: list[TensorSpec]
    objects: list[ObjectSpec]
    chunker: Callable[[int], list[ChunkSpec]] = field(compare=False, repr=False)
    _cut: dict = field(default_factory=dict, compare=False, repr=False)  # rank -> its chunks, once cut

    def chunks_of(self, rank: int) -> list[ChunkSpec]:
        chunks = self._cut.get(rank)
        if chunks is None:  # two threads asking at once cut the same list twice; either is kept
            chunks = self._cut.setdefault(rank, self.chunker(rank))
        return chunks

    @property
    def chunks(self) -> list[ChunkSpec]:
        return [c for rank in range(self.world_size) for c in self.chunks_of(rank)]

    def objects_of(self, rank: int) -> list[ObjectSpec]:
        return [o for o in self.objects if o.rank == rank]

    @property
    def payload_bytes(self) -> int:
        return sum(c.payload_bytes for c in self.chunks) + sum(o.payload_bytes for o in self.objects)
