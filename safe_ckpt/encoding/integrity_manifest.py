"""Megatron's integrity manifest, `integrity.json`, from the bytes as they are written.

One job: keep the SHA-256 of every file a save writes, fed with each file's bytes in file
order by whichever writer thread writes them (no second read of the data), and build
`integrity.json` exactly as megatron-core >= 0.18 writes it
(`dist_checkpointing.validation.save_integrity_manifest`): ``{"algorithm": "sha256",
"files": {name: hex digest}}`` for every file of the checkpoint directory but itself, names
sorted, `json.dump(..., indent=2)`. Stock `load(..., verify_integrity=True)` re-hashes the
listed files and refuses the checkpoint on a mismatch or without the manifest.

Why in file order without buffering: a data file's items are laid out back to back from
offset 0 (`layout`), staged in offset order, and handed to one writer at a time in the order
they were staged (`staging.dispatch`), so each file's bytes reach `FileDigests.update` in
order. An update at any other offset is an internal error that fails the save, never a
wrong manifest.

Must not: write or read checkpoint files (except, for a strategy save, the few small files
Megatron's own save put in the directory before it), or decide what is saved.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading

from ..errors import CheckpointError
from ..names import INTEGRITY_FILE, is_data_file
ALGORITHM = "sha256"


class _FileHash:
    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        self.hashed_bytes = 0
        self.sha = hashlib.sha256()
        self.lock = threading.Lock()


class FileDigests:
    """The SHA-256 of each file of one rank's save, fed piece by piece in file order from the
    writer threads (hashlib releases the GIL, so files hash in parallel). ``sizes``: every file
    the rank writes, by relative path, with its size in bytes."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self._files = {name: _FileHash(size) for name, size in sizes.items()}

    def update(self, relative_path: str, offset_bytes: int, buffers) -> None:
        """Hash ``buffers``, which are written back to back at ``offset_bytes`` of the file."""
        entry = self._files.get(relative_path)
        if entry is None:
            raise CheckpointError(f"internal error: {relative_path} is not a file of this save's integrity manifest")
        with entry.lock:
            if offset_bytes != entry.hashed_bytes:
                raise CheckpointError(
                    f"internal error: bytes of {relative_path} at offset {offset_bytes} reached the integrity "
                    f"manifest's hash before those at {entry.hashed_bytes}; nothing is published")
            for buf in buffers:
                view = memoryview(buf).cast("B")
                entry.sha.update(view)
                entry.hashed_bytes += len(view)

    def digests(self) -> dict[str, str]:
        """Every file's hex digest; an internal error if any file was not hashed whole."""
        short = {name: (e.hashed_bytes, e.size_bytes) for name, e in self._files.items()
                 if e.hashed_bytes != e.size_bytes}
        if short:
            name, (hashed, size) = next(iter(sorted(short.items())))
            raise CheckpointError(f"internal error: {len(short)} file(s) hashed short for the integrity manifest, "
                                  f"e.g. {name}: {hashed} of {size} bytes; nothing is published")
        return {name: e.sha.hexdigest() for name, e in self._files.items()}


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_bytes(digests: dict[str, str]) -> bytes:
    """`integrity.json` for a directory whose files (but itself) have ``digests``."""
    files = {name: digests[name] for name in sorted(digests) if name != INTEGRITY_FILE}
    return json.dumps({"algorithm": ALGORITHM, "files": files}, indent=2).encode()


def with_manifest(small: dict[str, bytes], data_digests: dict[str, str],
                  beside: dict[str, str] | None = None) -> dict[str, bytes]:
    """``small`` (the files the commit writes from memory, hashed here) plus `integrity.json`
    over them, the data files (``data_digests``, from the writers) and ``beside`` (files in the
    directory that this save does not write)."""
    digests = {**(beside or {}), **data_digests, **{name: digest_of(data) for name, data in small.items()}}
    return {**small, INTEGRITY_FILE: manifest_bytes(digests)}


def files_beside(final_dir: str, written: set[str], later: dict[str, bytes]) -> dict[str, str]:
    """For a save into a directory another writer fills (Megatron's `save` with a strategy):
    the digests of the files already there that stay (not data files, which the publish
    replaces, and not those this save writes), and of ``later``, the files that writer adds
    after the strategy returns, whose bytes are known (Megatron's `metadata.json`)."""
    out = {}
    try:
        names = os.listdir(final_dir)
    except FileNotFoundError:
        names = []
    for name in sorted(names):
        path = os.path.join(final_dir, name)
        if name in written or name == INTEGRITY_FILE or is_data_file(name):
            continue
        if os.path.isfile(path):  # as Megatron's `is_file()`: regular files, links to them included
            sha = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    sha.update(block)
            out[name] = sha.hexdigest()
    out.update({name: digest_of(data) for name, data in later.items()})
    return out
