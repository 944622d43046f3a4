"""safe_ckpt: offload-aware writer of Megatron-core `torch_dist` checkpoints.

Saves model weights and distributed-optimizer shards straight from wherever each
tensor lives (GPU memory, pinned or pageable host memory) through a reusable pinned
staging pool, into the layout that stock Megatron and stock PyTorch DCP load.

Data flow: plan → residence → staging → encoding → sinks → commit, coordinated by
`dist` over a CPU (gloo) group; `save` wires the stages together. `load` reads any
torch_dist checkpoint back with the contract of megatron-core's `dist_checkpointing.load`
(`safe_ckpt/load/`: source → index → plan → execute, in parallel and safely).

The public API is what `__all__` names (saving, loading, checking a checkpoint, the errors,
progress on a terminal), plus the `safe_ckpt.megatron` and `safe_ckpt.integrations.slime`
adapters. Every other module is internal and may change between versions.
"""

from .api_tools import inspect, verify
from .errors import (
    CheckpointError,
    CommitError,
    CoordinationError,
    MissingDependencyError,
    RankFailure,
    ReadError,
    ResidenceError,
    SourceModifiedError,
    StagingTimeoutError,
    ValidationError,
    WriteError,
)
from .options import SaveOptions
from .load import LoadOptions
from .load import load  # the function: `safe_ckpt.load` (the package stays importable as safe_ckpt.load.*)
from .progress import show_progress
from .results import SaveResult, SaveTimings
from .saving import SaveHandle, async_save, save
from .staging.pool import prepare as prepare_staging_pool
from .staging.pool import release as release_staging_pool
from .tools.verify import VerifyReport
from .version import __version__

__all__ = [
    # saving
    "save", "async_save", "SaveOptions", "SaveResult", "SaveTimings", "SaveHandle",
    "prepare_staging_pool", "release_staging_pool",
    # loading
    "load", "LoadOptions",
    # checking a checkpoint
    "verify", "inspect", "VerifyReport",
    # errors: every failure of a save is a CheckpointError
    "CheckpointError", "ValidationError", "ResidenceError", "WriteError", "CommitError", "CoordinationError",
    "SourceModifiedError", "StagingTimeoutError", "ReadError", "MissingDependencyError", "RankFailure",
    # progress lines on a terminal
    "show_progress",
    "__version__",
]

_PUBLIC_SUBPACKAGES = ["integrations", "megatron"]


def __dir__() -> list[str]:
    # the public surface, not every internal module an import happened to load
    return sorted(set(__all__) | set(_PUBLIC_SUBPACKAGES))
