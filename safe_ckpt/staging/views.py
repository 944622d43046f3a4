"""Host views of tensor bytes, and the contiguous runs of a strided chunk.

One job: say how a chunk's bytes can be read where they lie. ``host_memoryview`` gives a
contiguous host tensor's bytes as a read-only memoryview without copying them;
``chunk_view`` narrows a source to a chunk's box; ``run_split`` / ``run_views`` find the
few large contiguous runs a strided chunk (half of a fused weight, say) consists of, so
they can be written or copied in place instead of through a staging copy.

Must not: copy bytes, allocate host memory, or touch a device.
"""

from __future__ import annotations

import ctypes

import torch

_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory  # ~1 us; a ctypes array type per length took ~8
_memory_view.restype = ctypes.py_object
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_READ = 0x100


def host_memoryview(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, read-only, without copying them (the caller keeps
    the tensor alive while the view is used)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return _memory_view(tensor.data_ptr(), nbytes, _PYBUF_READ)


MAX_RUNS = 4096  # past this many pieces a strided chunk is copied instead
MIN_RUN_BYTES = 64 * 1024  # smaller pieces make vectored writes / per-piece copies inefficient


def run_split(tensor: torch.Tensor) -> int | None:
    """How many leading dimensions enumerate the tensor's contiguous runs, or None if the
    runs would be too many or too small.

    The trailing dimensions that are laid out contiguously form one run; a slice of a
    fused weight (one half of a gate/up pair, say) is a handful of large runs that can be
    written or copied in place instead of through a staging copy.
    """
    shape, strides = list(tensor.shape), list(tensor.stride())
    expected, k = 1, len(shape)
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == expected):
        expected *= shape[k - 1]
        k -= 1
    count = 1
    for size in shape[:k]:
        count *= size
    if count > MAX_RUNS or expected * tensor.element_size() < MIN_RUN_BYTES:
        return None
    return k


def run_views(tensor: torch.Tensor, k: int) -> list[torch.Tensor]:
    """The contiguous runs as tensors, in row-major order."""
    views = [tensor]
    for _ in range(k):
        views = [row for v in views for row in v.unbind(0)]
    return views


def chunk_view(source: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    view = source
    for axis, (start, length) in enumerate(zip(offsets, sizes)):
        if start != 0 or length != view.shape[axis]:
            view = view.narrow(axis, start, length)
    return view
