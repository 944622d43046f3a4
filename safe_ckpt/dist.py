"""Coordination between ranks over a CPU (gloo) group: plan exchange, votes, barriers.

One job: move small picklable records between ranks and turn any rank's failure into
the same `CheckpointError` on every rank. Every rank takes part in every vote, so a
failure on one rank never leaves the others waiting in a collective; a dead or silent
peer surfaces as a `CoordinationError` once the group's timeout passes.

Must not: use NCCL or any device collective, or copy anything to a device. With
`process_group=None` it uses a gloo group over the default world, created once and
cached, which works when the default group is NCCL; without `torch.distributed`
initialized it degrades to a single rank.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

import torch.distributed as dist

from .errors import CoordinationError, RankFailure, ValidationError, combine

log = logging.getLogger(__name__)

_groups_lock = threading.Lock()
_groups: dict = {}


def _default_group_id():
    return id(dist.distributed_c10d._get_default_group())


def _cached_gloo_group(timeout_s: float):
    key = (_default_group_id(), dist.get_world_size(), timeout_s)
    with _groups_lock:
        group = _groups.get(key)
        if group is None:
            # Collective over the whole world: every rank's first save creates it together.
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            _groups[key] = group
        return group


def _forget(group) -> None:
    with _groups_lock:
        for key in [k for k, g in _groups.items() if g is group]:
            del _groups[key]


class Coordinator:
    """A rank's view of its save group; `exchange` and `vote` are collective."""

    def __init__(self, group, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size

    @property
    def distributed(self) -> bool:
        return self.group is not None and self.world_size > 1

    def exchange(self, stage: str, obj) -> list:
        """Every rank's ``obj``, in rank order."""
        if not self.distributed:
            return [obj]
        out: list = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as exc:  # gloo raises RuntimeError/DistBackendError subclasses
            _forget(self.group)
            raise CoordinationError(
                f"safe_ckpt: rank {self.rank} lost contact with its peers during {stage} "
                f"(a rank died, stopped responding, or timed out): {type(exc).__name__}: {exc}",
                [RankFailure(self.rank, stage, "CoordinationError", str(exc))],
            ) from exc
        return out

    def vote(self, stage: str, failure: RankFailure | None) -> None:
        """Raise the same error on every rank if any rank reports a failure."""
        failures = [f for f in self.exchange(stage, failure) if f is not None]
        if failures:
            raise combine(stage, failures)


def coordinator(process_group=None, timeout_s: float = 600.0) -> Coordinator:
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValidationError("process_group was given but torch.distributed is not initialized")
        return Coordinator(None, 0, 1)
    if process_group is None:
        group = _cached_gloo_group(timeout_s)
    else:
        backend = dist.get_backend(process_group)
        if backend != "gloo":
            raise ValidationError(
                f"process_group uses the {backend!r} backend; safe_ckpt coordinates over a CPU group only. "
                "Pass a gloo group (torch.distributed.new_group(backend='gloo')) or None for the world"
            )
        group = process_group
    return Coordinator(group, dist.get_rank(group), dist.get_world_size(group))
