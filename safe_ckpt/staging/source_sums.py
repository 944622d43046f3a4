"""What a source's bytes were when a copy window opened, and again right after its last copy.

One job: measure each checked source twice (phase 0 at the opening, phase 1 after its last copy;
the window enqueues both in its copy stream's order) and, once every measurement has landed, say
which sources' two measurements differ: some byte of it changed while the window copied it, by a
write no gate ordered (a ``.data.copy_``, a fused optimizer, another stream). Two implementations
of the one seam:
- `HostSums`: the manifest's checksum (`integrity.checksum_of`: xxh3-64, else CRC-32) of the
  source's bytes, read where they lie; for host memory (CPU tests, CPU-only runs).
- `DeviceSums`: on the source's device, eight weighted sums of each 4096-byte row's bytes (seeded
  int8 weights, none zero; exact int32 results), one int8 matrix product a source into one buffer
  per device and phase: the source is read once and never copied or widened. `changed` compares
  the two buffers on the device and brings back only the rows that differ. A change that leaves
  all eight sums of every row equal is not seen; a single changed byte always moves them.
Must not: copy payload bytes to the host, block the caller's thread, or decide when to measure.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from ..integrity import checksum_of
from .views import host_memoryview

ROW_BYTES = 4096


class SourceSums(Protocol):
    def checks(self, tensor: torch.Tensor) -> bool:
        """Whether this implementation can measure ``tensor`` (else the window relies on versions)."""

    def reserve(self, slot: int, tensor: torch.Tensor) -> None:
        """Make room for ``slot``; every slot is reserved before the first measurement."""

    def measure(self, slot: int, phase: int, tensor: torch.Tensor) -> None:
        """Measure ``tensor`` as slot ``slot``'s phase 0 (opening) or 1 (after its last copy)."""

    def changed(self) -> list[int]:
        """The slots whose phase 0 and 1 differ; call once every measurement's mark is done."""


