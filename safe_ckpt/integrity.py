"""Integrity records: a checksum per stored item, kept in a sidecar manifest stock loaders ignore.

One job: define the checksum over an item's bytes exactly as written (prefix + payload
+ suffix): xxh3-64 where the `xxhash` package is installed (tens of GB/s per core),
zlib CRC-32 otherwise; the grid form of it for payloads summed on the GPU (below);
and the manifest file that holds every item's (file, offset, length, checksum) plus the
whole-file checksums of the small files. The manifest names its algorithms, so a
checkpoint verifies wherever they are available.

Grid checksum (algorithm ``grid32+<fold>``, for large GPU-resident payloads): the payload's
first ``R = n // 4096`` rows of 4096 bytes are read as a row-major R x 1024 matrix of
little-endian 32-bit words; ``rows[r]`` and ``cols[c]`` are its row and column sums modulo
2**32. The checksum is ``<fold>`` (xxh3-64 or CRC-32) over
``prefix | n as 8 LE bytes | rows | cols | payload[R*4096:] | suffix``, words as 4 LE bytes.
The sums are computed on the device before the copy to the host, so the host CPU never
reads the payload to hash it. Any change confined to at most three words, and any
swap of two rows (4 KiB, counted from the payload's start) whose sums differ, changes the
checksum; it is a check against storage and transfer faults, not a cryptographic digest.
Must not: write checkpoint data or decide what is saved.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from dataclasses import asdict, dataclass

import numpy as np

from .names import MANIFEST_FORMAT

MANIFEST_VERSION = 2  # 2: an item row may carry a fifth element, its own algorithm


@dataclass(frozen=True)
class ItemChecksum:
    relative_path: str
    offset_bytes: int
    length_bytes: int
    checksum: int
    fqn: str
    algorithm: str = ""  # "" is the manifest's own algorithm
    payload_offset_bytes: int = 0  # grid checksums: where the payload starts inside the item
    payload_length_bytes: int = 0


try:
    import xxhash
except ImportError:  # the slower fallback keeps checkpoints verifiable everywhere
    xxhash = None

ALGORITHM = "xxh3_64" if xxhash is not None else "crc32"
GRID_PREFIX = "grid32+"
GRID_ALGORITHM = GRID_PREFIX + ALGORITHM
GRID_ROW_BYTES = 4096
GRID_COLUMNS = GRID_ROW_BYTES // 4


def checksum_of(buffers, algorithm: str = ALGORITHM) -> int:
    if algorithm == "xxh3_64":
        if xxhash is None:
            raise RuntimeError("this checkpoint's manifest uses xxh3_64: pip install xxhash to check it")
        h = xxhash.xxh3_64()
        for buf in buffers:
            h.update(buf)
        return h.intdigest()
    if algorithm == "crc32":
        crc = 0
        for buf in buffers:
            crc = zlib.crc32(buf, crc)
        return crc
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


class Hasher:
    """Incremental form of `checksum_of`, for readers that go piece by piece."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        if algorithm == "xxh3_64":
            if xxhash is None:
                raise RuntimeError("this checkpoint's manifest uses xxh3_64: pip install xxhash to check it")
            self._h = xxhash.xxh3_64()
        elif algorithm == "crc32":
            self._crc = 0
        else:
            raise ValueError(f"unknown checksum algorithm {algorithm!r}")

    def update(self, buf) -> None:
        if self.algorithm == "xxh3_64":
            self._h.update(buf)
        else:
            self._crc = zlib.crc32(buf, self._crc)

    def value(self) -> int:
        return self._h.intdigest() if self.algorithm == "xxh3_64" else self._crc


def grid_rows(payload_bytes: int) -> int:
    return payload_bytes // GRID_ROW_BYTES


def grid_bytes(payload_bytes: int) -> int:
    """Size of a payload's row and column sums."""
    return (grid_rows(payload_bytes) + GRID_COLUMNS) * 4


