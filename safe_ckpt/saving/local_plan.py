"""This rank's part of the planning exchange, with nothing left to raise.

One job: collect this rank's shards and objects, classify where each source lives, open
the target and (rank 0) prepare it (`Target.prepare`: claim, staging area), and put it all in the `PlanMessage`
this rank sends. Any failure on the way, a bug or an interrupt included, becomes a
`Problem` in that message, so it still reaches the exchange and every rank fails the
planning together instead of leaving its peers waiting there.
Must not: talk to other ranks or write any checkpoint data.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..errors import (
    INTERRUPTS, CheckpointError, CommitError, ResidenceError, ValidationError, WriteError, failure_from_exception,
)
from ..options import SaveOptions
from ..plan import LocalState, Problem, collect, rank_plan
from ..plan.message import PlanMessage, layout_options
from ..residence import classify as residence
from ..targets import PublishMode, Target
from ..targets.base import new_save_id

log = logging.getLogger("safe_ckpt")


@dataclass(frozen=True)
class LocalPlan:
    message: PlanMessage
    local: LocalState
    residences: list[str]
    sources: list  # the tensors to read, by ShardRef.local_index
    interrupt: BaseException | None  # a KeyboardInterrupt/SystemExit met here, raised after the exchange
    paths: list[str]  # where each of this rank's shards sits in its state dict (the message leaves them out)


def _classify(local: LocalState, options: SaveOptions):
    allow_backup = options.unmapped_policy == "cpu_backup"
    residences, sources, problems = [], [], []
    for d in local.shards:
        try:
            c = residence.classify(d.source, allow_cpu_backup=allow_backup)
        except Exception as exc:
            c = residence.Classified(residence.Residence.INVALID.value, f"cannot be classified: {exc}")
        residences.append(c.residence)
        sources.append(d.source if c.source is None else c.source)
        if c.residence == residence.Residence.CUDA_UNMAPPED.value:
            msg = f"{c.detail}; {residence.UNMAPPED_REMEDY}"
            problems.append(Problem(ResidenceError, d.key, (local.rank,), msg))
        elif c.residence == residence.Residence.INVALID.value:
            problems.append(Problem(ValidationError, d.key, (local.rank,), c.detail))
    return residences, sources, problems


def _failed(rank: int, exc: BaseException) -> Problem:
    if not isinstance(exc, INTERRUPTS):
        log.error("rank %d failed while planning", rank, exc_info=exc)
    return Problem(CheckpointError, "<planning>", (rank,), failure_from_exception(rank, "planning", exc).message)


def plan_locally(state: dict, rank: int, *, target: Target, options: SaveOptions, content_metadata,
                 mode: PublishMode) -> LocalPlan:
    empty = LocalState(rank, [], [], {}, [])
    local, residences, sources, problems = empty, [], [], []
    prepared, save_id, interrupt = None, None, None
    try:
        local = collect(state, rank, content_metadata, with_common=mode is PublishMode.WHOLE,
                        safe_globals=options.safe_globals)
        residences, sources, problems = _classify(local, options)
    except BaseException as exc:
        interrupt = exc if isinstance(exc, INTERRUPTS) else None
        local, residences, sources, problems = empty, [], [], [_failed(rank, exc)]
    try:
        opened = False
        try:
            target.open(mode)
            opened = True
        except ValidationError as exc:
            problems.append(Problem(type(exc), "<target>", (rank,), str(exc)))
        except Exception as exc:
            problems.append(Problem(WriteError, "<target>", (rank,), f"{type(exc).__name__}: {exc}"))
        if rank == 0:
            save_id = new_save_id()
            try:
                if opened:
                    prepared = target.prepare(save_id, "any" if mode is PublishMode.INTO_EXISTING else options.replace)
            except Exception as exc:
                kind = type(exc) if isinstance(exc, (WriteError, CommitError)) else CommitError  # e.g. a store not answering
                problems.append(Problem(kind, "<target>", (0,), f"{type(exc).__name__}: {exc}"))
        plan = rank_plan(local, residences, problems, with_paths=False)
    except BaseException as exc:
        interrupt = interrupt or (exc if isinstance(exc, INTERRUPTS) else None)
        local, residences, sources = empty, [], []
        plan = rank_plan(empty, [], [_failed(rank, exc)], with_paths=False)
    message = PlanMessage(plan, prepared.staging if prepared else None, save_id,
                          layout_options(options.chunk_bytes, options.io_threads))
    return LocalPlan(message, local, residences, sources, interrupt, [d.path for d in local.shards])
