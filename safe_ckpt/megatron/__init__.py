"""Megatron adapters (the edge): `save_checkpoint` and `load_checkpoint` for megatron.training,
and torch_dist save and load strategies for code that calls megatron.core's
`dist_checkpointing.save` / `load` itself."""

from .loading import LoadedCheckpoint, SafeTorchDistLoadStrategy, load_checkpoint, load_options_from_args, loaded_checkpoint
from .strategy import SafeTorchDistSaveStrategy, install_as_default
from ..targets.retention import Retention
from .training import (
    REFUSED_SHARDING_TYPES,
    SAFE_SHARDING_TYPES,
    check_sharding_type,
    finalize_async_saves,
    finalizing_too,
    options_from_args,
    retention_from_args,
    save_checkpoint,
    save_state,
)

__all__ = [
    "REFUSED_SHARDING_TYPES", "SAFE_SHARDING_TYPES", "LoadedCheckpoint", "Retention", "SafeTorchDistLoadStrategy",
    "SafeTorchDistSaveStrategy", "check_sharding_type", "finalize_async_saves", "finalizing_too", "install_as_default",
    "load_checkpoint", "load_options_from_args", "loaded_checkpoint", "options_from_args", "retention_from_args",
    "save_checkpoint", "save_state",
]
