"""Integrity records: a CRC-32 per stored item, kept in a sidecar manifest stock loaders ignore.

One job: define the checksum (zlib CRC-32 over the item's bytes exactly as written,
prefix + payload + suffix; zlib releases the GIL, so it runs beside the writes) and
the manifest file that holds every item's (file, offset, length, checksum) plus the
whole-file checksums of the small files. Must not: write checkpoint data or decide
what is saved.
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
    crc32: int
    fqn: str


def crc32_of(buffers) -> int:
    crc = 0
    for buf in buffers:
        crc = zlib.crc32(buf, crc)
    return crc


def manifest_bytes(items: list[ItemChecksum], whole_files: dict[str, int], *, save_id: str, world_size: int,
                   version: str) -> bytes:
    files: dict[str, list] = {}
    for it in sorted(items, key=lambda i: (i.relative_path, i.offset_bytes)):
        files.setdefault(it.relative_path, []).append([it.offset_bytes, it.length_bytes, it.crc32, it.fqn])
    doc = {
        "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "checksum": "crc32",
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

    @staticmethod
    def parse(data: bytes) -> "Manifest":
        doc = json.loads(data)
        if doc.get("format") != MANIFEST_FORMAT or doc.get("checksum") != "crc32":
            raise ValueError(f"not a {MANIFEST_FORMAT} (crc32) file")
        items = [ItemChecksum(path, int(o), int(n), int(c), fqn)
                 for path, rows in doc["items"].items() for o, n, c, fqn in rows]
        return Manifest(items, {k: int(v) for k, v in doc["whole_files"].items()}, doc.get("save_id", ""),
                        int(doc.get("world_size", 0)))


def as_dict(item: ItemChecksum) -> dict:
    return asdict(item)
