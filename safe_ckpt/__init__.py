"""safe_ckpt: offload-aware writer of Megatron-core `torch_dist` checkpoints.

Saves model weights and distributed-optimizer shards straight from wherever each
tensor lives (GPU memory, pinned or pageable host memory) through a reusable pinned
staging pool, into the layout that stock Megatron and stock PyTorch DCP load.

A save, and the folder each stage lives in (`saving/` wires them together, in phases:
planned → writing → result, with a vote of every rank between them over a gloo group, `coord/`):

    state dict ──► plan/        shards and objects → one global plan every rank agrees on
               ──► residence/   where each source lives (GPU, paused GPU, pinned, pageable)
               ──► staging/     device bytes → pinned host pool (the copy window, its gates)
               ──► encoding/    torch_dist bytes: chunk containers, .metadata, manifests
               ──► write/       one rank's writers: stage → encode → sink, with progress
               ──► sinks/       bytes at offsets, durably (a POSIX file, a TensorStore key)
               ──► targets/     the destination: claim, stage, publish atomically, abort;
                                a directory or an object store (one `Target` each,
                                docs/extending.md), and the save root's tracker and retention
    host/ sizes the threads and the pool from this process's share of its host; tools/ holds
    verify, inspect and copy; megatron/ and integrations/ are the edges (Megatron, slime).

`load` reads any torch_dist checkpoint back with the contract of megatron-core's
`dist_checkpointing.load` (`loading/`: source → index → plan → execute, in parallel and safely).

The public API is what `__all__` names (saving, loading, checking a checkpoint, the errors,
progress on a terminal), plus the `safe_ckpt.megatron` and `safe_ckpt.integrations.slime`
adapters. Every other module is internal and may change between versions.
"""

from .tools.api import inspect, verify
from .errors import (
    CheckpointError,
    CommitError,
    CoordinationError,
    MissingDependencyError,
    PathUsageError,
    RankFailure,
    ReadError,
    ResidenceError,
    SourceModifiedError,
    StagingTimeoutError,
    UnloadableStateError,
    ValidationError,
    WriteError,
)
from .options import SaveOptions
from .loading import LoadOptions, load
from .write.progress import show_progress
from .results import SaveResult, SaveTimings
from .saving import SaveHandle, async_save, save
from .staging.pool import prepare as prepare_staging_pool
from .staging.pool import release as release_staging_pool
from .staging.gates import before_update
from .tools.verify import VerifyReport
from .version import __version__

__all__ = [
    # saving
    "save", "async_save", "SaveOptions", "SaveResult", "SaveTimings", "SaveHandle",
    "prepare_staging_pool", "release_staging_pool", "before_update",
    # loading
    "load", "LoadOptions",
    # checking a checkpoint
    "verify", "inspect", "VerifyReport",
    # errors: every failure of a save is a CheckpointError
    "CheckpointError", "ValidationError", "ResidenceError", "WriteError", "CommitError", "CoordinationError",
    "SourceModifiedError", "StagingTimeoutError", "UnloadableStateError", "ReadError", "MissingDependencyError", "RankFailure",
    "PathUsageError",
    # progress lines on a terminal
    "show_progress",
    "__version__",
]

_PUBLIC_SUBPACKAGES = ["integrations", "megatron"]


def __dir__() -> list[str]:
    # the public surface, not every internal module an import happened to load
    return sorted(set(__all__) | set(_PUBLIC_SUBPACKAGES))
