"""Coordination between ranks over a CPU (gloo) group: plan exchange, votes, barriers.

One job: move small picklable records between ranks and turn any rank's failure into
the same `CheckpointError` on every rank. Every rank takes part in every vote, so a
failure on one rank never leaves the others waiting in a collective; a dead or silent
peer surfaces as a `CoordinationError` once the group's timeout passes.

Every message travels in an `Envelope` naming the save it belongs to and its step in
that save (stage name and collective number). The planning exchange names the save by
what every rank knows before it (the target and how many saves this process started on
the group); later steps add rank 0's save id. A message of another save or step fails
that collective on every rank with a `CoordinationError` naming every rank's save: never
a silent pairing. Each rank's arrival key in the job's store is deleted once its next
collective completes (every peer has then left the earlier one), so the store holds at
most one key per rank and group, whatever the number of saves.

A SIGINT that arrives in the main thread while it waits in a collective is held until the
collective has completed on this rank (`Coordinator.interrupted`): an interrupt between
the collectives inside one exchange would leave the peers one collective ahead.

Must not: use NCCL or any device collective, or copy anything to a device. With
`process_group=None` it uses a gloo group over the default world, created once and
cached, which works when the default group is NCCL; without `torch.distributed`
initialized it degrades to a single rank.
"""

from __future__ import annotations

import logging
import pickle
import signal
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import compat
from ..errors import CoordinationError, RankFailure, ValidationError, combine

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


# Keyed by the group object itself, held weakly: a group that is gone takes its counts with
# it. Keyed by id(group), a new group that happened to get a dead one's address on one rank
# only would continue its counts there and start afresh on the others, and every save on it
# would then fail as cross-paired.
_counts_lock = threading.Lock()
_sequences = weakref.WeakKeyDictionary()  # group -> number of collectives issued on it by safe_ckpt
_saves = weakref.WeakKeyDictionary()  # group -> number of saves this process started on it
_last_arrival = weakref.WeakKeyDictionary()  # group -> this rank's arrival key of its latest collective on it


def _next(counts, group) -> int:
    with _counts_lock:
        counts[group] = counts.get(group, 0) + 1
        return counts[group]


@dataclass(frozen=True)
class Envelope:
    """One rank's message and where it belongs: which save, which step of it."""

    save: str  # target and this process's count of saves on the group, e.g. "/ckpt/iter_5 #3"
    save_id: str | None  # rank 0's save id, once the planning exchange has told every rank
    stage: str
    step: int  # collectives of this save before this one
    payload: object


@contextmanager
def _interrupts_held(record):
    """Hold a SIGINT (Python's default handler only) until the block ends; then ``record`` it."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    got: list = []
    signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if got:
            record(KeyboardInterrupt())


class Coordinator:
    """A rank's view of its save group; `exchange` and `vote` are collective.

    Before each collective a rank marks its arrival in the job's key-value store (a CPU
    side channel, no device involved), so when a collective breaks the survivors can name
    the ranks that never arrived: dead, or stuck before that step.
    """

    def __init__(self, group, rank: int, world_size: int, save: str = "") -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.save = save
        self.save_id: str | None = None
        self.step = 0
        self.interrupted: BaseException | None = None  # a SIGINT held during a collective
        self.lost = False  # a collective broke: no further collective of this save can pair

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

    def _hold(self, exc: BaseException) -> None:
        if self.interrupted is None:
            self.interrupted = exc

    def interrupts_held(self):
        """A block in which a SIGINT is held (then kept like one held during a collective):
        for work between two collectives that every rank must reach together."""
        return _interrupts_held(self._hold)

    def exchange(self, stage: str, obj) -> list:
        """Every rank's ``obj``, in rank order."""
        envelope = Envelope(self.save, self.save_id, stage, self.step, obj)
        self.step += 1
        if not self.distributed:
            return [obj]
        seq = _next(_sequences, self.group)
        store = self._store()
        key = self._arrival_key(seq, self.rank)
        if store is not None:
            try:
                store.set(key, "1")
            except Exception:
                store = None
        try:
            with _interrupts_held(self._hold):
                out = _all_gather_objects(envelope, self.group, self.world_size)
        except Exception as exc:  # gloo raises RuntimeError/DistBackendError subclasses
            self.lost = True
            _forget(self.group)
            absent = self._absent(store, seq) if store is not None else []
            who = (f"rank(s) {', '.join(map(str, absent))} never reached this step (dead, or stuck before it)"
                   if absent else "a rank died, stopped responding, or timed out")
            failures = [RankFailure.of(CoordinationError, r, stage, "did not reach the collective") for r in absent]
            raise CoordinationError(
                f"safe_ckpt: rank {self.rank} lost contact with its peers during {stage}: {who}: "
                f"{type(exc).__name__}: {exc}",
                failures or [RankFailure.of(CoordinationError, self.rank, stage, str(exc))],
            ) from exc
        self._forget_arrival(store, key)
        _check_same_step(out, stage)
        return [e.payload for e in out]

    def _forget_arrival(self, store, key: str) -> None:
        """Delete this rank's arrival key of its previous collective on the group (of this save
        or an earlier one): every peer took part in the collective just completed, so none can
        still be waiting in the one before it."""
        with _counts_lock:
            previous = _last_arrival.get(self.group)
            _last_arrival[self.group] = key
        if store is None or previous is None:
            return
        try:
            store.delete_key(previous)
        except Exception as exc:  # a store without deletion only grows, as before
            log.debug("cannot delete %s from the store: %s", previous, exc)

    def vote(self, stage: str, failure: RankFailure | None, report=None) -> list:
        """Raise the same error on every rank if any rank reports a failure; otherwise
        every rank's ``report`` (in rank order), exchanged in the same round."""
        ballots = self.exchange(stage, (failure, report))
        failures = [f for f, _ in ballots if f is not None]
        if failures:
            raise combine(stage, failures)
        return [r for _, r in ballots]


