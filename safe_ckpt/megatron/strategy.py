"""A megatron-core `torch_dist` save strategy that writes through safe_ckpt.

One job: let code that calls `megatron.core.dist_checkpointing.save(...,
sharded_strategy=...)` itself keep doing so while the sharded items and `.metadata`
are written by safe_ckpt (Megatron still writes the common state and `metadata.json`).
It subclasses `TorchDistSaveShardedStrategy` (backend `torch_dist`, version 1) because
megatron-core >= 0.17 replaces any other strategy; on <= 0.16 `install_as_default()`
also makes it the registered default.

Megatron's own `save()` still runs its preprocessing around the strategy: pass
`validate_access_integrity=False` to skip its object collectives over the default group
(safe_ckpt validates over gloo anyway). For a save with no NCCL at all, use
`safe_ckpt.save` or `safe_ckpt.megatron.save_checkpoint`.

Must not: change the layout Megatron expects.
"""

from __future__ import annotations

from .. import compat
from .. import saving as save_mod
from ..names import SHARDED_BACKEND, SHARDED_BACKEND_VERSION
from ..options import SaveOptions, checked as checked_save_options
from .loading import optimizer_classes


class SafeTorchDistSaveStrategy(compat.torch_dist_save_strategy_base()):
    """`TorchDistSaveShardedStrategy` whose `save` / `async_save` write with safe_ckpt."""

    def __init__(self, backend: str = SHARDED_BACKEND, version: int = SHARDED_BACKEND_VERSION, *, options: SaveOptions | None = None,
                 process_group=None, **kwargs) -> None:
        super().__init__(backend, version, **kwargs)
        # the optimizer classes `--optimizer-cpu-offload` keeps in its param groups, as the load side admits them
        self.options = checked_save_options(options, SaveOptions(safe_globals=optimizer_classes()) if options is None else None)
        self.process_group = process_group

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        save_mod.start(sharded_state_dict, checkpoint_dir, process_group=self.process_group,
                       options=self.options, sharded_only=True).finish()

    def async_save(self, sharded_state_dict, checkpoint_dir, *args, **kwargs):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

        job = save_mod.start(sharded_state_dict, checkpoint_dir, process_group=self.process_group,
                             options=self.options, sharded_only=True, asynchronous=True)
        handle = job.in_background()
        # Nothing for Megatron's async worker to run: safe_ckpt writes in its own threads;
        # finalisation waits for it (and raises its error).
        return AsyncRequest(None, (), [handle.wait])


def install_as_default(options: SaveOptions | None = None) -> bool:
    """Register the strategy as megatron-core's default torch_dist save strategy.

    Only megatron-core <= 0.16 has a registry; returns False on later versions (pass the
    strategy to `dist_checkpointing.save` there).
    """
    return compat.register_default_save_strategy(SafeTorchDistSaveStrategy(options=options))
