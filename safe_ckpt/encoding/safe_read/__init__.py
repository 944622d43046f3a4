"""Reading a checkpoint's pickled files without running code from them.

One job: give `verify`, `inspect`, the loader and the targets the `.metadata` index and the
common state of a checkpoint someone may have sent them, where a pickle can name any callable.
`.metadata` (up to MAX_METADATA_BYTES) goes through `unpickler` (DCP's classes only, every copy
and hash charged to one budget sized from the file), then a check that its fields are the
types `verify` and `inspect` walk, charged to the same budget; the common state goes through
torch's weights-only unpickler with megatron-core's own safe globals, as stock Megatron
loads it. Files are opened through `files` (regular files inside the checkpoint
only). A refused or unreadable file is an `UnreadableCheckpointError` naming the file and,
when one was refused, the global.
Must not: call `pickle.load`, `torch.load(weights_only=False)` or DCP's
`read_metadata` (a plain `pickle.load`) on anything from the checkpoint.
"""

from __future__ import annotations

import os
import pickle

import torch

from ...errors import UnreadableCheckpointError
from ...names import COMMON_STATE_FILE, COMMON_STATE_KEY, METADATA_FILE
from ... import weights_only
from .files import open_file, read_file
from .admitted import ADMITTED_GLOBALS, torch_constant
from .budget import WorkBudget
from .unpickler import MetadataUnpickler, show

# A `.metadata` larger than this is refused unread: the biggest index a real run writes is far smaller
# (about 160 bytes per stored item), and reading costs work and memory in proportion to the file.
MAX_METADATA_BYTES = 1 << 30
# The common state (`common.pt`): the run's arguments, optimizer param groups, rng state.
MAX_COMMON_STATE_BYTES = 1 << 30

# Names kept for callers and tests that reach them here.
_MetadataUnpickler = MetadataUnpickler
_torch_constant = torch_constant
_show = show
__all__ = ["ADMITTED_GLOBALS", "MAX_METADATA_BYTES", "METADATA_FILE", "UnreadableCheckpointError",
           "common_state_item", "load_common_state", "metadata_from_bytes", "read_metadata", "weights_only_load"]


def read_metadata(directory: str):
    """The DCP `Metadata` of ``directory``, unpickled with only the classes such a file holds."""
    data = read_file(directory, METADATA_FILE, MAX_METADATA_BYTES, "DCP metadata file")
    return metadata_from_bytes(data, os.path.join(directory, METADATA_FILE))


def metadata_from_bytes(data: bytes, where: str):
    """The DCP `Metadata` held in ``data`` (the bytes of the `.metadata` named ``where``: a file,
    or a kvstore key), with the same refusals as `read_metadata`."""
    from torch.distributed.checkpoint.metadata import Metadata

    if len(data) > MAX_METADATA_BYTES:
        raise UnreadableCheckpointError(where, f"refused: more than the {MAX_METADATA_BYTES} bytes a DCP "
                                               f"metadata file is read up to; not unpickled")
    budget = WorkBudget(where, len(data))
    try:
        meta = MetadataUnpickler(data, where, budget).load()
    except UnreadableCheckpointError:
        raise
    except RecursionError:
        raise UnreadableCheckpointError(where, "is not a DCP metadata file (nested too deep to read)") from None
    except Exception as exc:  # truncated or garbage bytes: UnpicklingError, EOFError, ValueError, ...
        raise UnreadableCheckpointError(where, f"is not a DCP metadata file (not a valid pickle: "
                                               f"{type(exc).__name__}: {show(_text(exc))[1:-1]})") from None
    if not isinstance(meta, Metadata):
        raise UnreadableCheckpointError(where, f"holds a {type(meta).__name__}, not a DCP Metadata")
    try:
        _check_shape(meta, where, budget)
    except RecursionError:
        raise UnreadableCheckpointError(where, "malformed: nested too deep to check") from None
    return meta


def _text(exc: Exception) -> str:
    try:
        return str(exc)
    except Exception:  # an exception whose message holds something that cannot be shown
        return type(exc).__name__


# Offsets, lengths and sizes are int64 in every reader; a bigger int costs time in proportion to its digits.
_MAX_INT = 1 << 63


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _MAX_INT


def _non_negative_ints(value, rank: int | None = None) -> bool:
    return (isinstance(value, (tuple, list)) and (rank is None or len(value) == rank)
            and all(_count(v) for v in value))


