"""Mirror of slime.utils.reloadable_process_group's WORLD cycle (what `sleep`/`wake_up` do to groups).

slime (THUDM/slime 624b824a) registers the accelerator WORLD at init, keeps the rendezvous store,
and at `destroy_process_groups()` destroys WORLD (which shuts down every registered subgroup,
gloo ones included) and initializes a temporary gloo WORLD on a fresh `PrefixStore` generation;
`reload_process_groups()` destroys that gloo WORLD and re-creates WORLD with the original backend,
then rebuilds every subgroup it wrapped. The mirror does the same with its gloo WORLD standing for
the accelerator one (on CPU there is no NCCL), and rebuilds Megatron's model-parallel groups
where slime re-creates its `ReloadableProcessGroup` wrappers in place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, _get_default_store


@dataclass
class _DefaultProcessGroupState:
    backend: str
    timeout: timedelta
    store: Any
    rank: int
    world_size: int
    rebuild_subgroups: Callable[[], None]
    generation: int = 0
    world_destroyed: bool = False


default_process_group_states: dict[int, _DefaultProcessGroupState] = {}


def register_default_process_group(timeout: timedelta, rebuild_subgroups: Callable[[], None]) -> None:
    """As slime's (the mirror also takes how to rebuild the subgroups it cannot wrap)."""
    default_process_group_states[os.getpid()] = _DefaultProcessGroupState(
        backend=str(dist.get_backend()), timeout=timeout, store=_get_default_store(), rank=dist.get_rank(),
        world_size=dist.get_world_size(), rebuild_subgroups=rebuild_subgroups)


def _new_default_process_group(state: _DefaultProcessGroupState, backend: str) -> None:
    state.generation += 1
    store = PrefixStore(f"slime-reloadable-world-{state.generation}-{backend}", state.store)
    dist.init_process_group(backend=backend, store=store, rank=state.rank, world_size=state.world_size,
                            timeout=state.timeout)


def destroy_process_groups() -> None:
    """Destroy WORLD (and with it every registered subgroup); a temporary gloo WORLD takes its place."""
    state = default_process_group_states.get(os.getpid())
    if state is None or state.world_destroyed:
        return
    dist.barrier()
    dist.destroy_process_group()
    _new_default_process_group(state, backend="gloo")
    state.world_destroyed = True


def reload_process_groups() -> None:
    """Destroy the temporary gloo WORLD, re-create WORLD, rebuild the subgroups."""
    state = default_process_group_states.get(os.getpid())
    if state is None or not state.world_destroyed:
        return
    dist.barrier()
    dist.destroy_process_group()
    _new_default_process_group(state, backend=state.backend)
    state.world_destroyed = False
    state.rebuild_subgroups()


class ReloadableProcessGroup:
    """slime's wrapper of a subgroup, as far as rank queries go: the process's wrappers are listed in
    `GROUPS[pid]`; `group` is the live torch group, `None` after `destroy_process_groups()` (then
    `rank()`/`size()` fail, as slime's forward to the missing group does). The mirror's own cycle
    rebuilds Megatron's groups instead; the tests wrap groups with this to see slime's case."""

    GROUPS: dict = {}

    def __init__(self, group, ranks):
        self.group = group
        self.group_info = {"ranks": list(ranks), "backend": "gloo"}
        ReloadableProcessGroup.GROUPS.setdefault(os.getpid(), []).append(self)

    def rank(self) -> int:
        return self.group.rank()

    def size(self) -> int:
        return self.group.size()

    def destroy(self) -> None:
        dist.destroy_process_group(self.group)
        self.group = None
