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


_sequence_lock = threading.Lock()
_sequences: dict = {}  # group -> number of collectives issued on it by safe_ckpt


def _next_sequence(group) -> int:
    with _sequence_lock:
        _sequences[id(group)] = _sequences.get(id(group), 0) + 1
        return _sequences[id(group)]


class Coordinator:
    """A rank's view of its save group; `exchange` and `vote` are collective.

    Before each collective a rank marks its arrival in the job's key-value store (a CPU
    side channel, no device involved), so when a collective breaks the survivors can name
    the ranks that never arrived: dead, or stuck before that step.
    """

    def __init__(self, group, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size

    def _store(self):
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:
            return None

    def _arrival_key(self, seq: int, rank: int) -> str:
        return f"safe_ckpt/{getattr(self.group, 'group_name', 'group')}/{seq}/{rank}"

    def _absent(self, store, seq: int) -> list[int]:
        absent = []
        for r in range(self.world_size):
            try:
                if not store.check([self._arrival_key(seq, r)]):
                    absent.append(r)
            except Exception:
                return []
        return absent

    @property
    def distributed(self) -> bool:
        return self.group is not None and self.world_size > 1

    def exchange(self, stage: str, obj) -> list:
        """Every rank's ``obj``, in rank order."""
        if not self.distributed:
            return [obj]
        out: list = [None] * self.world_size
        seq = _next_sequence(self.group)
        store = self._store()
        if store is not None:
            try:
                store.set(self._arrival_key(seq, self.rank), "1")
            except Exception:
                store = None
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as exc:  # gloo raises RuntimeError/DistBackendError subclasses
            _forget(self.group)
            absent = self._absent(store, seq) if store is not None else []
            who = (f"rank(s) {', '.join(map(str, absent))} never reached this step (dead, or stuck before it)"
                   if absent else "a rank died, stopped responding, or timed out")
            failures = [RankFailure(r, stage, "CoordinationError", "did not reach the collective") for r in absent]
            raise CoordinationError(
                f"safe_ckpt: rank {self.rank} lost contact with its peers during {stage}: {who}: "
                f"{type(exc).__name__}: {exc}",
                failures or [RankFailure(self.rank, stage, "CoordinationError", str(exc))],
            ) from exc
        return out

    def vote(self, stage: str, failure: RankFailure | None, report=None) -> list:
        """Raise the same error on every rank if any rank reports a failure; otherwise
        every rank's ``report`` (in rank order), exchanged in the same round."""
        ballots = self.exchange(stage, (failure, report))
        failures = [f for f, _ in ballots if f is not None]
        if failures:
            raise combine(stage, failures)
        return [r for _, r in ballots]


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
