"""What a source's bytes were when a copy window opened, and again right after its last copy.

One job: measure each checked source twice (phase 0 at the opening, phase 1 after its last copy;
the window enqueues both in its copy stream's order) and, once every measurement has landed, say
which sources' two measurements differ: some byte of it changed while the window copied it, by a
write no gate ordered (a ``.data.copy_``, a fused optimizer, another stream). Two implementations
of the one seam:
- `HostSums`: the manifest's checksum (`integrity.checksum_of`: xxh3-64, else CRC-32) of the
  source's bytes, read where they lie; for host memory (CPU tests, CPU-only runs).
- `DeviceSums`: on the source's device, the exact row sums (int64) of its words laid out as rows
  of 4096 bytes, plus one sum of the last partial row, written into one buffer per device and
  phase; `changed` compares the two buffers on the device and brings back only the positions that
  differ. torch widens what it sums to int64 first: summing a source in slices whose widened copy
  is at most `WIDE_BYTES` bounds the device memory a measurement takes, whatever its size. A
  change that leaves every row's sum equal (two words of one row moved by opposite amounts) is
  not seen.
Must not: copy payload bytes to the host, block the caller's thread, or decide when to measure.
"""

from __future__ import annotations

import bisect
import threading
from typing import Protocol

import torch

from ..integrity import checksum_of
from .views import host_memoryview

ROW_BYTES = 4096
# The most torch's widened (int64) copy of one slice may take; a larger source takes more sums.
WIDE_BYTES = 512 << 20


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


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat tensor of the widest integer words its address and size allow."""
    nbytes = tensor.numel() * tensor.element_size()
    flat = tensor.reshape(-1).view(torch.uint8)
    for size, dtype in ((4, torch.int32), (2, torch.int16)):
        if nbytes % size == 0 and tensor.data_ptr() % size == 0:
            return flat.view(dtype)
    return flat


def _rows(nbytes: int) -> tuple[int, int]:
    """(whole rows, 1 if there is a last partial row else 0) of a source of ``nbytes``."""
    return nbytes // ROW_BYTES, 1 if nbytes % ROW_BYTES else 0


class DeviceSums:
    """Row sums on the device (see the module docstring). ``streams`` must be the window's
    `CudaStreams`: the sums are computed, and compared, on its copy streams."""

    def __init__(self, streams) -> None:
        self._streams = streams
        self._slots: dict[int, tuple[int, int, int]] = {}  # slot -> (device, first row, rows)
        self._rows_by_device: dict[int, int] = {}
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}  # (device, phase) -> int64 row sums
        self._lock = threading.Lock()

    def checks(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda" and tensor.is_contiguous()

    def reserve(self, slot: int, tensor: torch.Tensor) -> None:
        with self._lock:
            if self._buffers:
                raise RuntimeError("every slot must be reserved before the first measurement")
            device = tensor.device.index
            whole, part = _rows(tensor.numel() * tensor.element_size())
            first = self._rows_by_device.get(device, 0)
            self._slots[slot] = (device, first, whole + part)
            self._rows_by_device[device] = first + whole + part

    def _buffer(self, device: int, phase: int) -> torch.Tensor:
        with self._lock:
            buf = self._buffers.get((device, phase))
            if buf is None:  # allocated on the copy stream (we are inside its context): freed in its order
                buf = self._buffers[(device, phase)] = torch.empty(max(1, self._rows_by_device.get(device, 0)),
                                                                   dtype=torch.int64, device=device)
            return buf

    def measure(self, slot: int, phase: int, tensor: torch.Tensor) -> None:
        device, first, rows = self._slots[slot]
        if rows == 0:
            return
        out = self._buffer(device, phase)
        words = _words(tensor)
        per_row = ROW_BYTES // words.element_size()
        whole = words.numel() // per_row
        step = max(1, WIDE_BYTES // (per_row * 8))  # rows whose int64 copy fits WIDE_BYTES
        for at in range(0, whole, step):
            count = min(step, whole - at)
            torch.sum(words[at * per_row:(at + count) * per_row].view(count, per_row), dim=1, dtype=torch.int64,
                      out=out[first + at:first + at + count])
        if whole < rows:
            torch.sum(words[whole * per_row:], dim=0, dtype=torch.int64, out=out[first + whole])

    def changed(self) -> list[int]:
        by_device: dict[int, list[tuple[int, int]]] = {}
        for slot, (device, first, rows) in self._slots.items():
            if rows:
                by_device.setdefault(device, []).append((first, slot))
        found: list[int] = []
        for device, starts in by_device.items():
            starts.sort()
            result: list = []

            def compare() -> None:
                a, b = self._buffers[(device, 0)], self._buffers[(device, 1)]
                result.extend((a != b).nonzero().flatten().tolist())  # a few ints back; the copy stream only

            self._streams.call(device, compare)
            firsts = [first for first, _ in starts]
            found.extend({starts[bisect.bisect_right(firsts, row) - 1][1] for row in result})
        return sorted(found)
