"""A rank's read plan: which byte ranges of which stored items fill which destination tensors.

One job: from the ShardedTensors a rank asks for and the checkpoint's index, list every stored
chunk that overlaps each request (resharding = copying the overlapping sub-box), how each
overlap travels (`direct`: one byte range read straight into a contiguous host tensor;
`flat`: one byte range through the pinned pool to a contiguous GPU tensor; `strided`: whole
rows through a buffer, then a strided copy, which also converts dtypes and fills tensor
subclasses), and group items that lie back to back in a file into batches read with one call.
It checks what the index promises before any byte is read: the key exists, the global shape
matches (unless the request allows a mismatch), the chunks cover the request exactly once,
and every file is long enough for its items. Each problem names the key, the file and the rank.
Must not: read tensor data, or talk to other ranks.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from .. import compat
from ..errors import RankFailure, ReadError, ValidationError
from . import boxes, container
from .boxes import Box
from .index import CheckpointIndex, StoredItem

DIRECT, FLAT, STRIDED = "direct", "flat", "strided"
_BATCH_MAX_ITEMS = 256


@dataclass(frozen=True)
class Destination:
    """Where one requested shard goes: ``view`` has the shard's global box shape (prepended axes as 1s)."""

    key: str
    tensor: torch.Tensor  # what the load returns for the shard (the template itself, detached)
    view: torch.Tensor
    box: Box
    flat_bytes: torch.Tensor | None  # the view's bytes as a 1-D uint8 tensor, where it is contiguous
    memory: memoryview | None  # the same bytes, writable, where they are plain host memory


@dataclass(frozen=True)
class Piece:
    dest: int  # index into ReadPlan.destinations
    in_chunk: Box  # the overlap, relative to the stored chunk
    in_dest: Box  # the same overlap, relative to the destination's box
    mode: str
    payload_start: int = -1  # byte range inside the payload (direct and flat)
    payload_end: int = -1
    dest_start: int = -1  # first byte inside the destination (direct and flat)


@dataclass(frozen=True)
class ItemRead:
    fqn: str
    item: StoredItem
    dtype: torch.dtype
    sizes: tuple
    frame: container.Frame | None  # None: decoded with torch.load (not the standard archive)
    pieces: tuple
    checksum: object = None  # integrity.ItemChecksum, where the manifest has one

    @property
    def whole(self) -> bool:
        """Whether byte-range pieces fill the payload exactly once, in order."""
        at = 0
        for p in self.pieces:
            if p.mode == STRIDED or p.payload_start != at:
                return False
            at = p.payload_end
        return self.frame is not None and at == self.frame.payload_bytes

    @property
    def byte_copies(self) -> bool:
        return all(p.mode in (DIRECT, FLAT) for p in self.pieces)


@dataclass(frozen=True)
class Batch:
    """Items read with one call: back to back in one file (or a single item)."""

    items: tuple

    @property
    def length_bytes(self) -> int:
        return sum(i.item.length_bytes for i in self.items)


@dataclass(frozen=True)
class ReadPlan:
    destinations: tuple
    batches: tuple
    payload_bytes: int


def destination(sh_ten) -> Destination:
    """The tensor a ShardedTensor is loaded into (made as stock makes it where ``data`` is None)."""
    data = sh_ten.data
    if data is None:
        init = torch.zeros if sh_ten.allow_shape_mismatch else torch.empty
        data = init(sh_ten.local_shape, dtype=sh_ten.dtype, device="cpu")
        sh_ten.data = data
    else:
        data = data.detach()
        if sh_ten.allow_shape_mismatch:
            data.zero_()  # what the checkpoint does not cover stays zero, as stock loads it
    view = data
    for _ in range(sh_ten.prepend_axis_num):
        view = view.unsqueeze(0)
    box = Box(tuple(sh_ten.global_offset), tuple(view.shape))
    flat = memory = None
    if type(data) is torch.Tensor and data.is_contiguous():
        flat = data.reshape(-1).view(torch.uint8) if data.numel() else None
        if flat is not None and data.is_cpu:
            memory = memoryview(flat.numpy()).cast("B")
    return Destination(sh_ten.key, data, view, box, flat, memory)


