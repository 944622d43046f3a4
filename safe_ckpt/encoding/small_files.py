"""The small files a commit writes beside the data files, and the order they go in.

One job: from the agreed plan, every rank's layout and the checksums the writers recorded,
build the bytes of `.metadata` (the index stock loaders read), `metadata.json` (Megatron's
config; left out where Megatron's own save writes it), a kvstore's whole files and, with
checksums, the manifest, which also covers these small files; and say the write order of a
POSIX directory: `.metadata` last, because without it nothing in the directory is a checkpoint
(a kvstore's order is `kvcommit.publish`'s, which marks completeness its own way).

Must not: write, sync or publish anything (the save's commit step does, through its sink and
`commit`), or decide whether a save commits.
"""

from __future__ import annotations

import json

from .. import compat
from . import integrity_manifest
from .metadata import build_metadata, metadata_bytes
from ..integrity import checksum_of, manifest_bytes
from ..names import CONFIG_FILE, MANIFEST_FILE, METADATA_FILE
from ..version import __version__


def small_files(global_plan, layouts, checkpoint_dir: str, save_id: str, *, sharded_only: bool,
                whole_files: dict) -> dict:
    """The index and config (and, for a kvstore, the common state): they depend on the plan only."""
    small = {METADATA_FILE: metadata_bytes(build_metadata(global_plan, layouts, checkpoint_dir, save_id))}
    if not sharded_only:
        small[CONFIG_FILE] = json.dumps(compat.checkpointing_config_dict()).encode()
    small.update(whole_files)  # kvstore: the common state goes in with the commit
    return small


def with_manifest(small: dict, checksums: list, *, save_id: str, world_size: int) -> dict:
    """``small`` with the manifest first: every item's checksum, and whole-file checksums of the
    files written in one piece (a data file that is one item, and every small file)."""
    whole = {c.relative_path: c.checksum for c in checksums if c.offset_bytes == 0 and c.fqn == c.relative_path}
    whole.update({name: checksum_of([data]) for name, data in small.items()})
    items = [c for c in checksums if c.relative_path not in whole]
    return {MANIFEST_FILE: manifest_bytes(items, whole, save_id=save_id, world_size=world_size,
                                          version=__version__), **small}


def with_integrity(small: dict, file_digests: dict, *, into: str | None = None) -> dict:
    """``small`` plus Megatron's `integrity.json` over every file of the checkpoint (built last:
    it covers the manifest too). ``into``: the existing directory a strategy save fills, whose
    other files (and the `metadata.json` Megatron writes after it) it covers as well."""
    beside = integrity_manifest.files_beside(into, set(small) | set(file_digests), {
        CONFIG_FILE: json.dumps(compat.checkpointing_config_dict()).encode()}) if into is not None else None
    return integrity_manifest.with_manifest(small, file_digests, beside)


def write_order(small: dict) -> list:
    """The names of ``small`` in the order to write them: `.metadata` last."""
    return [name for name in small if name != METADATA_FILE] + [METADATA_FILE]
