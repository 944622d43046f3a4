"""The frozen records the plan stage hands on, and that ranks exchange.

Everything here is metadata only (no tensors), small and picklable, so the same
objects travel over the gloo group and feed the later stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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

    kind: str  # "ValidationError" or "ResidenceError"
    key: str
    ranks: tuple[int, ...]
    message: str


@dataclass(frozen=True)
class RankPlan:
    """What one rank contributes to the plan exchange."""

    rank: int
    shards: list[ShardRef] = field(default_factory=list)
    objects: list[ObjectRef] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


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
    """The whole checkpoint's content: identical on every rank."""

    world_size: int
    tensors: list[TensorSpec]
    chunks: list[ChunkSpec]
    objects: list[ObjectSpec]

    def chunks_of(self, rank: int) -> list[ChunkSpec]:
        return [c for c in self.chunks if c.rank == rank]

    def objects_of(self, rank: int) -> list[ObjectSpec]:
        return [o for o in self.objects if o.rank == rank]

    @property
    def payload_bytes(self) -> int:
        return sum(c.payload_bytes for c in self.chunks) + sum(o.payload_bytes for o in self.objects)
