"""The ranks' agreement on one global plan, from every rank's plan message.

One job: turn the exchanged plan messages into the global plan, or into the problems that
every rank raises, the same on every rank. The messages hold no shard paths (at 1217
shards per rank they were two thirds of the bytes every rank receives eight times over,
and nothing reads them unless the plan is refused); a refused plan asks every rank for its
paths once more, so that the errors name where each shard sits in each rank's state dict.
Every rank reaches the same verdict from the same messages, so either all ranks take part
in that second exchange or none does.

Call order: `local_plan.plan_locally` (each rank) → the planning exchange → `agree`, with
the caller holding SIGINT for the whole of `agree` (an interrupted rank must not leave its
peers waiting in the second exchange).
Must not: touch tensors, devices or files, or raise: every failure is a `Problem` (or, for a
failed second exchange, the pathless problems and the failure as their cause).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .errors import CheckpointError
from .plan import GlobalPlan, Problem, build_global_plan, validate
from .plan.message import PlanMessage, option_mismatches

# The second exchange's stage, as a lost peer's error names it.
PLACES_STAGE = "planning (naming where the refused shards sit)"


@dataclass(frozen=True)
class Agreement:
    """The global plan, or the problems every rank raises (``plan`` None)."""

    plan: GlobalPlan | None
    problems: list[Problem] = field(default_factory=list)
    cause: BaseException | None = None  # why the problems name no paths: the second exchange failed


def agree(messages: list[PlanMessage], own_paths: list[str], chunk_bytes: int, files_per_rank: int,
          exchange: Callable[[str, object], list]) -> Agreement:
    """``exchange(stage, obj)``: the save's collective that returns every rank's ``obj``."""
    try:
        mismatches = option_mismatches(messages)
        if mismatches:  # the plans were cut with different options: validating them would mislead
            return Agreement(None, mismatches)
        plans = [m.plan for m in messages]
        result = build_global_plan(plans, chunk_bytes, files_per_rank)
    except Exception as exc:  # the same inputs on every rank: the same failure everywhere
        return Agreement(None, [Problem("CheckpointError", "<planning>", tuple(range(len(messages))),
                                        f"internal error: {type(exc).__name__}: {exc}")])
    if isinstance(result, GlobalPlan):
        return Agreement(result)
    try:
        paths = exchange(PLACES_STAGE, own_paths)
    except CheckpointError as exc:  # a peer lost here: the refusal stands, worded without paths
        return Agreement(None, result, exc)
    try:
        return Agreement(None, validate([plan.with_paths(p) for plan, p in zip(plans, paths)]) or result)
    except Exception:  # paths that do not fit their plan (a bug): keep the verdict, unworded
        return Agreement(None, result)
