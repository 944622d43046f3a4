"""Every torch / megatron-core version difference the library depends on, in one place.

One job: answer "how does the installed torch / megatron-core spell this?" so the rest
of the package never branches on versions. Must not: hold state, do I/O beyond what
a stock writer would do for the same object (``torch.save`` of small objects).
"""

from __future__ import annotations

import dataclasses
import functools
import io
from functools import lru_cache
from importlib import metadata as importlib_metadata
from typing import Any

import torch
from packaging.version import Version

from .names import SHARDED_BACKEND, SHARDED_BACKEND_VERSION


@lru_cache(maxsize=None)
def package_version(name: str) -> Version | None:
    try:
        return Version(importlib_metadata.version(name))
    except importlib_metadata.PackageNotFoundError:
        return None


# The oldest megatron-core whose checkpoints the tests load back with stock Megatron
# (scripts/compat.sh). 0.13-0.14's distributed optimizer saves `flattened_range` shards,
# which the plan refuses, so those releases are refused up front instead of mid-save.
MEGATRON_CORE_FLOOR = Version("0.15")
_INSTALL_HINT = f"pip install 'megatron-core>={MEGATRON_CORE_FLOOR}'"


def _installed_megatron_version() -> Version | None:
    return package_version("megatron-core") or package_version("megatron_core")


def unsupported_megatron_reason(version: Version) -> str | None:
    """Why ``version`` of megatron-core cannot be used, or None where it can."""
    # By release only: 0.15.0rc0 and source builds of 0.15 count as 0.15.
    if version.release[:2] >= MEGATRON_CORE_FLOOR.release[:2]:
        return None
    return (f"safe_ckpt needs megatron-core >= {MEGATRON_CORE_FLOOR}, but megatron-core {version} is installed: "
            f"its distributed optimizer saves flattened_range shards, which safe_ckpt does not write. "
            f"Upgrade with: {_INSTALL_HINT}")


@lru_cache(maxsize=None)
def megatron_version() -> Version:
    """The installed megatron-core's version; ImportError naming the floor when missing or too old."""
    version = _installed_megatron_version()
    if version is None:  # a source tree on sys.path has no package metadata, but says its version
        try:
            from megatron.core import package_info

            version = Version(package_info.__version__)
        except (ImportError, AttributeError, ValueError):
            raise ImportError(f"safe_ckpt needs megatron-core >= {MEGATRON_CORE_FLOOR} ({_INSTALL_HINT})") from None
    reason = unsupported_megatron_reason(version)
    if reason is not None:
        raise ImportError(reason)
    return version


def torch_version() -> Version:
    return Version(torch.__version__.split("+")[0])


# ---------------------------------------------------------------- torch serialization


def dtype_itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


@lru_cache(maxsize=None)
def _untyped_dtypes() -> frozenset:
    new_dtypes = getattr(torch.storage, "_new_dtypes", None)
    return frozenset(new_dtypes()) if new_dtypes is not None else frozenset()


@lru_cache(maxsize=None)
def legacy_storage_type(dtype: torch.dtype):
    """The typed storage class torch pickles for ``dtype``, or None for byte storage."""
    if dtype in _untyped_dtypes():
        return None
    try:
        name = torch.storage.TypedStorage(dtype=dtype, device="cpu", _internal=True)._pickle_storage_type()
    except (KeyError, RuntimeError):
        return None
    return getattr(torch, name, None)


_QUANTIZED = {"quint8", "qint8", "qint32", "quint4x2", "quint2x4"}


def is_saveable_dtype(dtype: torch.dtype) -> bool:
    """Whether a chunk of this dtype can be written as raw bytes in a torch.save container."""
    if str(dtype).removeprefix("torch.") in _QUANTIZED:
        return False
    # Sub-byte dtypes (int1..int7, uint1..uint7) have neither storage form: torch cannot save them.
    return legacy_storage_type(dtype) is not None or dtype in _untyped_dtypes()


def torch_save_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# ------------------------------------------------------------------- DCP metadata


@functools.lru_cache(maxsize=None)  # called per chunk: a save of 2000 items asked 10k times
def dcp_classes():
    """The DCP metadata classes, imported lazily (torch.distributed may be absent)."""
    from torch.distributed.checkpoint import metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return md, _StorageInfo


def tensor_properties(dtype: torch.dtype):
    md, _ = dcp_classes()
    return md.TensorProperties(dtype=dtype)


def chunk_metadata(offsets, sizes):
    md, _ = dcp_classes()
    return md.ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def tensor_storage_metadata(dtype, size, chunks):
    md, _ = dcp_classes()
    return md.TensorStorageMetadata(properties=tensor_properties(dtype), size=torch.Size(size), chunks=chunks)


def bytes_storage_metadata():
    md, _ = dcp_classes()
    return md.BytesStorageMetadata()


def metadata_index(fqn: str, offsets=None, index: int | None = None):
    md, _ = dcp_classes()
    return md.MetadataIndex(fqn=fqn, offset=None if offsets is None else torch.Size(offsets), index=index)