class _Candidates:
    """The chunks of one stored tensor that may overlap a box, found by their first-axis range."""

    def __init__(self, chunks: tuple) -> None:
        self.chunks = chunks
        self.starts = [c.offsets[0] if c.offsets else 0 for c in chunks]
        self.longest = max((c.sizes[0] if c.sizes else 1 for c in chunks), default=0)

    def near(self, box: Box) -> tuple:
        if not box.offsets:
            return self.chunks
        lo = bisect.bisect_left(self.starts, box.offsets[0] - self.longest + 1)
        hi = bisect.bisect_left(self.starts, box.offsets[0] + box.sizes[0])
        return self.chunks[lo:hi]


def _piece(dest_index: int, dest: Destination, chunk_box: Box, ov: Box, stored_dtype) -> Piece:
    itemsize = compat.dtype_itemsize(stored_dtype)
    same = dest.view.dtype == stored_dtype and dest.flat_bytes is not None
    if same and (ov is chunk_box is dest.box or ov == chunk_box == dest.box):  # the shard is the stored chunk
        whole = Box((0,) * len(ov.sizes), ov.sizes)
        return Piece(dest_index, whole, whole, DIRECT if dest.memory is not None else FLAT, 0,
                     ov.numel * itemsize, 0)
    in_chunk, in_dest = ov.relative_to(chunk_box), ov.relative_to(dest.box)
    if same and boxes.is_contiguous(in_chunk, chunk_box.sizes) and boxes.is_contiguous(in_dest, dest.box.sizes):
        start = boxes.flat_start(in_chunk, chunk_box.sizes) * itemsize
        dest_start = boxes.flat_start(in_dest, dest.box.sizes) * itemsize
        mode = DIRECT if dest.memory is not None else FLAT
        return Piece(dest_index, in_chunk, in_dest, mode, start, start + ov.numel * itemsize, dest_start)
    return Piece(dest_index, in_chunk, in_dest, STRIDED)


