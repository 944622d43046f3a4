"""Reading a checkpoint's pickled files without running code from them.

One job: give `verify` and `inspect` the `.metadata` index and the common state of a
checkpoint someone may have sent them, where a pickle can name any callable. `.metadata`
goes through an unpickler that resolves only the classes a DCP metadata file holds in
torch 2.6-2.14 (found by disassembling files written by stock DCP, stock Megatron and
this library, and from torch's sources for moved classes); the common state goes
through torch's weights-only unpickler with megatron-core's own safe globals, as
stock Megatron loads it. A refused or unreadable file is an `UnreadableCheckpointError`
naming the file and, when one was refused, the global.
Must not: call `pickle.load`, `torch.load(weights_only=False)` or DCP's
`read_metadata` (a plain `pickle.load`) on anything from the checkpoint.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import re

import torch

from ..compat import COMMON_STATE_FILE, COMMON_STATE_KEY, megatron_safe_globals
from ..errors import CheckpointError

METADATA_FILE = ".metadata"

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# torch < 2.2 pickled TensorProperties from its old home; torch still defines it there.
_SHARD_METADATA = "torch.distributed._shard.sharded_tensor.metadata"
_PATH_CLASSES = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")

# Every (module, name) a legitimate `.metadata` references, besides torch's dtype,
# layout and memory-format constants (matched by type in `_torch_constant`). Each one
# is data: a dataclass whose state is set by BUILD or a `__setstate__` that only
# assigns fields, or a callable that maps a plain value to a constant.
ADMITTED_GLOBALS = frozenset({
    (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),  # TensorProperties pickles its memory format as this enum
    (_SHARD_METADATA, "TensorProperties"),
    (_SHARD_METADATA, "MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.layout's reducer: a name -> layout lookup
    ("collections", "OrderedDict"),
    ("builtins", "set"),  # sets in pickle protocols < 4
    ("builtins", "frozenset"),
    # StorageMeta.checkpoint_id is the Path a stock DCP save was given (pathlib._local: Python >= 3.13)
    *(("pathlib", name) for name in _PATH_CLASSES),
    *(("pathlib._local", name) for name in _PATH_CLASSES),
})


class UnreadableCheckpointError(CheckpointError):
    """A checkpoint file that could not be read, or was refused because of what it references."""

    def __init__(self, path: str, message: str, refused_global: str | None = None) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.reason = message
        self.refused_global = refused_global


def _torch_constant(module: str, name: str):
    """torch.float32 (`torch`, `float32`), torch.strided, torch.contiguous_format (`torch._utils`,
    `torch.contiguous_format`, as torch's reducer names it), or None."""
    if module == "torch":
        attr = name
    elif module == "torch._utils" and name.startswith("torch."):
        attr = name[len("torch."):]
    else:
        return None
    value = getattr(torch, attr, None) if attr.isidentifier() else None
    return value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str):
        constant = _torch_constant(module, name)
        if constant is not None:
            return constant
        if (module, name) not in ADMITTED_GLOBALS:
            raise UnreadableCheckpointError(
                self._path, f"refused: it references the global {module}.{name}, which a DCP metadata file "
                            f"never holds; not unpickled (nothing from it was run)", f"{module}.{name}")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise UnreadableCheckpointError(
                self._path, f"references {module}.{name}, which the installed torch does not have "
                            f"(written by another torch version?): {exc}") from None

    def persistent_load(self, pid):
        raise UnreadableCheckpointError(self._path, "refused: holds a persistent id, which a DCP metadata "
                                                    "file never does")


def read_metadata(directory: str):
    """The DCP `Metadata` of ``directory``, unpickled with only the classes such a file holds."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = os.path.join(directory, METADATA_FILE)
    try:
        with open(path, "rb") as f:
            meta = _MetadataUnpickler(f, path).load()
    except UnreadableCheckpointError:
        raise
    except OSError as exc:
        raise UnreadableCheckpointError(path, f"cannot be read: {exc.strerror or exc}") from None
    except Exception as exc:  # truncated or garbage bytes: UnpicklingError, EOFError, ValueError, ...
        raise UnreadableCheckpointError(path, f"is not a DCP metadata file (not a valid pickle: "
                                              f"{type(exc).__name__}: {exc})") from None
    if not isinstance(meta, Metadata):
        raise UnreadableCheckpointError(path, f"holds a {type(meta).__name__}, not a DCP Metadata")
    _check_shape(meta, path)
    return meta


def metadata_from_bytes(data: bytes, where: str):
    """`read_metadata` for the bytes of a `.metadata` read from elsewhere (a kvstore key named ``where``)."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        meta = _MetadataUnpickler(io.BytesIO(data), where).load()
    except UnreadableCheckpointError:
        raise
    except Exception as exc:  # truncated or garbage bytes
        raise UnreadableCheckpointError(where, f"is not a DCP metadata file (not a valid pickle: "
                                               f"{type(exc).__name__}: {exc})") from None
    if not isinstance(meta, Metadata):
        raise UnreadableCheckpointError(where, f"holds a {type(meta).__name__}, not a DCP Metadata")
    _check_shape(meta, where)
    return meta


def _check_shape(meta, path: str) -> None:
    """Refuse a Metadata whose fields are not the types verify and inspect walk."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

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
            raise UnreadableCheckpointError(path, f"malformed: entry {fqn!r} is a {type(md).__name__}")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo) \
                or not isinstance(getattr(info, "relative_path", None), str) \
                or not all(isinstance(getattr(info, a, None), int) for a in ("offset", "length")):
            raise UnreadableCheckpointError(path, f"malformed: storage entry {index!r} -> {info!r}")
        parts = info.relative_path.split("/")
        if os.path.isabs(info.relative_path) or not info.relative_path or ".." in parts or "" in parts:
            raise UnreadableCheckpointError(path, f"malformed: storage entry {index.fqn!r} points outside the "
                                                  f"checkpoint ({info.relative_path!r})")


_GLOBAL_IN_MESSAGE = re.compile(r"GLOBAL ([\w.]+)")


def weights_only_load(data: bytes, path: str):
    """``torch.load(weights_only=True)`` of ``data`` with megatron-core's safe globals, as stock
    Megatron loads its common state; a refusal names the global."""
    try:
        with torch.serialization.safe_globals(megatron_safe_globals()):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = _GLOBAL_IN_MESSAGE.search(str(exc))
        if refused:
            raise UnreadableCheckpointError(
                path, f"refused: it references the global {refused.group(1)}, which torch's weights-only "
                      f"loader and megatron-core's safe globals do not allow; not unpickled (nothing from it "
                      f"was run). Stock Megatron refuses it too", refused.group(1)) from None
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
    if os.path.isfile(path):
        with open(path, "rb") as f:
            data = f.read()
        return weights_only_load(data, path)
    found = common_state_item(meta)
    if found is None:
        return None
    index, info = found
    path = os.path.join(directory, info.relative_path)
    try:
        with open(path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
    except OSError as exc:
        raise UnreadableCheckpointError(path, f"cannot be read: {exc.strerror or exc}") from None
    obj = weights_only_load(data, f"{path}@{info.offset} ({index.fqn})")
    return obj[0] if isinstance(obj, list) and len(obj) == 1 else obj
