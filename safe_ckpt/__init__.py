"""safe_ckpt: offload-aware writer of Megatron-core `torch_dist` checkpoints.

Saves model weights and distributed-optimizer shards straight from wherever each
tensor lives (GPU memory, pinned or pageable host memory) through a reusable pinned
staging pool, into the layout that stock Megatron and stock PyTorch DCP load.

Data flow: plan → residence → staging → encoding → sinks → commit, coordinated by
`dist` over a CPU (gloo) group; `save` wires the stages together.
"""

from .errors import (
    CheckpointError,
    CommitError,
    CoordinationError,
    MissingDependencyError,
    RankFailure,
    ResidenceError,
    SourceModifiedError,
    ValidationError,
    WriteError,
)
from .options import SaveOptions
from .results import SaveResult, SaveTimings
from .saving import SaveHandle, async_save, save
from .staging.pool import prepare as prepare_staging_pool
from .staging.pool import release as release_staging_pool
from .version import __version__


__all__ = [
    "CheckpointError", "CommitError", "CoordinationError", "MissingDependencyError", "RankFailure", "ResidenceError", "SaveHandle",
    "SaveOptions", "SaveResult", "SaveTimings", "SourceModifiedError", "ValidationError", "WriteError",
    "__version__", "async_save", "prepare_staging_pool", "release_staging_pool", "save",
]
