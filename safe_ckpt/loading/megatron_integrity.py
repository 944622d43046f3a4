"""Megatron's own whole-file integrity check (`integrity.json`, megatron-core >= 0.18's `--verify-integrity`).

One job: what stock `load(..., verify_integrity=True)` does before loading: the checkpoint
must hold `integrity.json` (`{"algorithm": "sha256", "files": {name: hex}}`), and every file
it lists must hash to its recorded SHA-256. Returns the problems as text lines (the caller
runs it on one rank and votes, as stock checks on rank 0 and broadcasts the verdict).
Must not: change anything, or read a file the index of names does not allow (names go
through the source, which refuses anything outside the checkpoint).
"""

from __future__ import annotations

import hashlib
import json

from ..errors import ReadError
from ..names import INTEGRITY_FILE
from .source import Source

_PIECE_BYTES = 8 << 20


def _sha256(source: Source, name: str, size_bytes: int | None) -> str:
    h = hashlib.sha256()
    if size_bytes is None:  # a kvstore: one ranged read per piece until the value ends
        h.update(source.read_whole(name, 1 << 40))
        return h.hexdigest()
    buf = bytearray(min(_PIECE_BYTES, max(size_bytes, 1)))
    at = 0
    while at < size_bytes:
        n = min(len(buf), size_bytes - at)
        view = memoryview(buf)[:n]
        source.readv(name, at, [view])
        h.update(view)
        at += n
    return h.hexdigest()


def verify(source: Source) -> list[str]:
    """Every mismatch, as stock Megatron words it; an empty list when all files match."""
    try:
        doc = json.loads(source.read_whole(INTEGRITY_FILE, 64 << 20))
    except FileNotFoundError:
        raise ReadError(f"{source.describe(INTEGRITY_FILE)}: missing: the checkpoint was not saved with integrity "
                        f"verification (--verify-integrity / verify_integrity=True), so it cannot be verified on "
                        f"load") from None
    except ValueError as exc:
        raise ReadError(f"{source.describe(INTEGRITY_FILE)}: not JSON: {exc}") from None
    algorithm = doc.get("algorithm", "sha256") if isinstance(doc, dict) else None
    files = doc.get("files") if isinstance(doc, dict) else None
    if algorithm != "sha256" or not isinstance(files, dict):
        raise ReadError(f"{source.describe(INTEGRITY_FILE)}: unsupported: algorithm {algorithm!r} (expected 'sha256') "
                        f"and a 'files' table")
    problems = []
    for name, expected in sorted(files.items()):
        try:
            actual = _sha256(source, name, source.size_bytes(name))
        except (ReadError, FileNotFoundError, OSError) as exc:
            problems.append(f"{name}: file missing or unreadable ({exc})")
            continue
        if actual != expected:
            problems.append(f"{name}: hash mismatch (expected {str(expected)[:16]}..., got {actual[:16]}...)")
    return problems