def storage_info(relative_path: str, offset_bytes: int, length_bytes: int):
    _, storage_info_cls = dcp_classes()
    return storage_info_cls(relative_path=relative_path, offset=offset_bytes, length=length_bytes)


def dcp_metadata(state_dict_metadata: dict, storage_data: dict, checkpoint_id: str, save_id: str):
    """A `Metadata` as the installed torch's FileSystemWriter would finish it."""
    md, _ = dcp_classes()
    meta = md.Metadata(state_dict_metadata=state_dict_metadata)
    meta.storage_data = storage_data
    fields = {f.name for f in dataclasses.fields(md.Metadata)}
    if "storage_meta" in fields and hasattr(md, "StorageMeta"):
        meta.storage_meta = md.StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id)
    if "version" in fields:
        from torch.distributed.checkpoint import filesystem

        meta.version = getattr(filesystem, "CURRENT_DCP_VERSION", None)
    return meta


# -------------------------------------------------------------------- megatron-core


def mcore_mapping():
    megatron_version()  # a missing or too old megatron-core is refused here, at save time, by name
    from megatron.core.dist_checkpointing import mapping

    return mapping


def checkpointing_config_dict(backend: str = SHARDED_BACKEND, version: int = SHARDED_BACKEND_VERSION) -> dict:
    """The ``metadata.json`` content the installed megatron-core writes."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig

    return dataclasses.asdict(CheckpointingConfig(backend, version))


def is_main_replica(replica_id) -> bool:
    return mcore_mapping().is_main_replica(replica_id)


@dataclasses.dataclass(frozen=True)
class MegatronParts:
    """A sharded state dict split the way megatron-core's save preprocessing splits it."""

    sharded_tree: dict  # only ShardedTensor / ShardedObject leaves, original structure
    common_state: dict


def _copy_containers(tree):
    if isinstance(tree, dict):
        return {k: _copy_containers(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy_containers(v) for v in tree]
    return tree


def split_megatron_state(sharded_state_dict: dict, content_metadata: dict | None = None) -> MegatronParts:
    """Apply factories, drop non-persistent objects, split sharded from common state.

    Uses megatron-core's own tree utilities so the common state has exactly the
    structure stock saving gives it; works on a copy of the containers so the
    caller's dict is left as it was.
    """
    from megatron.core.dist_checkpointing.mapping import apply_factories
    from megatron.core.dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base

    tree = _copy_containers(sharded_state_dict)
    if content_metadata is not None:
        tree["content_metadata"] = content_metadata
    apply_factories(tree)
    _, tree = extract_nonpersistent(tree)
    sharded, common = extract_sharded_base(tree)
    if "content_metadata" in common:
        common["content_metadata"] = clean_content_metadata(common["content_metadata"])
    return MegatronParts(sharded_tree=sharded, common_state=common)


def clean_content_metadata(content_metadata):
    """`content_metadata` without the process group megatron-core >= 0.16 puts in it."""
    if content_metadata is None:
        return None
    try:
        from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization
    except ImportError:
        return {k: v for k, v in content_metadata.items() if k != "dp_cp_group"}
    return _clean_metadata_for_serialization(content_metadata)


def sharded_object_payload(datas: list) -> bytes:
    """The bytes item megatron-core's torch_dist strategy stores for a ShardedObject."""
    return torch_save_bytes(list(datas))


# megatron-core <= 0.18 stores the common state as `COMMON_STATE_FILE` (rank 0, torch.save);
# 0.19 stores it as a ShardedObject `COMMON_STATE_KEY` (and still reads the file).


def common_state_as_sharded_object() -> bool:
    return megatron_version() >= Version("0.19.0")


def megatron_safe_globals() -> list:
    """The classes megatron-core lets `torch.load(weights_only=True)` rebuild in its common state
    (megatron.core.safe_globals; none where the installed version has no such list)."""
    try:
        from megatron.core.safe_globals import SAFE_GLOBALS
    except ImportError:
        return []
    return list(SAFE_GLOBALS)


def common_state_payload(common_state: dict) -> bytes:
    return sharded_object_payload([common_state])


def unsafe_globals_in_checkpoint():
    """torch's static scan of a `torch.save` payload for the globals weights_only refuses (torch >= 2.5), else None."""
    return getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)


def generational_gc() -> bool:
    """Whether the oldest generation runs when `gc.set_threshold`'s third value says (CPython < 3.14,
    with the GIL): 3.14's incremental collector ignores it and does not pause on the whole heap."""
    import sys
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    return sys.implementation.name == "cpython" and sys.version_info < (3, 14) and gil


def all_gather_into_tensor(output: torch.Tensor, input_tensor: torch.Tensor, group) -> None:
    """Every rank's ``input_tensor``, in rank order, into ``output``, on the group itself: torch's
    wrapper refuses a gloo backend outside its group registry, as the asleep save's detached one is."""
    group._allgather_base(output, input_tensor).wait()


