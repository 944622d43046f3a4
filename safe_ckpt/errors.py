"""The exceptions safe_ckpt raises, and the failure record that travels between ranks.

One job: a single `CheckpointError` hierarchy whose instances carry every failing
rank's reason, rebuilt identically on every rank from exchanged `RankFailure`s.
Must not: import torch or talk to other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankFailure:
    """Why one rank failed one stage of a save; small and picklable."""

    rank: int
    stage: str
    kind: str  # name of a CheckpointError subclass
    message: str
    key: str | None = None
    ranks: tuple[int, ...] = ()  # every rank involved, where more than one is

    @property
    def involved_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.ranks) | {self.rank}))

    def describe(self) -> str:
        where = f" key {self.key!r}:" if self.key else ""
        ranks = self.involved_ranks
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        return f"{who} [{self.kind}]{where} {self.message}"


class CheckpointError(Exception):
    """Base of every error raised for bad input or a failed save.

    ``failures`` lists each failing rank's reason; ``failing_ranks`` the ranks named.
    Every rank of a collective save raises an error with the same message.
    """

    def __init__(self, message: str, failures: list[RankFailure] | None = None) -> None:
        super().__init__(message)
        self.failures: list[RankFailure] = list(failures or [])

    @property
    def failing_ranks(self) -> list[int]:
        return sorted({r for f in self.failures for r in f.involved_ranks})


class ValidationError(CheckpointError, ValueError):
    """The state dict or the options are not something that can be saved."""


class ResidenceError(CheckpointError):
    """A source tensor's memory cannot be read (paused/unmapped device memory, freed, meta)."""


class WriteError(CheckpointError, OSError):
    """Bytes could not be written or made durable."""


class CommitError(CheckpointError):
    """The checkpoint could not be published."""


class CoordinationError(CheckpointError):
    """Ranks could not agree: a peer died, stopped responding, or a collective failed."""


class SourceModifiedError(CheckpointError):
    """A host tensor changed in place while an asynchronous save was still reading it."""


class StagingTimeoutError(CheckpointError):
    """A write to saved tensors (an optimizer step at a save's gate) waited longer than the
    collective timeout for the save's copies; the save was abandoned and the write went on."""


class ReadError(CheckpointError, OSError):
    """A checkpoint's bytes could not be read, or are not what its index says (missing, truncated,
    corrupt, or refused as unsafe)."""


class MissingDependencyError(CheckpointError, ImportError):
    """A package an entry point needs is not importable; the message names it and the remedy."""


class UnreadableCheckpointError(CheckpointError):
    """A checkpoint file that could not be read, or was refused because of what it is or references."""

    def __init__(self, path: str, message: str, refused_global: str | None = None) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.reason = message
        self.refused_global = refused_global


_KINDS = {
    cls.__name__: cls
    for cls in (
        CheckpointError,
        ValidationError,
        ResidenceError,
        WriteError,
        CommitError,
        CoordinationError,
        SourceModifiedError,
        StagingTimeoutError,
        ReadError,
    )
}


def kind_of(exc: BaseException) -> str:
    """The failure kind recorded for an exception raised on this rank."""
    if isinstance(exc, CheckpointError):
        # the nearest kind the other ranks can rebuild (a module's own subclass keeps its family)
        return next(c.__name__ for c in type(exc).__mro__ if c.__name__ in _KINDS)
    if isinstance(exc, OSError):
        return "WriteError"
    return "CheckpointError"


def failure_from_exception(rank: int, stage: str, exc: BaseException, key: str | None = None) -> RankFailure:
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        message = f"interrupted ({type(exc).__name__}{': ' + str(exc) if str(exc) else ''}); its writers were stopped"
    else:
        message = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    return RankFailure(rank=rank, stage=stage, kind=kind_of(exc), message=message, key=key)


def combine(stage: str, failures: list[RankFailure]) -> CheckpointError:
    """One error for all failures of a stage; identical on every rank given the same list."""
    ordered = sorted(failures, key=lambda f: (f.rank, f.kind, f.key or "", f.message))
    ranks = sorted({r for f in ordered for r in f.involved_ranks})
    kinds = {f.kind for f in ordered}
    cls = _KINDS[ordered[0].kind] if len(kinds) == 1 else _KINDS.get(ordered[0].kind, CheckpointError)
    shown = ordered[:20]
    lines = [f"safe_ckpt: save failed during {stage} on rank(s) {', '.join(map(str, ranks))}:"]
    lines += [f"  {f.describe()}" for f in shown]
    if len(ordered) > len(shown):
        lines.append(f"  ... and {len(ordered) - len(shown)} more")
    return cls("\n".join(lines), ordered)


def problems_error(stage: str, problems) -> CheckpointError:
    """`combine` for the planning stage's `Problem` records (each names its key and ranks)."""
    return combine(stage, [
        RankFailure(rank=p.ranks[0], stage=stage, kind=p.kind, message=p.message, key=p.key, ranks=tuple(p.ranks))
        for p in problems
    ])
