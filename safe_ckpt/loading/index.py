"""What a checkpoint says it holds: its `metadata.json`, `.metadata` index and checksum manifest.

One job: read the small files every load starts from and turn them into lookups the planner
uses: each tensor's dtype, global shape and stored chunks (with the file, offset and length
of each), each bytes item (ShardedObjects), and, where safe_ckpt's manifest exists, each
item's recorded checksum. `.metadata` goes through the restricted unpickler of
`encoding.safe_read` (it admits only the records a DCP index holds); `metadata.json` must name
the `torch_dist` backend, as stock Megatron requires. A chunk that lies outside its tensor, or
one the index lists without a storage entry, is refused here.
Must not: read tensor data, or unpickle anything but through the restricted readers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from .. import integrity
from ..errors import ReadError
from ..names import (COMMON_STATE_KEY, ITERATION_DIR, CONFIG_FILE, MANIFEST_FILE, METADATA_FILE, RELEASE_DIR, SHARDED_BACKEND,
                     TRACKER_FILE, iteration_dir)
from ..encoding import safe_read
from .source import Source

_SMALL_FILE_BYTES = 1 << 20
_MANIFEST_BYTES = 1 << 30


@dataclass(frozen=True)
class StoredItem:
    """One stored item: a standalone torch.save archive at (offset, length) of a file."""

    relative_path: str
    offset_bytes: int
    length_bytes: int


@dataclass(frozen=True)
class StoredChunk:
    offsets: tuple
    sizes: tuple
    item: StoredItem


@dataclass(frozen=True)
class StoredTensor:
    fqn: str
    dtype: torch.dtype
    size: tuple
    chunks: tuple  # StoredChunk, sorted by offsets


@dataclass(frozen=True)
class CheckpointIndex:
    where: str
    config: dict
    metadata: object  # the DCP Metadata, for the strict-mode key check
    tensors: dict = field(default_factory=dict)  # fqn -> StoredTensor
    objects: dict = field(default_factory=dict)  # fqn -> StoredItem
    checksums: dict = field(default_factory=dict)  # (relative_path, offset_bytes) -> integrity.ItemChecksum
    checksum_algorithm: str = ""


def read_config(source: Source) -> dict:
    """`metadata.json`, which must name the torch_dist backend."""
    where = source.describe(CONFIG_FILE)
    try:
        raw = source.read_whole(CONFIG_FILE, _SMALL_FILE_BYTES)
    except FileNotFoundError:
        raise ReadError(f"{source.root}: not a distributed checkpoint (no {CONFIG_FILE}); "
                        f"{_save_root_hint(source)}") from None
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise ReadError(f"{where}: not JSON: {exc}") from None
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    if backend != SHARDED_BACKEND:
        raise ReadError(f"{where}: names the sharded backend {backend!r}; safe_ckpt reads {SHARDED_BACKEND} checkpoints")
    return config


def read_metadata(source: Source):
    where = source.describe(METADATA_FILE)
    try:
        data = source.read_whole(METADATA_FILE, safe_read.MAX_METADATA_BYTES)
    except FileNotFoundError:
        raise ReadError(f"{where}: missing: not a torch_dist checkpoint, or one whose save did not finish") from None
    try:
        return safe_read.metadata_from_bytes(data, where)
    except safe_read.UnreadableCheckpointError as exc:
        raise ReadError(str(exc)) from None


def _tensors_and_objects(meta, where: str) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    def item_of(info) -> StoredItem:
        return StoredItem(info.relative_path, info.offset, info.length)

    tensors, objects = {}, {}
    # keyed by plain tuples in one pass: hashing a MetadataIndex per chunk cost more than the rest of
    # the index on thousands of shards (its hash and equality are those of its name and offsets)
    storage = {(k.fqn, None if k.offset is None else tuple(k.offset)): v for k, v in meta.storage_data.items()}
    for fqn, md in meta.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            info = storage.get((fqn, None))
            if info is None:
                raise ReadError(f"{where}: malformed: the bytes entry {fqn!r} has no storage entry")
            objects[fqn] = item_of(info)
            continue
        size = tuple(md.size)
        chunks = []
        for chunk in md.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if any(o + s > d for o, s, d in zip(offsets, sizes, size)):
                raise ReadError(f"{where}: malformed: key {fqn!r} has a chunk at {offsets} of {sizes} outside its "
                                f"global shape {size}")
            info = storage.get((fqn, offsets))
            if info is None:
                raise ReadError(f"{where}: malformed: key {fqn!r} lists a chunk at {offsets} with no storage entry")
            chunks.append(StoredChunk(offsets, sizes, item_of(info)))
        chunks.sort(key=lambda c: c.offsets)
        tensors[fqn] = StoredTensor(fqn, md.properties.dtype, size, tuple(chunks))
    return tensors, objects


def read_manifest(source: Source) -> tuple[dict, str]:
    """(item checksums by (file, offset), algorithm), empty where there is no manifest."""
    if not source.exists(MANIFEST_FILE):
        return {}, ""
    where = source.describe(MANIFEST_FILE)
    try:
        manifest = integrity.Manifest.parse(source.read_whole(MANIFEST_FILE, _MANIFEST_BYTES))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ReadError(f"{where}: unreadable checksum manifest ({exc}); LoadOptions(verify_checksums=False) loads "
                        f"without it") from None
    return {(i.relative_path, i.offset_bytes): i for i in manifest.items}, manifest.algorithm


def read_index(source: Source, *, checksums: bool = True) -> CheckpointIndex:
    config = read_config(source)
    meta = read_metadata(source)
    tensors, objects = _tensors_and_objects(meta, source.describe(METADATA_FILE))
    items, algorithm = read_manifest(source) if checksums else ({}, "")
    return CheckpointIndex(source.root, config, meta, tensors, objects, items, algorithm)


def sharded_metadata(index: CheckpointIndex, with_common_state: bool = False) -> dict:
    """What stock `load_sharded_metadata` returns (data-less ShardedTensors and ShardedObjects by key);
    for the strict-mode key check without the common state's object (the format's own, not a key)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    out = {}
    for fqn in index.objects:
        obj = ShardedObject.empty_from_unique_key(fqn)
        if with_common_state or obj.key != COMMON_STATE_KEY:
            out[obj.unique_key] = obj
    for fqn, t in index.tensors.items():
        out[fqn] = ShardedTensor.from_rank_offsets(fqn, torch.empty(t.size, dtype=t.dtype, device="meta")).without_data()
    return out


