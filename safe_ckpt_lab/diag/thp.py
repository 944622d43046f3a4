"""A staging pool on transparent huge pages, for `benchmarks/diag/diag_thp.py`.

One job: host memory advised for transparent huge pages (a reader walks one page-table entry
per 2 MiB, not per 4 KiB) and a `PinnedPool` made of it. The library's pool uses ordinary
pages: a pool on huge pages saved no faster (benchmarks/results/HISTORY.md, "Measured and not
shipped" in benchmarks/README.md). Must not: be imported by the library.
"""

from __future__ import annotations

import mmap

import torch

from safe_ckpt.staging.pool import PinnedPool, host_buffer as plain_buffer


def host_buffer(nbytes: int, huge_pages: bool = True) -> torch.Tensor:
    """``nbytes`` of pageable host memory as a uint8 tensor; with ``huge_pages``, a private
    anonymous mapping advised for transparent huge pages, where this platform has
    MADV_HUGEPAGE. The tensor keeps the mapping alive; it is unmapped when the last view of
    it goes."""
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE") and nbytes > 0:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
        return torch.frombuffer(mapping, dtype=torch.uint8)
    return plain_buffer(nbytes)


class HugePagePool(PinnedPool):
    """A `PinnedPool` whose one buffer is advised for transparent huge pages."""

    def _host_buffer(self) -> torch.Tensor:
        return host_buffer(self.capacity_bytes)


def pool(capacity_bytes: int, pinned: bool | None = None, huge_pages: bool = True) -> PinnedPool:
    """A pool on huge pages, or (``huge_pages`` False) the library's own, to compare them."""
    return (HugePagePool if huge_pages else PinnedPool)(capacity_bytes, pinned=pinned)