class HostSums:
    """`integrity.checksum_of` over a contiguous host tensor's bytes."""

    def __init__(self) -> None:
        self._values: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()

    def checks(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.is_contiguous()

    def reserve(self, slot: int, tensor: torch.Tensor) -> None:
        pass

    def measure(self, slot: int, phase: int, tensor: torch.Tensor) -> None:
        value = checksum_of([host_memoryview(tensor)])
        with self._lock:
            self._values[(slot, phase)] = value

    def changed(self) -> list[int]:
        with self._lock:
            slots = sorted({slot for slot, _ in self._values})
            return [s for s in slots if self._values.get((s, 0)) != self._values.get((s, 1))]


# Eight weighted sums of each row's bytes: a change goes unseen only if it leaves all eight equal.
COLUMNS = 8
# cuBLASLt's int8 kernels may assume aligned operands: rows start on this boundary, results on it too.
ALIGN_BYTES = 256
ALIGN_ROWS = ALIGN_BYTES // (COLUMNS * 4)
GEMM_MIN_ROWS = 17  # torch._int_mm wants more than 16 rows
# The exact float64 path (few rows, or where the int8 product is refused) works in slices of this many rows.
SLICE_ROWS = 512


def _weights(device=None) -> torch.Tensor:
    """The int8 weights, [ROW_BYTES + ALIGN_BYTES, COLUMNS] (the edge row may be that long), made on
    ``device`` (no host-to-device copy) from a fixed integer hash: none zero, so any one changed byte
    moves every column."""
    h = torch.arange((ROW_BYTES + ALIGN_BYTES) * COLUMNS, dtype=torch.int64, device=device)
    h = (h * 2654435761 + 40503) % 4294967291
    h = (h ^ (h >> 13)) * 1274126177 % 4294967291
    magnitude, sign = h % 127 + 1, ((h >> 8) & 1) * 2 - 1
    return (magnitude * sign).to(torch.int8).view(ROW_BYTES + ALIGN_BYTES, COLUMNS)


@dataclass(frozen=True)
class _Layout:
    """Where a source's measurements go: rows ``first``.. of its device's buffers. Its bytes are cut
    into a head up to the first aligned address, whole rows from there, and a tail; the whole rows
    come first (their results stay aligned), then one edge row for head and tail together."""
    device: Optional[int]
    first: int
    head_bytes: int
    whole: int
    tail_bytes: int

    @property
    def rows(self) -> int:
        return self.whole + (1 if self.head_bytes or self.tail_bytes else 0)


def _layout(tensor: torch.Tensor, first: int) -> _Layout:
    nbytes = tensor.numel() * tensor.element_size()
    head = min(nbytes, -tensor.data_ptr() % ALIGN_BYTES)
    whole = (nbytes - head) // ROW_BYTES
    return _Layout(tensor.device.index, first, head, whole, nbytes - head - whole * ROW_BYTES)


class DeviceSums:
    """Weighted row sums on the device (see the module docstring). ``streams`` must be the window's
    `CudaStreams`: the sums are computed, and compared, on its copy streams."""

    def __init__(self, streams) -> None:
        self._streams = streams
        self._slots: dict[int, _Layout] = {}
        self._rows_by_device: dict[Optional[int], int] = {}
        self._buffers: dict[tuple[Optional[int], int], torch.Tensor] = {}  # (device, phase) -> int32 [rows, COLUMNS]
        self._weights: dict[Optional[int], tuple[torch.Tensor, torch.Tensor]] = {}  # device -> (int8, float64)
        self._lock = threading.Lock()

    def checks(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda" and tensor.is_contiguous()

    def reserve(self, slot: int, tensor: torch.Tensor) -> None:
        with self._lock:
            if self._buffers:
                raise RuntimeError("every slot must be reserved before the first measurement")
            device = tensor.device.index
            first = -(-self._rows_by_device.get(device, 0) // ALIGN_ROWS) * ALIGN_ROWS
            layout = self._slots[slot] = _layout(tensor, first)
            self._rows_by_device[device] = first + layout.rows

    def _buffer(self, device: Optional[int], phase: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with self._lock:
            buf = self._buffers.get((device, phase))
            if buf is None:  # allocated on the copy stream (we are inside its context): freed in its order
                # zeros: the rows skipped for alignment compare equal
                buf = self._buffers[(device, phase)] = torch.zeros(
                    max(1, self._rows_by_device.get(device, 0)), COLUMNS, dtype=torch.int32, device=device)
            weights = self._weights.get(device)
            if weights is None:
                w8 = _weights(device)
                weights = self._weights[device] = (w8, w8.to(torch.float64))
            return buf, weights[0], weights[1]

    def measure(self, slot: int, phase: int, tensor: torch.Tensor) -> None:
        layout = self._slots[slot]
        if layout.rows == 0:
            return
        out, w8, w64 = self._buffer(layout.device, phase)
        data = tensor.reshape(-1).view(torch.uint8).view(torch.int8)
        first, head = layout.first, layout.head_bytes
        if layout.whole:
            body = data[head:head + layout.whole * ROW_BYTES].view(layout.whole, ROW_BYTES)
            _rows_summed(body, w8[:ROW_BYTES], w64[:ROW_BYTES], out[first:first + layout.whole])
        if head or layout.tail_bytes:
            edges = [part for part in (data[:head], data[data.numel() - layout.tail_bytes:]) if part.numel()]
            edge = edges[0] if len(edges) == 1 else torch.cat(edges)
            row = first + layout.whole
            # elementwise, not a matrix product: cuBLAS would keep a workspace for each copy stream
            out[row].copy_((edge.to(torch.int32).unsqueeze(1) * w8[:edge.numel()].to(torch.int32)).sum(0))

    def changed(self) -> list[int]:
        by_device: dict[Optional[int], list[tuple[int, int]]] = {}
        for slot, layout in self._slots.items():
            if layout.rows:
                by_device.setdefault(layout.device, []).append((layout.first, slot))
        found: list[int] = []
        for device, starts in by_device.items():
            starts.sort()
            result: list = []

            def compare() -> None:
                a, b = self._buffers[(device, 0)], self._buffers[(device, 1)]
                result.extend((a != b).any(dim=1).nonzero().flatten().tolist())  # a few ints back; the copy stream only

            self._streams.call(device, compare)
            firsts = [first for first, _ in starts]
            found.extend({starts[bisect.bisect_right(firsts, row) - 1][1] for row in result})
        return sorted(found)


def _rows_summed(rows: torch.Tensor, w8: torch.Tensor, w64: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = ``rows`` @ weights, exactly: one int8 product (int32 accumulation, no copy of the
    source), or the float64 path where that product does not apply."""
    if rows.shape[0] >= GEMM_MIN_ROWS:
        try:
            torch._int_mm(rows, w8, out=out)
            return
        except RuntimeError:  # refused up front (a build or device without the int8 product): the exact path
            pass
    for at in range(0, rows.shape[0], SLICE_ROWS):
        _exact(rows[at:at + SLICE_ROWS], w64, out[at:at + SLICE_ROWS])


def _exact(rows: torch.Tensor, w64: torch.Tensor, out: torch.Tensor) -> None:
    # |sum| <= (4096 + 256) * 127 * 128 < 2**31: exact in float64 and in int32
    out.copy_(torch.matmul(rows.to(torch.float64), w64))