def grid_sums(payload):
    """The row sums then the column sums of a contiguous torch tensor's whole rows, as one int32
    tensor on the tensor's own device (sums wrap modulo 2**32, so any summation order agrees).
    The payload's first byte must be 4-byte aligned."""
    import torch

    rows = grid_rows(payload.numel() * payload.element_size())
    words = payload.reshape(-1).view(torch.uint8)[:rows * GRID_ROW_BYTES].view(torch.int32).view(rows, GRID_COLUMNS)
    return torch.cat((words.sum(dim=1, dtype=torch.int32), words.sum(dim=0, dtype=torch.int32)))


def grid_fold(prefix, payload_length_bytes: int, sums, tail, suffix, algorithm: str = GRID_ALGORITHM) -> int:
    """The grid checksum from its parts; ``sums`` as `grid_sums` returns them, in bytes."""
    return checksum_of([prefix, struct.pack("<Q", payload_length_bytes), sums, tail, suffix],
                       algorithm[len(GRID_PREFIX):])


class GridHasher:
    """Incremental grid checksum of a whole item (prefix, payload, suffix), fed in order in
    pieces of any size, computed on the host (numpy) for `safe-ckpt verify`."""

    def __init__(self, algorithm: str, payload_offset_bytes: int, payload_length_bytes: int) -> None:
        if not algorithm.startswith(GRID_PREFIX):
            raise ValueError(f"not a grid algorithm: {algorithm!r}")
        self._fold = Hasher(algorithm[len(GRID_PREFIX):])
        self._n = payload_length_bytes
        self._start = payload_offset_bytes
        self._rows_end = payload_offset_bytes + grid_rows(payload_length_bytes) * GRID_ROW_BYTES
        self._end = payload_offset_bytes + payload_length_bytes
        self._pos = 0
        self._phase = "prefix"
        self._carry = bytearray()
        self._cols = np.zeros(GRID_COLUMNS, dtype=np.uint32)
        self._tail = bytearray()

    def _advance(self) -> None:
        if self._phase == "prefix" and self._pos >= self._start:
            self._fold.update(struct.pack("<Q", self._n))
            self._phase = "payload"
        if self._phase == "payload" and self._pos >= self._end:
            self._fold.update(self._cols.astype("<u4").tobytes())
            self._fold.update(bytes(self._tail))
            self._phase = "suffix"

    def update(self, buf) -> None:
        view = memoryview(buf).cast("B")
        while True:
            self._advance()
            if not len(view):
                return
            if self._phase != "payload":
                limit = self._start - self._pos if self._phase == "prefix" else len(view)
                take = min(len(view), limit)
                self._fold.update(view[:take])
            elif self._pos < self._rows_end:
                take = min(len(view), self._rows_end - self._pos)
                self._add_rows(view[:take])
            else:
                take = min(len(view), self._end - self._pos)
                self._tail += view[:take]
            self._pos += take
            view = view[take:]

    def _add_rows(self, view: memoryview) -> None:
        if self._carry:
            need = GRID_ROW_BYTES - len(self._carry)
            self._carry += view[:need]
            view = view[need:]
            if len(self._carry) < GRID_ROW_BYTES:
                return
            self._sum(self._carry)
            self._carry = bytearray()
        whole = len(view) // GRID_ROW_BYTES * GRID_ROW_BYTES
        if whole:
            self._sum(view[:whole])
        self._carry += view[whole:]

    def _sum(self, buf) -> None:
        words = np.frombuffer(buf, dtype="<u4").reshape(-1, GRID_COLUMNS)
        self._fold.update(words.sum(axis=1, dtype=np.uint32).astype("<u4").tobytes())
        self._cols += words.sum(axis=0, dtype=np.uint32)

    def value(self) -> int:
        self._advance()
        return self._fold.value()


def item_checksum(item: ItemChecksum, manifest_algorithm: str, data) -> int:
    """``item``'s checksum of its whole bytes ``data`` (one buffer) as the manifest describes it: one
    call into the hash for the sequential algorithms (a reader thread gives up the GIL once an item)."""
    algorithm = item.algorithm or manifest_algorithm
    if algorithm == "xxh3_64" and xxhash is not None:
        return xxhash.xxh3_64_intdigest(data)
    if algorithm == "crc32":
        return zlib.crc32(data)
    hasher = item_hasher(item, manifest_algorithm)
    hasher.update(data)
    return hasher.value()