# Words (int64) per rank in one gather: one below ATen's parallel grain (32768 elements), so
# gloo's worker copies each rank's part out of its buffer on its own thread (see below).
GATHER_WORDS = (1 << 15) - 1


def _all_gather_objects(obj, group, world_size: int) -> list:
    """Every rank's ``obj``, in rank order: pickled, padded to the longest, gathered as int64
    words, at most `GATHER_WORDS` per rank per gather (a 1217-shard plan message, 81 KB, is one).

    Not `torch.distributed.all_gather_object`: its gather of bytes has gloo's worker thread copy
    each rank's part (one element per byte) out of a flat buffer with ATen's parallel copy, so
    that thread starts an OpenMP team as large as the host's cores, whose threads spin after
    every copy, burning CPU on every rank and holding it in the exchange wherever
    OMP_NUM_THREADS is not 1 (benchmarks/results/plan_exchange_8ranks_qwen3-4b-dp8_2026-12-04.md,
    figures in benchmarks/results/HISTORY.md). In parts of fewer elements
    than the parallel grain the copies stay on gloo's thread; the padding and the reassembly
    are done on the host without ATen, so no team starts on the caller's thread either.
    """
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sizes = torch.zeros(world_size, dtype=torch.int64)
    compat.all_gather_into_tensor(sizes, torch.tensor([len(payload)], dtype=torch.int64), group)
    lengths = sizes.tolist()
    words = -(-max(lengths) // 8)
    mine = bytearray(words * 8)
    mine[:len(payload)] = payload
    source = torch.frombuffer(mine, dtype=torch.int64)
    parts: list = [[] for _ in range(world_size)]
    for start in range(0, words, GATHER_WORDS):
        n = min(GATHER_WORDS, words - start)
        gathered = torch.empty(world_size * n, dtype=torch.int64)
        compat.all_gather_into_tensor(gathered, source[start:start + n], group)
        raw = memoryview(gathered.numpy()).cast("B")
        for r in range(world_size):
            parts[r].append(raw[r * n * 8:(r + 1) * n * 8])
    return [pickle.loads(b"".join(parts[r])[:length]) for r, length in enumerate(lengths)]


def _check_same_step(envelopes: list[Envelope], stage: str) -> None:
    """Every rank raises the same `CoordinationError` unless all envelopes name one save and step."""
    first = envelopes[0]
    if all((e.save, e.save_id, e.stage, e.step) == (first.save, first.save_id, first.stage, first.step)
           for e in envelopes):
        return
    lines = [f"  rank {r}: save of {e.save}" + (f" (id {e.save_id})" if e.save_id else "")
             + f", step {e.step} ({e.stage})" for r, e in enumerate(envelopes)]
    message = "\n".join([
        f"safe_ckpt: the ranks met in one collective from different saves or steps (during {stage}); "
        "nothing of these saves is published:", *lines,
        "  every rank must start the same saves in the same order: two saves at once on one group pair up "
        "their collectives wrongly",
    ])
    raise CoordinationError(message, [RankFailure.of(CoordinationError, r, stage, "in another save or step")
                                      for r in range(len(envelopes))])


def save_name(target: str, group) -> str:
    """The planning exchange's name of a save: the target and how many saves this process
    has started on the group (every rank counts the same saves, in the same order)."""
    return f"{target} #{_next(_saves, group)}" if group is not None else target


def coordinator(process_group=None, timeout_s: float = 600.0, target: str = "") -> Coordinator:
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValidationError("process_group was given but torch.distributed is not initialized")
        return Coordinator(None, 0, 1, target)
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
    return Coordinator(group, dist.get_rank(group), dist.get_world_size(group), save_name(target, group))
