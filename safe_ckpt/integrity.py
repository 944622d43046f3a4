"""Integrity records: a checksum per stored item, kept in a sidecar manifest stock loaders ignore.

One job: define the checksum over an item's bytes exactly as written (prefix + payload
+ suffix): xxh3-64 where the `xxhash` package is installed (tens of GB/s per core),
zlib CRC-32 otherwise; and the manifest file that holds every item's (file, offset,
length, checksum) plus the whole-file checksums of the small files. The manifest names
its algorithm, so a checkpoint verifies wherever that algorithm is available.
Must not: write checkpoint data or decide what is saved.
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import asdict, dataclass

MANIFEST_FILE = "safe_ckpt_manifest.json"
MANIFEST_FORMAT = "safe_ckpt-manifest"
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class ItemChecksum:
    relative_path: str
    offset_bytes: int
    length_bytes: int
    checksum: int
    fqn: str


try:
    import xxhash
except ImportError:  # the slower fallback keeps checkpoints verifiable everywhere
    xxhash = None

ALGORITHM = "xxh3_64" if xxhash is not None else "crc32"


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


def manifest_bytes(items: list[ItemChecksum], whole_files: dict[str, int], *, save_id: str, world_size: int,
                   version: str) -> bytes:
    files: dict[str, list] = {}
    for it in sorted(items, key=lambda i: (i.relative_path, i.offset_bytes)):
        files.setdefault(it.relative_path, []).append([it.offset_bytes, it.length_bytes, it.checksum, it.fqn])
    doc = {
        "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "checksum": ALGORITHM,
        "save_id": save_id, "world_size": world_size, "safe_ckpt_version": version,
        "created_unix": round(time.time(), 3),
        "items": files,
        "whole_files": dict(sorted(whole_files.items())),
    }
    return json.dumps(doc, indent=1).encode()


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
        items = [ItemChecksum(path, int(o), int(n), int(c), fqn)
                 for path, rows in doc["items"].items() for o, n, c, fqn in rows]
        return Manifest(items, {k: int(v) for k, v in doc["whole_files"].items()}, doc.get("save_id", ""),
                        int(doc.get("world_size", 0)), doc.get("checksum", "crc32"))


def as_dict(item: ItemChecksum) -> dict:
    return asdict(item)