def item_hasher(item: ItemChecksum, manifest_algorithm: str):
    """The incremental hasher that checks ``item`` as the manifest describes it."""
    algorithm = item.algorithm or manifest_algorithm
    if algorithm.startswith(GRID_PREFIX):
        start, size = item.payload_offset_bytes, item.payload_length_bytes
        if start < 0 or size < 0 or start + size > item.length_bytes or item.length_bytes >= 2**63:
            raise ValueError(f"payload [{start}, +{size}) does not lie inside the item's {item.length_bytes} bytes")
        return GridHasher(algorithm, item.payload_offset_bytes, item.payload_length_bytes)
    return Hasher(algorithm)


def manifest_bytes(items: list[ItemChecksum], whole_files: dict[str, int], *, save_id: str, world_size: int,
                   version: str) -> bytes:
    files: dict[str, list] = {}
    for it in sorted(items, key=lambda i: (i.relative_path, i.offset_bytes)):
        row = [it.offset_bytes, it.length_bytes, it.checksum, it.fqn]
        if it.algorithm and it.algorithm != ALGORITHM:
            row.append({"algorithm": it.algorithm, "payload": [it.payload_offset_bytes, it.payload_length_bytes]})
        files.setdefault(it.relative_path, []).append(row)
    doc = {
        "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "checksum": ALGORITHM,
        "save_id": save_id, "world_size": world_size, "safe_ckpt_version": version,
        "created_unix": round(time.time(), 3),
        "items": files,
        "whole_files": dict(sorted(whole_files.items())),
    }
    return json.dumps(doc, separators=(",", ":")).encode()  # indent would take the pure-Python encoder: ~10 us an item


@dataclass(frozen=True)
class Manifest:
    items: list[ItemChecksum]
    whole_files: dict[str, int]
    save_id: str
    world_size: int
    algorithm: str

    @staticmethod
    def parse(data: bytes) -> "Manifest":
        doc = json.loads(data)
        if doc.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"not a {MANIFEST_FORMAT} file")
        if not isinstance(doc.get("version"), int) or doc["version"] > MANIFEST_VERSION:
            raise ValueError(f"manifest version {doc.get('version')!r}: this safe_ckpt reads versions up to "
                             f"{MANIFEST_VERSION}; a newer safe_ckpt wrote it")
        items = [_parse_row(path, row) for path, rows in doc["items"].items() for row in rows]
        return Manifest(items, {k: int(v) for k, v in doc["whole_files"].items()}, doc.get("save_id", ""),
                        int(doc.get("world_size", 0)), doc.get("checksum", "crc32"))


def _parse_row(path: str, row: list) -> ItemChecksum:
    if not isinstance(row, list) or len(row) not in (4, 5):
        raise ValueError(f"manifest row for {path!r} is {row!r:.80}: expected a list of 4 or 5 fields")
    offset, length, checksum, fqn = row[:4]
    algorithm, start, size = "", 0, 0
    if len(row) == 5:
        extra = row[4]
        span = extra.get("payload") if isinstance(extra, dict) else None
        if not (isinstance(extra, dict) and isinstance(extra.get("algorithm"), str) and isinstance(span, list)
                and len(span) == 2 and all(_is_count(v) for v in span)):
            raise ValueError(f"manifest row for {path!r} at {offset!r}: the fifth field must be "
                             f'{{"algorithm": str, "payload": [start, length]}}, not {extra!r:.80}')
        algorithm, (start, size) = extra["algorithm"], span
    if not all(_is_count(v) for v in (offset, length, checksum)) or not isinstance(fqn, str):
        raise ValueError(f"manifest row for {path!r} is {row!r:.80}: offset, length and checksum must be "
                         "non-negative integers and the key a string")
    return ItemChecksum(path, offset, length, checksum, fqn, algorithm, start, size)


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64


def as_dict(item: ItemChecksum) -> dict:
    return asdict(item)
