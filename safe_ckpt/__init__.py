"""safe_ckpt: offload-aware writer of Megatron-core `torch_dist` checkpoints.

Saves model weights and distributed-optimizer shards straight from wherever each
tensor lives (GPU memory, pinned or pageable host memory) through a reusable pinned
staging pool, into the layout that stock Megatron and stock PyTorch DCP load.

Data flow: plan → residence → staging → encoding → sinks → commit, coordinated by
`dist` over a CPU (gloo) group; `save` wires the stages together. `load` reads any
torch_dist checkpoint back with the contract of megatron-core's `dist_checkpointing.load`
(`safe_ckpt/load/`: source → index → plan → execute, in parallel and safely).
"""

from .errors import (
    CheckpointError,
    CommitError,
    CoordinationError,
    RankFailure,
    ReadError,
    ResidenceError,
    SourceModifiedError,
    ValidationError,
    WriteError,
)
from .options import SaveOptions
from .load import LoadOptions
from .load import load  # the function: `safe_ckpt.load` (the package stays importable as safe_ckpt.load.*)
from .results import SaveResult, SaveTimings
from .saving import SaveHandle, async_save, save
from .staging.pool import prepare as prepare_staging_pool
from .staging.pool import release as release_staging_pool
from .version import __version__


__all__ = [
    "CheckpointError", "CommitError", "CoordinationError", "LoadOptions", "RankFailure", "ReadError",
    "ResidenceError", "SaveHandle",
    "SaveOptions", "SaveResult", "SaveTimings", "SourceModifiedError", "ValidationError", "WriteError",
    "__version__", "async_save", "load", "prepare_staging_pool", "release_staging_pool", "save",
]