def stock_integrity_manifest() -> bool:
    """Whether the installed megatron-core writes and checks `integrity.json` (0.18 and later)."""
    try:
        from megatron.core.dist_checkpointing import validation
    except ImportError:
        return False
    return hasattr(validation, "verify_integrity_manifest") and hasattr(validation, "save_integrity_manifest")


def torch_dist_save_strategy_base():
    """The class a custom torch_dist save strategy must subclass (0.17+ replace any other)."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy


def register_default_save_strategy(strategy) -> bool:
    """Make ``strategy`` megatron-core's default torch_dist save strategy (<= 0.16 only).

    Those versions re-register the stock strategy on every lookup, so the registration
    hook itself is wrapped. Returns False where there is no registry (>= 0.17).
    """
    try:
        from megatron.core.dist_checkpointing.strategies import base, torch as torch_strategies
    except ImportError:
        return False
    if not hasattr(base, "register_default_strategy") or not hasattr(torch_strategies, "register_default_torch_strategies"):
        return False
    stock = getattr(torch_strategies.register_default_torch_strategies, "__wrapped__",
                    torch_strategies.register_default_torch_strategies)

    def register():
        stock()
        base.register_default_strategy(base.StrategyAction.SAVE_SHARDED, SHARDED_BACKEND, SHARDED_BACKEND_VERSION,
                                      strategy)

    register.__wrapped__ = stock
    torch_strategies.register_default_torch_strategies = register
    register()
    return True


# At import: an installed megatron-core older than the floor fails here, with the versions
# named, rather than deep inside a save. (Only package metadata is read: importing megatron
# itself is slow, and a missing one is reported at save time.)
_installed = _installed_megatron_version()
if _installed is not None and unsupported_megatron_reason(_installed) is not None:
    raise ImportError(unsupported_megatron_reason(_installed))


# ------------------------------------------------------------------------ loading


def torch_dist_load_strategy_base():
    """The class a custom torch_dist load strategy subclasses: `TorchDistLoadShardedStrategy`,
    whose backend checks (<= 0.16 registry) and metadata readers every version calls."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    return TorchDistLoadShardedStrategy


def accepted_kwargs(fn, kwargs: dict) -> dict:
    """The part of ``kwargs`` ``fn`` takes (its signature differs between versions:
    `TorchDistLoadShardedStrategy()` takes none up to 0.16, `cache_metadata=...` and more from 0.17)."""
    import inspect

    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def training_dist_checkpointing(checkpointing_module):
    """The `megatron.core.dist_checkpointing` module as `megatron.training.checkpointing` names it
    (`from megatron.core import dist_checkpointing` in Megatron-LM core_v0.15 ... core_v0.19 and
    1dcf0dafa884); its `load` and `load_common_state_dict` are the only ways that module's
    `load_checkpoint` reads a torch_dist checkpoint."""
    import types

    found = getattr(checkpointing_module, "dist_checkpointing", None)
    found = getattr(found, "_stock", found)  # a load already in progress swapped it
    if not isinstance(found, types.ModuleType) or not hasattr(found, "load") \
            or not hasattr(found, "load_common_state_dict"):
        raise ImportError("megatron.training.checkpointing has no dist_checkpointing module with load and "
                          "load_common_state_dict: this Megatron-LM is not one safe_ckpt's load_checkpoint knows")
    return found


def step_replaying_cuda_graph(args) -> str | None:
    """The flag replaying an optimizer step or param gather as a CUDA graph, or None: 0.15-0.18
    `--cuda-graph-impl local --cuda-graph-scope full_iteration` (a string in 0.15, `CudaGraphScope`s
    from 0.16); 0.19+ `--cuda-graph-impl full_iteration` and `--optimizer-cuda-graph`."""
    impl = getattr(args, "cuda_graph_impl", None)
    scope = getattr(args, "cuda_graph_scope", None)
    scopes = {getattr(s, "name", s) for s in (scope if isinstance(scope, (list, tuple)) else [scope])}
    if impl == "full_iteration":
        return "--cuda-graph-impl full_iteration"
    if impl == "local" and "full_iteration" in scopes:
        return "--cuda-graph-scope full_iteration"
    if getattr(args, "optimizer_cuda_graph", False):
        return "--optimizer-cuda-graph"
    return None


def param_gathers_pending(model_chunks) -> int:
    """DDP bucket groups of ``model_chunks`` with a param all-gather still to dispatch or wait for
    (`param_gather_dispatched`, `param_gather_handle`: the same in megatron-core 0.15 to 0.19)."""
    pending = 0
    for chunk in model_chunks:
        groups = list(getattr(chunk, "bucket_groups", None) or []) + \
            list(getattr(chunk, "expert_parallel_bucket_groups", None) or [])
        pending += sum(1 for g in groups if not getattr(g, "param_gather_dispatched", False)
                       or getattr(g, "param_gather_handle", None) is not None)
    return pending