def _check_shape(meta, path: str, budget: WorkBudget) -> None:
    """Refuse a Metadata whose fields are not the types verify and inspect walk. The walk is charged to
    ``budget``: entries can share one long list of chunks, or one long size, any number of times."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                       TensorStorageMetadata)

    sdm = getattr(meta, "state_dict_metadata", None)
    storage = getattr(meta, "storage_data", None)
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise UnreadableCheckpointError(path, "malformed: state_dict_metadata and storage_data must be dicts")
    for fqn, md in sdm.items():
        ok = isinstance(md, BytesStorageMetadata) or (
            isinstance(md, TensorStorageMetadata)
            and isinstance(getattr(getattr(md, "properties", None), "dtype", None), torch.dtype)
            and isinstance(getattr(md, "chunks", None), list))
        if not isinstance(fqn, str) or not ok:
            raise UnreadableCheckpointError(path, f"malformed: entry {_show(fqn)} is a {type(md).__name__}")
        if isinstance(md, TensorStorageMetadata):
            size = getattr(md, "size", None)
            budget.charge(1 + len(md.chunks) + (len(size) if isinstance(size, (tuple, list)) else 0),
                          "checking the index")
            if not _non_negative_ints(size):
                raise UnreadableCheckpointError(path, f"malformed: entry {_show(fqn)} has the size {_show(size)}, "
                                                      f"not a sequence of non-negative int64s")
            budget.charge(2 * len(size) * len(md.chunks), "checking the index")
            for i, chunk in enumerate(md.chunks):
                if not isinstance(chunk, ChunkStorageMetadata) \
                        or not _non_negative_ints(getattr(chunk, "offsets", None), len(size)) \
                        or not _non_negative_ints(getattr(chunk, "sizes", None), len(size)):
                    shown = (f"offsets {_show(getattr(chunk, 'offsets', None))}, sizes "
                             f"{_show(getattr(chunk, 'sizes', None))}" if isinstance(chunk, ChunkStorageMetadata)
                             else f"a {type(chunk).__name__}")
                    raise UnreadableCheckpointError(
                        path, f"malformed: entry {_show(fqn)} chunk {i} is {shown}, not offsets and sizes of "
                              f"{len(size)} non-negative int64s each")
    budget.charge(len(storage), "checking the index")  # plus each key's offsets, charged when it was hashed
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(getattr(index, "fqn", None), str) \
                or not (getattr(index, "offset", None) is None or _non_negative_ints(index.offset)) \
                or not isinstance(info, _StorageInfo) \
                or not isinstance(getattr(info, "relative_path", None), str) \
                or not all(_count(v) for v in (getattr(info, "offset", None), getattr(info, "length", None))):
            fqn = getattr(index, "fqn", None) if isinstance(index, MetadataIndex) else index
            shown = (f"{_show(getattr(info, 'relative_path', None))} offset {_show(getattr(info, 'offset', None))} "
                     f"length {_show(getattr(info, 'length', None))}" if isinstance(info, _StorageInfo)
                     else f"a {type(info).__name__}")
            raise UnreadableCheckpointError(path, f"malformed: storage entry {_show(fqn)} -> {shown} (needs a "
                                                  f"file name and a non-negative int64 offset and length, "
                                                  f"and a key of a name and int64 offsets)")
        budget.charge(len(info.relative_path) >> 4, "checking the index")
        parts = info.relative_path.split("/")
        if os.path.isabs(info.relative_path) or not info.relative_path or ".." in parts or "" in parts:
            raise UnreadableCheckpointError(path, f"malformed: storage entry {_show(index.fqn)} points outside "
                                                  f"the checkpoint ({_show(info.relative_path)})")


def weights_only_load(data: bytes, path: str):
    """``torch.load(weights_only=True)`` of ``data`` with megatron-core's safe globals, as stock
    Megatron loads its common state; a refusal names the global."""
    try:
        return weights_only.load(data, map_location="cpu")
    except pickle.UnpicklingError as exc:
        refused = weights_only.refused_global(exc)
        if refused:
            raise UnreadableCheckpointError(
                path, f"refused: it references the global {refused}, which torch's weights-only "
                      f"loader and megatron-core's safe globals do not allow; not unpickled (nothing from it "
                      f"was run). Stock Megatron refuses it too", refused) from None
        raise UnreadableCheckpointError(path, f"cannot be loaded: {exc}") from None
    except Exception as exc:
        raise UnreadableCheckpointError(path, f"cannot be loaded: {type(exc).__name__}: {exc}") from None


def common_state_item(meta):
    """The (index, storage info) of a common state stored as a ShardedObject (megatron-core >= 0.19)."""
    for index, info in meta.storage_data.items():
        if index.fqn == COMMON_STATE_KEY or index.fqn.startswith(COMMON_STATE_KEY + "/shard_"):
            return index, info
    return None


def load_common_state(directory: str, meta) -> dict | None:
    """The common state (`common.pt`, or the `common_state` object), or None if there is none."""
    path = os.path.join(directory, COMMON_STATE_FILE)
    if os.path.lexists(path):  # a FIFO or a dangling link under that name is refused, not skipped
        return weights_only_load(read_file(directory, COMMON_STATE_FILE, MAX_COMMON_STATE_BYTES, "common state"),
                                 path)
    found = common_state_item(meta)
    if found is None:
        return None
    index, info = found
    where = f"{os.path.join(directory, info.relative_path)}@{info.offset} ({index.fqn})"
    if info.length > MAX_COMMON_STATE_BYTES:
        raise UnreadableCheckpointError(where, f"refused: {info.length} bytes, more than the "
                                               f"{MAX_COMMON_STATE_BYTES} a common state is read up to; not read")
    with open_file(directory, info.relative_path) as f:
        data = f.read_range(info.offset, info.length)
    if len(data) < info.length:
        raise UnreadableCheckpointError(where, f"cut short: {len(data)} of {info.length} bytes")
    obj = weights_only_load(data, where)
    return obj[0] if isinstance(obj, list) and len(obj) == 1 else obj