def _save_root_hint(source: Source) -> str:
    """Why a directory has no config: a save root (its tracker names the checkpoint to pass), or a
    save that did not finish."""
    try:
        tracker = source.read_whole(TRACKER_FILE, _SMALL_FILE_BYTES).decode(errors="replace").strip()
    except (OSError, ReadError):
        inside = sorted(n for n in _local_names(source) if ITERATION_DIR.match(n) or n == RELEASE_DIR)
        if inside:  # a save root without a tracker
            return (f"it holds checkpoints, not one: load one of {', '.join(inside[-5:])}"
                    f"{' (the newest five shown)' if len(inside) > 5 else ''}")
        return "a checkpoint whose save did not finish has none"
    name = RELEASE_DIR if tracker == RELEASE_DIR else iteration_dir(int(tracker)) if tracker.isdigit() else None
    if name is None:
        return f"it is a save root whose tracker ({TRACKER_FILE}) reads {tracker[:40]!r}, not an iteration"
    return f"it is a save root whose tracker names {name}: load {source.describe(name)}"


def _local_names(source: Source) -> list:
    """The entries of a local directory source ([] for other sources: listing a store costs requests)."""
    root = getattr(source, "root", None)
    try:
        return os.listdir(root) if isinstance(root, str) and "://" not in root and os.path.isdir(root) else []
    except OSError:
        return []
