"""Split a shard's box into chunks of bounded payload size, balanced over writer slots.

One job: given a box (sizes) and an element size, return sub-boxes that tile it, each
at most ``max_bytes`` of payload and each contiguous in a C-contiguous source: leading
axes are split first, so a chunk is a run of whole rows (or, when one row is too big,
a run inside a single row). And say where to cut a rank's shards so that its writer
slots (one file and one writer thread each) get equal bytes: with whole chunks dealt
to files the largest file set the save's end.
A slot's last ``chunk_bytes`` go in quarter-size chunks: the writers take the next item of
any file as they get free, so they end within one item of each other, and items of a
quarter the size make that spread a quarter as long (figures: benchmarks/results/HISTORY.md).
Must not: know about tensors, files or ranks.
"""

from __future__ import annotations

from .records import Box, volume


def split_box(sizes: tuple[int, ...], itemsize: int, max_bytes: int) -> list[Box]:
    """Sub-boxes (offsets relative to the box) tiling ``sizes``."""
    zero = tuple(0 for _ in sizes)
    if volume(sizes) * itemsize <= max_bytes or volume(sizes) == 0:
        return [Box(zero, tuple(sizes))]
    return list(_split(zero, tuple(sizes), itemsize, max_bytes))


def _split(offsets: tuple[int, ...], sizes: tuple[int, ...], itemsize: int, max_bytes: int):
    axis = next(i for i, s in enumerate(sizes) if s > 1)
    inner_bytes = volume(sizes[axis + 1:]) * itemsize
    if inner_bytes <= max_bytes:
        step = max(1, max_bytes // inner_bytes)
        for start in range(0, sizes[axis], step):
            n = min(step, sizes[axis] - start)
            yield Box(_with(offsets, axis, offsets[axis] + start), _with(sizes, axis, n))
        return
    for i in range(sizes[axis]):
        yield from _split(_with(offsets, axis, offsets[axis] + i), _with(sizes, axis, 1), itemsize, max_bytes)


def _with(values: tuple[int, ...], axis: int, value: int) -> tuple[int, ...]:
    return values[:axis] + (value,) + values[axis + 1:]


def cut_rows(sizes: tuple[int, ...], itemsize: int, cuts_bytes: list[int]) -> list[Box]:
    """Sub-boxes tiling ``sizes``, cut across its first axis longer than 1 at the first row
    boundary at or after each byte position in ``cuts_bytes`` (ascending, relative to the box)."""
    zero = tuple(0 for _ in sizes)
    axis = next((i for i, s in enumerate(sizes) if s > 1), None)
    if axis is None or not cuts_bytes:
        return [Box(zero, tuple(sizes))]
    row_bytes = volume(sizes[axis + 1:]) * itemsize
    rows = sorted(r for r in {-(-c // row_bytes) for c in cuts_bytes} if 0 < r < sizes[axis])
    out, start = [], 0
    for end in [*rows, sizes[axis]]:
        out.append(Box(_with(zero, axis, start), _with(tuple(sizes), axis, end - start)))
        start = end
    return out


def balanced_cuts(shard_bytes: list[int], slots: int, min_piece_bytes: int) -> list[list[int]]:
    """Where to cut each shard (byte positions inside it) so that the rank's shards, laid end
    to end, split into ``slots`` runs of equal bytes; a cut that would leave a piece under
    ``min_piece_bytes`` is not made (that run ends at a shard edge instead)."""
    total = sum(shard_bytes)
    bounds = [-(-total * f // slots) for f in range(1, slots)]
    out, pos = [], 0
    for nbytes in shard_bytes:
        cuts, last = [], 0
        for b in bounds:
            c = b - pos
            if 0 < c < nbytes and c - last >= min_piece_bytes and nbytes - c >= min_piece_bytes:
                cuts.append(c)
                last = c
        out.append(cuts)
        pos += nbytes
    return out


def slot_of(at_bytes: int, total_bytes: int, slots: int) -> int:
    """The run (of ``balanced_cuts``) that byte ``at_bytes`` of the rank's stream falls in."""
    if total_bytes <= 0:
        return 0
    return min(slots - 1, at_bytes * slots // total_bytes)


def tail_start(slot_bytes: int, chunk_bytes: int) -> int:
    """Where a writer slot's tail of smaller chunks begins (a slot of under four chunks has none)."""
    return slot_bytes - chunk_bytes if slot_bytes >= 4 * chunk_bytes else slot_bytes


def tail_chunk_bytes(chunk_bytes: int) -> int:
    return max(1, chunk_bytes // 4)
