"""Megatron adapters (the edge): `save_checkpoint` for megatron.training, and a torch_dist
save strategy for code that calls megatron.core's `dist_checkpointing.save` itself."""

from .strategy import SafeTorchDistSaveStrategy, install_as_default
from .training import (
    REFUSED_SHARDING_TYPES,
    SAFE_SHARDING_TYPES,
    check_sharding_type,
    finalize_async_saves,
    options_from_args,
    retention_from_args,
    save_checkpoint,
    save_state,
)

__all__ = [
    "REFUSED_SHARDING_TYPES", "SAFE_SHARDING_TYPES", "SafeTorchDistSaveStrategy", "check_sharding_type",
    "finalize_async_saves", "install_as_default", "options_from_args", "retention_from_args", "save_checkpoint",
    "save_state",
]
