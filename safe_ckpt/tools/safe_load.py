"""Reading a checkpoint's pickled files without running code from them.

One job: give `verify` and `inspect` the `.metadata` index and the common state of a
checkpoint someone may have sent them, where a pickle can name any callable. `.metadata`
(up to MAX_METADATA_BYTES) goes through Python's own unpickler, which lets BUILD set fields
only on DCP's records, bounds what calls copy and how tuples nest, and resolves only the
classes a DCP metadata file holds in torch 2.6-2.14 (found by disassembling files
written by stock DCP, stock Megatron and this library, and from torch's sources for moved
classes); the common state goes through torch's weights-only unpickler with megatron-core's
own safe globals, as stock Megatron loads it. Files are opened through `checkpoint_files`
(regular files inside the checkpoint only). A refused or unreadable file is an
`UnreadableCheckpointError` naming the file and, when one was refused, the global.
Must not: call `pickle.load`, `torch.load(weights_only=False)` or DCP's
`read_metadata` (a plain `pickle.load`) on anything from the checkpoint.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import re
import reprlib
import types

import torch

from ..compat import COMMON_STATE_FILE, COMMON_STATE_KEY, megatron_safe_globals
from ..errors import UnreadableCheckpointError
from .checkpoint_files import open_file, read_file

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


# A `.metadata` larger than this is refused unread: the biggest index a real run writes is far smaller,
# and unpickling costs memory in proportion to the file.
MAX_METADATA_BYTES = 1 << 30
# The common state (`common.pt`): the run's arguments, optimizer param groups, rng state.
MAX_COMMON_STATE_BYTES = 1 << 30
# The DCP records a legitimate file sets the state of (BUILD); nothing else, and no class, ever is.
_BUILD_TARGETS = (
    (_DCP_METADATA, "Metadata"), (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"), (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "TensorProperties"), (_DCP_METADATA, "MetadataIndex"), (_DCP_METADATA, "StorageMeta"),
    (_SHARD_METADATA, "TensorProperties"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
)
# Hashing a tuple recurses in C without a depth check (a deep one crashes the interpreter) and walks
# shared sub-tuples once per reference (a doubling chain takes forever): tuples are refused past these.
_MAX_TUPLE_DEPTH = 64
_MAX_TUPLE_LEAVES = 1 << 20

_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 80


def _show(value) -> str:
    """A bounded repr of a value from an untrusted file: builtin values truncated, anything else by type."""
    if isinstance(value, (str, bytes, int, float, bool, tuple, list, dict, set, frozenset, type(None))):
        try:
            return _SHOW.repr(value)
        except RecursionError:
            pass
    return f"<{type(value).__name__}>"


def _then_track_tuple(base):
    def handler(unpickler):
        base(unpickler)
        unpickler._track_tuple()
    return handler


class _MetadataUnpickler(pickle._Unpickler):
    """Python's own unpickler (its memo is a dict: a huge memo index costs nothing) with globals
    restricted to ADMITTED_GLOBALS, BUILD restricted to DCP records, and bounds on what calls copy
    and on tuples."""

    def __init__(self, file, path: str, budget_elements: int = 1 << 24) -> None:
        super().__init__(file)
        self._path = path
        # REDUCE / NEWOBJ of an admitted class (set, frozenset, torch.Size, ...) copies its argument and
        # a dict or set hashes each key: repeated on one shared list or tuple, a small file would cost
        # quadratic memory or time. Both are charged to one budget in proportion to the file.
        self._copy_budget = budget_elements
        self._tuples: dict[int, tuple[tuple, int, int]] = {}  # id -> (the tuple or record, depth, leaves)
        self._build_targets = None

    def _refuse(self, message: str, refused_global: str | None = None):
        raise UnreadableCheckpointError(self._path, message, refused_global)

    def find_class(self, module: str, name: str):
        constant = _torch_constant(module, name)
        if constant is not None:
            return constant
        if (module, name) not in ADMITTED_GLOBALS:
            self._refuse(f"refused: it references the global {module}.{name}, which a DCP metadata file "
                         f"never holds; not unpickled (nothing from it was run)", f"{module}.{name}")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            self._refuse(f"references {module}.{name}, which the installed torch does not have "
                         f"(written by another torch version?): {exc}")

    def persistent_load(self, pid):
        self._refuse("refused: holds a persistent id, which a DCP metadata file never does")

    def _targets(self) -> tuple:
        if self._build_targets is None:
            found = []
            for module, name in _BUILD_TARGETS:
                try:
                    found.append(getattr(importlib.import_module(module), name))
                except (ImportError, AttributeError):
                    pass
            self._build_targets = tuple(found)
        return self._build_targets

    def _load_build(self):
        # BUILD's state goes into the object below it by __dict__ update or setattr: on a class that
        # find_class returned it would rewrite the class for the whole process.
        if len(self.stack) >= 2:
            state, target = self.stack[-1], self.stack[-2]
            if isinstance(target, type):
                self._refuse(f"refused: it sets attributes of the class {target.__module__}."
                             f"{target.__qualname__}, which a DCP metadata file never does; not unpickled")
            if type(target) not in self._targets():
                self._refuse(f"refused: it sets the state of a {type(target).__qualname__}, which a DCP "
                             f"metadata file only does to its own records; not unpickled")
            parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
            for part in parts:
                for key in part if isinstance(part, dict) else ():
                    if not isinstance(key, str) or key.startswith("_"):
                        self._refuse(f"refused: it sets the attribute {_show(key)} of a "
                                     f"{type(target).__qualname__}, which is not a field; not unpickled")
        state = self.stack[-1] if self.stack else None
        pickle._Unpickler.load_build(self)
        parts = state if isinstance(state, tuple) else (state,)
        self._track(self.stack[-1], [v for part in parts for v in (part.values() if isinstance(part, dict) else
                                                                   () if part is None else (part,))])

    def _weight(self, value) -> int:
        """What hashing ``value`` walks: a tracked tuple's or record's leaves, else 1."""
        return self._tuples.get(id(value), (None, 1, 1))[2]

    def _charge_copy(self, *values) -> None:
        """Charge a call's arguments (an args tuple, a kwargs dict): what it copies and hashes."""
        for value in values:
            for arg in value.values() if isinstance(value, dict) else value if isinstance(value, tuple) else ():
                if isinstance(arg, (str, bytes, dict)):
                    self._charge(len(arg))
                elif isinstance(arg, (tuple, list, set, frozenset)):
                    self._charge(len(arg) + sum(self._weight(item) for item in arg))

    def _charge(self, elements: int) -> None:
        self._copy_budget -= elements
        if self._copy_budget < 0:
            self._refuse("refused: building it copies or hashes more elements than a DCP metadata file "
                         "of its size holds")

    def _charge_keys(self, keys) -> None:
        self._charge(sum(self._weight(key) for key in keys))

    def _load_setitem(self):
        if len(self.stack) >= 2:
            self._charge_keys((self.stack[-2],))
        pickle._Unpickler.load_setitem(self)

    def _load_setitems(self):  # the items since the last MARK are the whole current stack
        self._charge_keys(self.stack[0::2])
        pickle._Unpickler.load_setitems(self)

    def _load_dict(self):
        self._charge_keys(self.stack[0::2])
        pickle._Unpickler.load_dict(self)

    def _load_additems(self):
        self._charge_keys(self.stack)
        pickle._Unpickler.load_additems(self)

    def _load_frozenset(self):
        self._charge_keys(self.stack)
        pickle._Unpickler.load_frozenset(self)

    def _load_reduce(self):
        if self.stack:
            self._charge_copy(self.stack[-1])
        pickle._Unpickler.load_reduce(self)

    def _load_newobj(self):
        if self.stack:
            self._charge_copy(self.stack[-1])
        pickle._Unpickler.load_newobj(self)

    def _load_newobj_ex(self):
        if len(self.stack) >= 2:
            self._charge_copy(self.stack[-1], self.stack[-2])
        pickle._Unpickler.load_newobj_ex(self)

    def _track_tuple(self):
        self._track(self.stack[-1], self.stack[-1])

    def _track(self, made, parts) -> None:
        """Record how deep and wide hashing ``made`` goes: a tuple, or a record (MetadataIndex is
        hashed by its fields) whose state ``parts`` holds; refuse past the bounds."""
        depth, leaves = 1, 1
        for item in parts:
            if isinstance(item, tuple) or type(item) in self._targets():
                _, d, n = self._tuples.get(id(item), (None, 1, len(item) + 1 if isinstance(item, tuple) else 1))
                depth, leaves = max(depth, d + 1), leaves + n
            else:
                leaves += 1
        if depth > _MAX_TUPLE_DEPTH or leaves > _MAX_TUPLE_LEAVES:
            self._refuse(f"refused: it holds a tuple or record nested {depth} deep with {leaves} elements in "
                         f"all, which a DCP metadata file never does")
        self._tuples[id(made)] = (made, depth, leaves)

    dispatch = types.MappingProxyType({
        **pickle._Unpickler.dispatch,
        pickle.BUILD[0]: _load_build,
        pickle.REDUCE[0]: _load_reduce,
        pickle.NEWOBJ[0]: _load_newobj,
        pickle.NEWOBJ_EX[0]: _load_newobj_ex,
        pickle.SETITEM[0]: _load_setitem,
        pickle.SETITEMS[0]: _load_setitems,
        pickle.DICT[0]: _load_dict,
        pickle.ADDITEMS[0]: _load_additems,
        pickle.FROZENSET[0]: _load_frozenset,
        **{op[0]: _then_track_tuple(pickle._Unpickler.dispatch[op[0]])
           for op in (pickle.TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)},
    })


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
    try:
        meta = _MetadataUnpickler(io.BytesIO(data), where, budget_elements=4 * len(data) + (1 << 20)).load()
    except UnreadableCheckpointError:
        raise
    except RecursionError:
        raise UnreadableCheckpointError(where, "is not a DCP metadata file (nested too deep to read)") from None
    except Exception as exc:  # truncated or garbage bytes: UnpicklingError, EOFError, ValueError, ...
        raise UnreadableCheckpointError(where, f"is not a DCP metadata file (not a valid pickle: "
                                               f"{type(exc).__name__}: {_SHOW.repr(str(exc))[1:-1]})") from None
    if not isinstance(meta, Metadata):
        raise UnreadableCheckpointError(where, f"holds a {type(meta).__name__}, not a DCP Metadata")
    try:
        _check_shape(meta, where)
    except RecursionError:
        raise UnreadableCheckpointError(where, "malformed: nested too deep to check") from None
    return meta