def build(requests: list, index: CheckpointIndex, source, *, rank: int, batch_bytes: int, piece_bytes: int,
          checksums: bool) -> tuple[ReadPlan | None, list[RankFailure]]:
    """``requests``: the rank's ShardedTensors. Returns the plan, or the problems that stop it."""
    problems: list[RankFailure] = []

    def problem(kind: type, key: str, message: str) -> None:
        problems.append(RankFailure.of(kind, rank, "plan", message, key=key))

    destinations: list[Destination] = []
    by_item: dict = {}
    candidates: dict = {}
    for sh_ten in requests:
        stored = index.tensors.get(sh_ten.key)
        if stored is None:
            problem(ValidationError, sh_ten.key, f"not in the checkpoint {index.where} (it holds "
                                                   f"{len(index.tensors)} tensors; a renamed or new parameter?)")
            continue
        if not sh_ten.allow_shape_mismatch and tuple(sh_ten.global_shape) != stored.size:
            problem(ValidationError, sh_ten.key, f"global shape mismatch: the checkpoint holds {stored.size}, "
                                                   f"the state dict expects {tuple(sh_ten.global_shape)}")
            continue
        if len(sh_ten.global_shape) != len(stored.size):
            problem(ValidationError, sh_ten.key, f"the checkpoint holds {len(stored.size)} dimensions, the state "
                                                   f"dict expects {len(sh_ten.global_shape)}")
            continue
        dest_index = len(destinations)
        dest = destination(sh_ten)
        destinations.append(dest)
        if stored.fqn not in candidates:
            candidates[stored.fqn] = _Candidates(stored.chunks)
        covered = 0
        box = dest.box
        for chunk in candidates[stored.fqn].near(box):
            if chunk.offsets == box.offsets and chunk.sizes == box.sizes:  # the shard as saved: no arithmetic
                chunk_box = ov = box
            else:
                chunk_box = Box(chunk.offsets, chunk.sizes)
                ov = boxes.overlap(box, chunk_box)
                if ov is None:
                    continue
            covered += ov.numel
            key = (chunk.item.relative_path, chunk.item.offset_bytes)
            entry = by_item.get(key)
            if entry is None:
                entry = by_item[key] = (stored, chunk, [])
            entry[2].append(_piece(dest_index, dest, chunk_box, ov, stored.dtype))
        wanted = dest.box.numel
        if covered > wanted or (covered < wanted and not sh_ten.allow_shape_mismatch):
            problem(ReadError, sh_ten.key, f"the checkpoint's chunks cover {covered} of the {wanted} elements "
                                             f"requested at {dest.box.offsets} of {dest.box.sizes} "
                                             f"({'overlapping' if covered > wanted else 'with gaps'}): its index "
                                             f"{index.where}/.metadata is inconsistent")

    items = []
    sizes: dict = {}
    for (path, _), (stored, chunk, pieces) in by_item.items():
        item = chunk.item
        if path not in sizes:
            try:
                sizes[path] = source.size_bytes(path)
            except Exception as exc:
                problem(ReadError, stored.fqn, str(exc))
                sizes[path] = -1
        size = sizes[path]
        if size is not None and 0 <= size < item.offset_bytes + item.length_bytes:
            problem(ReadError, stored.fqn, f"{source.describe(path)} is {size} bytes, but the item of this key lies "
                                             f"at [{item.offset_bytes}, {item.offset_bytes + item.length_bytes}) "
                                             f"(truncated file?)")
            continue
        frame = container.frame(stored.dtype, chunk.sizes)
        if frame is not None and frame.item_bytes != item.length_bytes:
            frame = None  # another writer's archive layout: torch.load decodes it
        if len(pieces) > 1:
            pieces.sort(key=lambda p: (p.mode == STRIDED, p.payload_start))
        checksum = index.checksums.get((path, item.offset_bytes)) if checksums else None
        items.append(ItemRead(stored.fqn, item, stored.dtype, chunk.sizes, frame, tuple(pieces), checksum))
    if problems:
        return None, problems
    items.sort(key=lambda i: (i.item.relative_path, i.item.offset_bytes))
    return ReadPlan(tuple(destinations), _batches(items, batch_bytes, piece_bytes),
                    sum(i.item.length_bytes for i in items)), []


def _batchable(read: ItemRead, batch_bytes: int, piece_bytes: int) -> bool:
    """Small items, and items that fit a piece and go wholly through the pool anyway (GPU
    destinations): back to back, several share one read and one piece instead of a read each."""
    if not (read.whole and read.byte_copies):
        return False
    n = read.item.length_bytes
    return n <= batch_bytes or (n <= piece_bytes and all(p.mode == FLAT for p in read.pieces))


def _batches(items: list, batch_bytes: int, piece_bytes: int) -> tuple:
    out, run, run_bytes = [], [], 0
    for read in items:
        batchable = _batchable(read, batch_bytes, piece_bytes)
        if run:
            last = run[-1].item
            follows = (read.item.relative_path == last.relative_path
                       and read.item.offset_bytes == last.offset_bytes + last.length_bytes)
            fits = run_bytes + read.item.length_bytes <= piece_bytes and len(run) < _BATCH_MAX_ITEMS
            if not (follows and fits and batchable):
                out.append(Batch(tuple(run)))
                run, run_bytes = [], 0
        if batchable:
            run.append(read)
            run_bytes += read.item.length_bytes
        else:
            out.append(Batch((read,)))
    if run:
        out.append(Batch(tuple(run)))
    return tuple(out)
