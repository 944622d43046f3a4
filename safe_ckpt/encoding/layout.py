"""Where every item goes: which file of which rank, at which byte offset.

One job: from the global plan compute each rank's files and the byte range of every
item in them. Item sizes are known up front (`torchzip` containers for tensor chunks,
the encoded payload for objects), so the whole layout is a pure function of the plan
and identical on every rank. Must not: touch tensor data or files.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..names import data_file
from ..plan.records import ChunkSpec, GlobalPlan, ObjectSpec
from . import torchzip


@lru_cache(maxsize=1 << 16)
def _container_overhead_bytes(dtype: torch.dtype, sizes: tuple[int, ...]) -> int:
    c = torchzip.tensor_container(dtype, sizes)
    return c.total_bytes - c.payload_bytes


def item_bytes(chunk: ChunkSpec) -> int:
    return _container_overhead_bytes(chunk.dtype, chunk.global_box.sizes) + chunk.payload_bytes


@dataclass(frozen=True)
class PlacedItem:
    fqn: str
    relative_path: str
    offset_bytes: int
    length_bytes: int
    chunk: ChunkSpec | None = None  # a tensor item
    obj: ObjectSpec | None = None  # a bytes item


@dataclass(frozen=True)
class FileSpec:
    relative_path: str
    size_bytes: int
    items: list[PlacedItem]


@dataclass(frozen=True)
class RankLayout:
    rank: int
    files: list[FileSpec]

    @property
    def file_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)

    @property
    def items(self) -> list[PlacedItem]:
        return [item for f in self.files for item in f.items]


def file_name(rank: int, index: int, tag: str = "") -> str:
    return data_file(rank, index, tag)


def lay_out_rank(plan: GlobalPlan, rank: int, *, one_item_per_file: bool = False,
                 tag: str = "") -> RankLayout:
    """This rank's files. ``one_item_per_file`` is for stores that write whole values only
    (kvstores); ``tag`` makes file names unique to one save (loaders follow `.metadata`,
    so names are free)."""
    chunks = plan.chunks_of(rank)
    objects = plan.objects_of(rank)
    if one_item_per_file:
        files, n = [], 0
        for entry in [*objects, *chunks]:
            path = file_name(rank, n, tag)
            if isinstance(entry, ChunkSpec):
                placed = PlacedItem(entry.fqn, path, 0, item_bytes(entry), chunk=entry)
            else:
                placed = PlacedItem(entry.fqn, path, 0, entry.payload_bytes, obj=entry)
            files.append(FileSpec(path, placed.length_bytes, [placed]))
            n += 1
        return RankLayout(rank, files)
    if not (chunks or objects):
        return RankLayout(rank, [])
    # The plan balanced the chunks over file slots by bytes; objects (small) go to file 0.
    per_file: list[list] = [[] for _ in range(1 + max((c.file_slot for c in chunks), default=0))]
    per_file[0].extend(objects)
    for chunk in chunks:
        per_file[chunk.file_slot].append(chunk)
    files = []
    for index, entries in enumerate(per_file):
        if not entries:
            continue
        path = file_name(rank, index, tag)
        offset = 0
        placed = []
        for entry in entries:
            if isinstance(entry, ChunkSpec):
                length = item_bytes(entry)
                placed.append(PlacedItem(entry.fqn, path, offset, length, chunk=entry))
            else:
                length = entry.payload_bytes
                placed.append(PlacedItem(entry.fqn, path, offset, length, obj=entry))
            offset += length
        files.append(FileSpec(path, offset, placed))
    return RankLayout(rank, files)


def lay_out(plan: GlobalPlan, *, one_item_per_file: bool = False,
            tag: str = "") -> list[RankLayout]:
    return [lay_out_rank(plan, rank, one_item_per_file=one_item_per_file, tag=tag)
            for rank in range(plan.world_size)]
