"""Pickled parts of a checkpoint, decoded without running code from them.

One job: turn the bytes of a ShardedObject and of the common state (`common.pt`, or the
`common_state` object of megatron-core >= 0.19) into Python objects with torch's weights-only
unpickler, admitting megatron-core's own safe globals (as stock Megatron does for the common
state) plus the classes a caller lists in `LoadOptions.safe_globals`. Stock DCP decodes
ShardedObjects with `weights_only=False`; here they get the same restriction as the common
state, and a refusal names the class and the remedy instead of running it.
Must not: call `pickle.load` or `torch.load(weights_only=False)`.
"""

from __future__ import annotations

import pickle

from .. import weights_only
from ..errors import ReadError
from ..names import COMMON_STATE_FILE, COMMON_STATE_KEY
from .index import CheckpointIndex, StoredItem
from .source import Source

_COMMON_STATE_BYTES = 1 << 30


def decode(data, where: str, safe_globals=(), map_location=None, megatron_globals: bool = True):
    """``torch.load(weights_only=True)`` of ``data`` with megatron-core's safe globals and ``safe_globals``."""
    try:
        return weights_only.load(data, safe_globals, map_location, megatron_globals)
    except pickle.UnpicklingError as exc:
        refused = weights_only.refused_global(exc)
        if refused:
            raise ReadError(
                f"{where}: refused: it references {refused}, which neither torch's weights-only loader "
                f"nor megatron-core's safe globals allow (nothing from it was run). If you trust this checkpoint "
                f"and the class, list it in LoadOptions(safe_globals=(...))") from None
        raise ReadError(f"{where}: not a readable torch.save archive (torch's weights-only loader: "
                        f"{weights_only.reason(str(exc))})") from None
    except Exception as exc:
        raise ReadError(f"{where}: not a readable torch.save archive ({type(exc).__name__}: "
                        f"{weights_only.reason(str(exc))})") from None


def read_item(source: Source, item: StoredItem) -> bytearray:
    out = bytearray(item.length_bytes)
    source.readv(item.relative_path, item.offset_bytes, [memoryview(out)])
    return out


def item_where(source: Source, item: StoredItem, fqn: str) -> str:
    return f"{source.describe(item.relative_path)} at offset {item.offset_bytes} (key {fqn!r})"


def read_common_state(source: Source, index: CheckpointIndex | None, safe_globals=()) -> dict:
    """The common state as stock Megatron loads it: `common.pt` where there is one, else the
    `common_state` object (its stored list's only element; ``index`` may be None only where
    `common.pt` exists)."""
    if source.exists(COMMON_STATE_FILE):
        data = source.read_whole(COMMON_STATE_FILE, _COMMON_STATE_BYTES)
        return decode(data, source.describe(COMMON_STATE_FILE), safe_globals, map_location="cpu")
    for fqn, item in (index.objects if index is not None else {}).items():
        if fqn.split("/shard_")[0] == COMMON_STATE_KEY:
            where = item_where(source, item, fqn)
            obj = decode(read_item(source, item), where, safe_globals)
            if not (isinstance(obj, list) and len(obj) == 1 and isinstance(obj[0], dict)):
                raise ReadError(f"{where}: holds a {type(obj).__name__}, not the one-element list of a dict stock "
                                f"Megatron stores as the common state")
            return obj[0]
    raise ReadError(f"{source.root}: no common state (neither {COMMON_STATE_FILE} nor a "
                    f"{COMMON_STATE_KEY} object): not a complete Megatron checkpoint")
