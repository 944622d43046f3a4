"""What each rank sends in the planning exchange, and the check that every rank planned
with the same layout options.

One job: carry a rank's plan, rank 0's staging directory and save id, and the options every
rank's share of the global plan depends on (a rank with another ``chunk_bytes`` or
``io_threads`` would cut chunks that do not match `.metadata`).
Must not: touch tensors, devices or files.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ValidationError
from .records import Problem, RankPlan


@dataclass(frozen=True)
class PlanMessage:
    plan: RankPlan
    staging_dir: str | None
    save_id: str | None
    layout_options: dict


def layout_options(chunk_bytes: int, io_threads: int) -> dict:
    return {"chunk_bytes": chunk_bytes, "io_threads": io_threads}


def option_mismatches(messages: list[PlanMessage]) -> list[Problem]:
    """One problem per layout option on which some rank differs from rank 0."""
    problems = []
    reference = messages[0].layout_options
    for name, value in reference.items():
        odd = tuple(r for r, m in enumerate(messages) if m.layout_options.get(name) != value)
        if odd:
            seen = sorted({messages[r].layout_options.get(name) for r in odd})
            problems.append(Problem(ValidationError, f"<SaveOptions.{name}>", odd,
                                    f"SaveOptions.{name} must be equal on every rank: rank 0 has {value}, "
                                    f"rank(s) {', '.join(map(str, odd))} have {', '.join(map(str, seen))}"))
    return problems
