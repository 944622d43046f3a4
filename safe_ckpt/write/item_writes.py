"""One placed item's bytes into an open file of a sink, with the item's checksum.

One job: given a sink handle, an item's place in its file and its buffers (container prefix,
payload, suffix), write them at the item's offset and record the checksum the manifest will
hold: hashed on a checksum thread during the vectored write, hashed just before one whole
write (sinks that take an item in one piece), or hashed and written piece by piece so each
piece is still in the core's cache when it is written; or folded from the sums the device
computed, with no host hashing at all. With Megatron's integrity manifest on (``digests``),
the same pass also feeds each file's SHA-256 (`encoding.integrity_manifest`) with the bytes as
they are written; a device-summed payload is then hashed on the host for it. Safe to call from
every writer thread at once.

Must not: choose, order or stage items, open, sync or close files, or release leases (the
write pipeline does all of that).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from ..encoding.integrity_manifest import FileDigests
from ..encoding.layout import PlacedItem
from ..errors import SourceModifiedError
from ..integrity import ALGORITHM, GRID_ALGORITHM, GRID_ROW_BYTES, Hasher, ItemChecksum, checksum_of, grid_fold

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
    ``hasher``: the checksum threads, set once they are started (None: hash in the writer);
    ``digests``: the files' SHA-256 for Megatron's integrity manifest (None: not kept)."""

    def __init__(self, checksums: bool, whole_writes: bool = False, digests: FileDigests | None = None) -> None:
        self.checksums = checksums
        self.whole_writes = whole_writes
        self.hasher: ThreadPoolExecutor | None = None
        self.digests = digests
        self._lock = threading.Lock()
        self._recorded: list[ItemChecksum] = []

    def write(self, handle, item: PlacedItem, buffers: list, recheck: bool = False) -> bool:
        """One vectored write of an item, its checksum computed meanwhile on another thread;
        or, without checksum threads, piece by piece: hash a piece, then write it.

        ``recheck``: the buffers are memory the caller may change meanwhile (an async save's
        host source): hash each piece just before writing it, then every piece again once all
        are written; returns False if the two differ (the written bytes may be torn; the
        recorded checksum is that of the bytes as each piece was hashed). A change that lasts
        past the write is always seen; one undone before the second pass may not be."""
        crc = None
        if recheck:
            crc = self._write_fused(handle, item, buffers, checksum=True)
            unchanged = checksum_of(buffers) == crc
            if self.checksums:
                self.record(ItemChecksum(item.relative_path, item.offset_bytes, item.length_bytes, crc, item.fqn))
            return unchanged
        if not self.checksums and self.digests is None:
            handle.write_at(item.offset_bytes, buffers)
        elif self.hasher is not None:
            pending = self.hasher.submit(self._sums, item, buffers)
            try:
                handle.write_at(item.offset_bytes, buffers)
            finally:
                crc = pending.result()
        elif self.whole_writes:
            crc = self._sums(item, buffers)
            handle.write_at(item.offset_bytes, buffers)
        else:
            crc = self._write_fused(handle, item, buffers, checksum=self.checksums)
        if crc is not None:
            self.record(ItemChecksum(item.relative_path, item.offset_bytes, item.length_bytes, crc, item.fqn))
        return True

    def _sums(self, item: PlacedItem, buffers: list) -> int | None:
        """The item's checksum (None without checksums), feeding its file's SHA-256 on the way."""
        if self.digests is not None:
            self.digests.update(item.relative_path, item.offset_bytes, buffers)
        return checksum_of(buffers) if self.checksums else None

    def _write_fused(self, handle, item: PlacedItem, buffers: list, checksum: bool) -> int | None:
        """Hash a piece, write it, next piece: every byte is hashed before it is written
        (``checksum``: the item's checksum too, returned; else None)."""
        hasher = Hasher(ALGORITHM) if checksum else None
        offset = item.offset_bytes
        for group in pieces(buffers, FUSED_PIECE_BYTES):
            if hasher is not None:
                for buf in group:
                    hasher.update(buf)
            if self.digests is not None:
                self.digests.update(item.relative_path, offset, group)
            handle.write_at(offset, group)
            offset += sum(len(b) for b in group)
        return hasher.value() if hasher is not None else None

    def write_gridded(self, handle, item: PlacedItem, prefix: bytes, payload: memoryview, sums: memoryview,
                      suffix: bytes) -> None:
        """An item whose payload was summed on the device: fold the sums, write it unhashed."""
        n = len(payload)
        tail = payload[n // GRID_ROW_BYTES * GRID_ROW_BYTES:]
        crc = grid_fold(prefix, n, sums, tail, suffix)
        buffers = [prefix, payload, suffix]
        if self.digests is None:
            handle.write_at(item.offset_bytes, buffers)
        elif self.hasher is not None:  # the SHA-256 needs the bytes: hashed beside the write
            pending = self.hasher.submit(self.digests.update, item.relative_path, item.offset_bytes, buffers)
            try:
                handle.write_at(item.offset_bytes, buffers)
            finally:
                pending.result()
        else:
            self._write_fused(handle, item, buffers, checksum=False)
        self.record(ItemChecksum(item.relative_path, item.offset_bytes, item.length_bytes, crc, item.fqn,
                                 GRID_ALGORITHM, len(prefix), n))

    def record(self, checksum: ItemChecksum) -> None:
        with self._lock:
            self._recorded.append(checksum)

    def recorded(self) -> list[ItemChecksum]:
        with self._lock:
            return list(self._recorded)


def modified_while_written(fqn: str, memory_saver_backup: bool, how: str) -> SourceModifiedError:
    """The error of a host source that changed while an asynchronous save wrote it."""
    if memory_saver_backup:
        return SourceModifiedError(
            f"torch_memory_saver's CPU backup of {fqn!r} changed while it was being saved ({how}: the saver "
            "resumed and paused again during the save); the checkpoint would be torn, so it is not committed. "
            "Keep the saver paused until the save's handle has finished")
    return SourceModifiedError(
        f"host tensor {fqn!r} was modified in place while it was being saved ({how}); the checkpoint would be "
        "torn, so it is not committed. Do not change host tensors until the save's handle has finished")


class ItemWriteFailed(Exception):
    """The first failure of the write phase; ``key`` names the item, ``cause`` the error."""

    def __init__(self, key: str | None, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.key = key
        self.cause = cause