def _non_negative_ints(value, rank: int | None = None) -> bool:
    return (isinstance(value, (tuple, list)) and (rank is None or len(value) == rank)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value))


def _check_shape(meta, path: str) -> None:
    """Refuse a Metadata whose fields are not the types verify and inspect walk."""
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
            if not _non_negative_ints(size):
                raise UnreadableCheckpointError(path, f"malformed: entry {_show(fqn)} has the size {_show(size)}, "
                                                      f"not a sequence of non-negative ints")
            for i, chunk in enumerate(md.chunks):
                if not isinstance(chunk, ChunkStorageMetadata) \
                        or not _non_negative_ints(getattr(chunk, "offsets", None), len(size)) \
                        or not _non_negative_ints(getattr(chunk, "sizes", None), len(size)):
                    shown = (f"offsets {_show(getattr(chunk, 'offsets', None))}, sizes "
                             f"{_show(getattr(chunk, 'sizes', None))}" if isinstance(chunk, ChunkStorageMetadata)
                             else f"a {type(chunk).__name__}")
                    raise UnreadableCheckpointError(
                        path, f"malformed: entry {_show(fqn)} chunk {i} is {shown}, not offsets and sizes of "
                              f"{len(size)} non-negative ints each")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(getattr(index, "fqn", None), str) \
                or not isinstance(info, _StorageInfo) \
                or not isinstance(getattr(info, "relative_path", None), str) \
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                           for v in (getattr(info, "offset", None), getattr(info, "length", None))):
            fqn = getattr(index, "fqn", None) if isinstance(index, MetadataIndex) else index
            shown = (f"{_show(info.relative_path)} offset {_show(info.offset)} length {_show(info.length)}"
                     if isinstance(info, _StorageInfo) else f"a {type(info).__name__}")
            raise UnreadableCheckpointError(path, f"malformed: storage entry {_show(fqn)} -> {shown} (needs a "
                                                  f"file name and a non-negative int offset and length)")
        parts = info.relative_path.split("/")
        if os.path.isabs(info.relative_path) or not info.relative_path or ".." in parts or "" in parts:
            raise UnreadableCheckpointError(path, f"malformed: storage entry {_show(index.fqn)} points outside "
                                                  f"the checkpoint ({_show(info.relative_path)})")


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
