"""The ranks' agreement on one global plan, from every rank's plan message.

One job: turn the exchanged plan messages into the global plan, or into the problems that
every rank raises. The messages hold no shard paths (at 1217 shards per rank they were two
thirds of each message, and every rank receives every rank's; nothing reads them unless the
plan is refused); a refused plan asks every rank for its paths once more, so that the errors
name where each shard sits in each rank's state dict. Every rank reaches the same verdict from
the same messages, so all of them take part in that second exchange or none does; a rank whose
own check fails where the others' did not (out of memory, say) still takes part in it, so that
its peers fail at once instead of waiting for it.

Call order: `local_plan.plan_locally` (each rank) → the planning exchange → `agree`, with
the caller holding SIGINT for the whole of `agree` (an interrupted rank must not leave its
peers waiting in the second exchange).
Must not: touch tensors, devices or files. Its own failures become problems (a failed second
exchange, or a bug in wording the errors, is kept as the problems' cause); only what the
caller's ``exchange`` raises other than `CheckpointError` passes through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..errors import CheckpointError
from . import GlobalPlan, Problem, build_global_plan, process_memo, validate
from .message import PlanMessage, option_mismatches

# The second exchange's stage, as a lost peer's error names it.
PLACES_STAGE = "planning (naming where the refused shards sit)"


@dataclass(frozen=True)
class Agreement:
    """The global plan, or the problems every rank raises (``plan`` None)."""

    plan: GlobalPlan | None
    problems: list[Problem] = field(default_factory=list)
    cause: BaseException | None = None  # what the problems do not say: a lost second exchange, a bug


def agree(messages: list[PlanMessage], own_paths: list[str], chunk_bytes: int, files_per_rank: int,
          exchange: Callable[[str, object], list]) -> Agreement:
    """``exchange(stage, obj)``: the save's collective that returns every rank's ``obj``."""
    try:
        mismatches = option_mismatches(messages)
        if mismatches:  # the plans were cut with different options: validating them would mislead
            return Agreement(None, mismatches)
        plans = [m.plan for m in messages]
        result = build_global_plan(plans, chunk_bytes, files_per_rank, remember=process_memo)
    except Exception as exc:
        failed = [Problem(CheckpointError, "<planning>", tuple(range(len(messages))),
                          f"internal error: {type(exc).__name__}: {exc}")]
        # Alike on every rank, the peers are here too; on this rank alone, they are in the second
        # exchange (which then fails to word their errors) or in the writing vote (which then
        # fails at once on a step mismatch) rather than waiting for this rank until they time out.
        try:
            exchange(PLACES_STAGE, None)
        except CheckpointError as lost:
            return Agreement(None, failed, lost)
        return Agreement(None, failed, exc)
    if isinstance(result, GlobalPlan):
        return Agreement(result)
    try:
        paths = exchange(PLACES_STAGE, own_paths)
    except CheckpointError as exc:  # a peer lost here: the refusal stands, worded without paths
        return Agreement(None, result, exc)
    try:
        return Agreement(None, validate([plan.with_paths(p) for plan, p in zip(plans, paths, strict=True)]) or result)
    except Exception as exc:  # paths that do not fit their plans: keep the verdict, unworded, and say why
        return Agreement(None, result, exc)
