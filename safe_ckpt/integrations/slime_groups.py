"""Process groups for a save made while slime's train actor is asleep.

One job: give the asleep save (a) a CPU gloo group that slime's group cycle cannot reach, and
(b) the ranks and sizes of the model-parallel groups as they were before the actor fell asleep.

Why (read from slime 624b824a, `slime/utils/reloadable_process_group.py`): `sleep()` destroys
WORLD with `torch.distributed.destroy_process_group()`, which shuts down *every* group registered
with torch (gloo ones included, so also the gloo group `safe_ckpt.coord.dist` caches), then starts a
temporary gloo WORLD; `reload_process_groups()` (in `wake_up()`, and alone in `update_weights()`,
which runs while an asleep save is still writing) destroys that one again. A group created with
`new_group` at any point is therefore gone within one cycle, and with slime's patched `new_group`
it is even wrapped and torn down at sleep. `DetachedGloo` is a gloo backend built directly on the
job's rendezvous store and never registered with torch: no `destroy_process_group` knows it, so
it is created once (collectively, at install) and survives every cycle; it needs no WORLD at all.

While asleep, slime's model-parallel groups are destroyed (its wrappers hold `None`; slime's
patched `dist.get_rank(group)` then silently answers for the *default* group, and `group.rank()`
raises), yet Megatron's state-dict construction asks them for ranks and sizes (sharded offsets,
replica ids, the RNG state's shard). `snapshot_groups()` records them before `sleep()` destroys
them and `pinned_ranks()` answers from the record while the asleep state dict is built.

Must not: create or use NCCL, touch the device, or leave anything patched outside `pinned_ranks`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ..coord import dist as safe_dist

log = logging.getLogger("safe_ckpt")

DETACHED_PREFIX = "safe_ckpt/slime-asleep"
SLIME_RELOADABLE_MODULE = "slime.utils.reloadable_process_group"


@dataclass(frozen=True)
class DetachedGloo:
    """A gloo backend over the job's store, unknown to torch's group registry."""

    backend: object
    rank: int
    world_size: int
    store: object  # held so the rendezvous store (rank 0's server) outlives any WORLD

    def coordinator(self, target: str = "") -> safe_dist.Coordinator:
        return safe_dist.Coordinator(self.backend, self.rank, self.world_size,
                                     safe_dist.save_name(target, self.backend))


def create_detached_gloo(timeout_s: float) -> DetachedGloo:
    """Collective over the world (every rank's rendezvous through the store); call once, awake."""
    from torch.distributed.distributed_c10d import PrefixStore, _get_default_store

    store = _get_default_store()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    backend = dist.ProcessGroupGloo(PrefixStore(DETACHED_PREFIX, store), rank, world_size,
                                    timedelta(seconds=timeout_s))
    return DetachedGloo(backend, rank, world_size, store)


def coordinator_with_detached(original):
    """Wrap `safe_ckpt.coord.dist.coordinator` so that a `DetachedGloo` passed as the save's
    process group is used as is (torch's registry, which the wrapped one asks, does not know it)."""
    if getattr(original, "_detached_aware", False):
        return original

    def coordinator(process_group=None, timeout_s: float = 600.0, target: str = ""):
        if isinstance(process_group, DetachedGloo):
            return process_group.coordinator(target)
        return original(process_group, timeout_s, target)

    coordinator._detached_aware = True
    coordinator.__wrapped__ = original
    return coordinator


def install_detached_support() -> None:
    """Idempotent: let `safe_ckpt.coord.dist` take a `DetachedGloo` as a save's process group."""
    # (safe_ckpt's exchange calls the backend itself, not through torch.distributed's functions,
    # which warn when given a bare backend: nothing here silences warnings process-wide.)
    safe_dist.coordinator = coordinator_with_detached(safe_dist.coordinator)


@dataclass(frozen=True)
class GroupView:
    rank: int
    size: int
    ranks: tuple


@dataclass(frozen=True)
class RankSnapshot:
    """Ranks and sizes of every group the actor had before sleep, keyed by the group object's id
    (the objects are held, so no id is reused while the snapshot lives)."""

    views: dict
    held: tuple
    wrapper_types: tuple

    def view(self, group):
        return None if group is None else self.views.get(id(group))


def snapshot_groups(reloadable_module: str | None = None) -> RankSnapshot:
    """Before `sleep()`: torch's registered groups and slime's reloadable wrappers, as they are."""
    from torch.distributed.distributed_c10d import _world

    views, held, types = {}, [], set()
    for group, ranks in list(_world.pg_group_ranks.items()):
        if not isinstance(group, dist.ProcessGroup):  # NON_GROUP_MEMBER: groups this rank is not in
            continue
        order = tuple(sorted(ranks, key=ranks.get))
        views[id(group)] = GroupView(group.rank(), group.size(), order)
        held.append(group)
    module = sys.modules.get(reloadable_module or SLIME_RELOADABLE_MODULE)
    wrapper_cls = getattr(module, "ReloadableProcessGroup", None)
    for wrapper in (getattr(wrapper_cls, "GROUPS", {}) or {}).get(os.getpid(), []):
        inner = getattr(wrapper, "group", None)
        if inner is None or id(inner) not in views:
            continue
        views[id(wrapper)] = views[id(inner)]
        held.append(wrapper)
        types.add(type(wrapper))
    return RankSnapshot(views, tuple(held), tuple(types))


@contextlib.contextmanager
def pinned_ranks(snapshot: RankSnapshot):
    """While building the asleep state dict: rank/size queries on the recorded groups answer from
    the snapshot (torch's `get_rank`/`get_world_size`/`get_process_group_ranks` and the wrappers'
    `rank()`/`size()`); everything else goes to the originals. Collectives are not answered: one
    on a destroyed group fails, as it should."""
    originals = {name: getattr(dist, name) for name in ("get_rank", "get_world_size", "get_process_group_ranks")}

    def answering(name, pick):
        original = originals[name]

        def query(group=None, *args, **kwargs):
            view = snapshot.view(group)
            return pick(view) if view is not None else original(group, *args, **kwargs)

        return query

    method_originals = [(cls, name, cls.__dict__.get(name)) for cls in snapshot.wrapper_types
                        for name in ("rank", "size")]
    try:
        dist.get_rank = answering("get_rank", lambda v: v.rank)
        dist.get_world_size = answering("get_world_size", lambda v: v.size)
        dist.get_process_group_ranks = answering("get_process_group_ranks", lambda v: list(v.ranks))
        for cls, name, method in method_originals:
            setattr(cls, name, _answering_method(snapshot, name, method))
        yield snapshot
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        for cls, name, method in method_originals:
            if method is None:
                delattr(cls, name)
            else:
                setattr(cls, name, method)


def _answering_method(snapshot: RankSnapshot, name: str, method):
    def answer(self):
        view = snapshot.view(self)
        if view is not None:
            return view.rank if name == "rank" else view.size
        return method(self)

    return answer
