"""Split a shard's box into chunks of bounded payload size.

One job: given a box (sizes) and an element size, return sub-boxes that tile it, each
at most ``max_bytes`` of payload and each contiguous in a C-contiguous source: leading
axes are split first, so a chunk is a run of whole rows (or, when one row is too big,
a run inside a single row). Must not: know about tensors, files or ranks.
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
