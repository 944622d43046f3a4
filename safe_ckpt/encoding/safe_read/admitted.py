"""What a DCP `.metadata` may reference: the globals the restricted unpickler resolves.

One job: name every (module, name) a legitimate `.metadata` holds (ADMITTED_GLOBALS, found by
disassembling files written by stock DCP, stock Megatron and this library in torch 2.6-2.14,
and from torch's sources for moved classes), which of them are records whose state BUILD may
set, which hash what they are given, and torch's dtype, layout and memory-format constants.
Must not: import a module a file names unless its (module, name) is admitted.
"""

from __future__ import annotations

import importlib

import torch

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# torch < 2.2 pickled TensorProperties from its old home; torch still defines it there.
_SHARD_METADATA = "torch.distributed._shard.sharded_tensor.metadata"
_PATH_CLASSES = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")

# The DCP records a legitimate file sets the state of (BUILD); nothing else, and no class, ever is.
_RECORDS = (
    (_DCP_METADATA, "Metadata"), (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"), (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "TensorProperties"), (_DCP_METADATA, "MetadataIndex"), (_DCP_METADATA, "StorageMeta"),
    (_SHARD_METADATA, "TensorProperties"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
)
# Records of another package, resolved only when a file names them (importing megatron.core costs
# seconds): megatron-core 0.15 pickles its own Metadata subclass, one more field of plain data.
_FOREIGN_RECORDS = (("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"),)
# Callables that hash what their argument holds (a set's elements, a mapping's keys) ...
_HASH_ELEMENTS = frozenset({("builtins", "set"), ("builtins", "frozenset"), ("collections", "OrderedDict")})
# ... and that hash the argument itself (a lookup by value or name).
_HASH_ARGUMENT = frozenset({(_DCP_METADATA, "_MEM_FORMAT_ENCODING"), (_SHARD_METADATA, "MEM_FORMAT_ENCODING"),
                            ("torch.serialization", "_get_layout")})

# Every (module, name) a legitimate `.metadata` references, besides torch's dtype, layout and
# memory-format constants (matched by type in `torch_constant`). Each one is data: a dataclass whose
# state is set by BUILD or a `__setstate__` that only assigns fields, or a callable that maps a plain
# value to a constant, or a container.
ADMITTED_GLOBALS = frozenset({
    *_RECORDS,
    *_FOREIGN_RECORDS,
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),  # TensorProperties pickles its memory format as this enum
    (_SHARD_METADATA, "MEM_FORMAT_ENCODING"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.layout's reducer: a name -> layout lookup
    ("collections", "OrderedDict"),
    ("builtins", "set"),  # sets in pickle protocols < 4
    ("builtins", "frozenset"),
    # StorageMeta.checkpoint_id is the Path a stock DCP save was given (pathlib._local: Python >= 3.13)
    *(("pathlib", name) for name in _PATH_CLASSES),
    *(("pathlib._local", name) for name in _PATH_CLASSES),
})


def torch_constant(module: str, name: str):
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


def _resolve(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def _loaded(pairs) -> tuple:
    found = []
    for module, name in pairs:
        try:
            found.append(_resolve(module, name))
        except (ImportError, AttributeError):
            pass
    return tuple(found)
