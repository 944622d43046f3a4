"""One placed item's bytes into an open file of a sink, with the item's checksum.

One job: given a sink handle, an item's place in its file and its buffers (container prefix,
payload, suffix), write them at the item's offset and record the checksum the manifest will
hold: hashed on a checksum thread during the vectored write, hashed just before one whole
write (sinks that take an item in one piece), or hashed and written piece by piece so each
piece is still in the core's cache when it is written; or folded from the sums the device
computed, with no host hashing at all. Safe to call from every writer thread at once.

Must not: choose, order or stage items, open, sync or close files, or release leases (the
write pipeline does all of that).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from .encoding.layout import PlacedItem
from .integrity import ALGORITHM, GRID_ALGORITHM, GRID_ROW_BYTES, Hasher, ItemChecksum, checksum_of, grid_fold

FUSED_PIECE_BYTES = 2 << 20  # hashed, then written while still in the core's cache


def pieces(buffers: list, limit_bytes: int):
    """The buffers regrouped, in order, into lists of at most ``limit_bytes`` (or one buffer slice)."""
    group, size = [], 0
    for buf in buffers:
        view = memoryview(buf).cast("B")
        while len(view):
            take = min(len(view), limit_bytes - size)
            group.append(view[:take])
            size += take
            view = view[take:]
            if size == limit_bytes:
                yield group
                group, size = [], 0
    if group:
        yield group


class ItemWrites:
    """Writes items and keeps their checksums. ``checksums`` False: write only;
    ``whole_writes``: each item reaches the sink in one `write_at` (kvstore values);
    ``hasher``: the checksum threads, set once they are started (None: hash in the writer)."""

    def __init__(self, checksums: bool, whole_writes: bool = False) -> None:
        self.checksums = checksums
        self.whole_writes = whole_writes
        self.hasher: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._recorded: list[ItemChecksum] = []

    def write(self, handle, item: PlacedItem, buffers: list) -> None:
        """One vectored write of an item, its checksum computed meanwhile on another thread;
        or, without checksum threads, piece by piece: hash a piece, then write it."""
        crc = None
        if not self.checksums:
            handle.write_at(item.offset_bytes, buffers)
        elif self.hasher is not None:
            pending = self.hasher.submit(checksum_of, buffers)
            try:
                handle.write_at(item.offset_bytes, buffers)
            finally:
                crc = pending.result()
        elif self.whole_writes:
            crc = checksum_of(buffers)
            handle.write_at(item.offset_bytes, buffers)
        else:
            hasher = Hasher(ALGORITHM)
            offset = item.offset_bytes
            for group in pieces(buffers, FUSED_PIECE_BYTES):
                for buf in group:
                    hasher.update(buf)
                handle.write_at(offset, group)
                offset += sum(len(b) for b in group)
            crc = hasher.value()
        if crc is not None:
            self.record(ItemChecksum(item.relative_path, item.offset_bytes, item.length_bytes, crc, item.fqn))

    def write_gridded(self, handle, item: PlacedItem, prefix: bytes, payload: memoryview, sums: memoryview,
                      suffix: bytes) -> None:
        """An item whose payload was summed on the device: fold the sums, write it unhashed."""
        n = len(payload)
        tail = payload[n // GRID_ROW_BYTES * GRID_ROW_BYTES:]
        crc = grid_fold(prefix, n, sums, tail, suffix)
        handle.write_at(item.offset_bytes, [prefix, payload, suffix])
        self.record(ItemChecksum(item.relative_path, item.offset_bytes, item.length_bytes, crc, item.fqn,
                                 GRID_ALGORITHM, len(prefix), n))

    def record(self, checksum: ItemChecksum) -> None:
        with self._lock:
            self._recorded.append(checksum)

    def recorded(self) -> list[ItemChecksum]:
        with self._lock:
            return list(self._recorded)
