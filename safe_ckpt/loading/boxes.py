"""Box arithmetic for resharding: where a requested region and a stored chunk meet, in bytes.

One job: given boxes (offsets, sizes) in a tensor's global index space, compute their
overlap, whether a sub-box is one contiguous run of a C-ordered outer box, and where that
run starts. Must not: touch tensors or files.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    offsets: tuple
    sizes: tuple

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def relative_to(self, outer: "Box") -> "Box":
        return Box(tuple(o - p for o, p in zip(self.offsets, outer.offsets)), self.sizes)


def overlap(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same rank, or None where it is empty."""
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offsets), tuple(sizes))


def is_contiguous(inner: Box, outer_sizes: tuple) -> bool:
    """Whether ``inner`` (offsets relative to the outer box) is one run of the outer box in C order:
    leading dimensions of size 1, then one partial dimension, then only whole dimensions."""
    partial_seen = False
    for size, full in zip(inner.sizes, outer_sizes):
        if partial_seen and size != full:
            return False
        if size != 1:
            partial_seen = True
    return True


def flat_start(inner: Box, outer_sizes: tuple) -> int:
    """The C-order element index, within the outer box, of ``inner``'s first element."""
    index = 0
    for offset, full in zip(inner.offsets, outer_sizes):
        index = index * full + offset
    return index


def row_elements(sizes: tuple) -> int:
    """Elements of one index along the first dimension (1 for a 0-dim tensor)."""
    n = 1
    for s in sizes[1:]:
        n *= s
    return n
