"""The exceptions safe_ckpt raises, and the failure record that travels between ranks.

One job: a single `CheckpointError` hierarchy whose instances carry every failing
rank's reason, rebuilt identically on every rank from exchanged `RankFailure`s. Errors travel
as types: a failure records the `lineage` of its class (class names, most specific first, as
plain strings on the wire), and every rank raises the most specific of those classes it knows
(`error_class`); ``kind`` is the nearest public family, shown as ``[Kind]`` in messages.
Must not: import torch or talk to other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# What stops a save from outside rather than failing it: every handler that must not swallow one
# (a vote, a deferred publish) tests this tuple.
INTERRUPTS = (KeyboardInterrupt, SystemExit)


@dataclass(frozen=True)
class RankFailure:
    """Why one rank failed one stage of a save; small and picklable."""

    rank: int
    stage: str
    kind: str  # name of a CheckpointError subclass
    message: str
    key: str | None = None
    ranks: tuple[int, ...] = ()  # every rank involved, where more than one is
    lineage: tuple[str, ...] = field(default=(), compare=False)  # the error's classes, most specific first

    @classmethod
    def of(cls, error: type, rank: int, stage: str, message: str, key: str | None = None,
           ranks: tuple[int, ...] = ()) -> "RankFailure":
        return cls(rank, stage, shown_kind(error), message, key, ranks, lineage(error))

    @property
    def involved_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.ranks) | {self.rank}))

    def describe(self) -> str:
        where = f" key {self.key!r}:" if self.key else ""
        ranks = self.involved_ranks
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        return f"{who} [{self.kind}]{where} {self.message}"


_REGISTRY: dict[str, type] = {}  # class name -> class, every CheckpointError subclass imported on this rank


class CheckpointError(Exception):
    """Base of every error raised for bad input or a failed save.

    ``failures`` lists each failing rank's reason; ``failing_ranks`` the ranks named.
    Every rank of a collective save raises an error with the same message.
    """

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        _REGISTRY.setdefault(cls.__name__, cls)

    def __init__(self, message: str, failures: list[RankFailure] | None = None) -> None:
        super().__init__(message)
        self.failures: list[RankFailure] = list(failures or [])

    @property
    def failing_ranks(self) -> list[int]:
        return sorted({r for f in self.failures for r in f.involved_ranks})


class ValidationError(CheckpointError, ValueError):
    """The state dict or the options are not something that can be saved."""


class UnloadableStateError(ValidationError):
    """The common state or a ShardedObject holds a class the loaders' weights-only unpickler refuses."""


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


class PathUsageError(CheckpointError, ValueError):
    """The path given to a tool is not something it can work on (missing, not a directory)."""


class TrackerError(ValueError):
    """A save root's tracker file is unreadable or names a checkpoint that is not there."""


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


_REGISTRY[CheckpointError.__name__] = CheckpointError


def lineage(error) -> tuple[str, ...]:
    """The CheckpointError classes of an exception or class, most specific first (names)."""
    cls = error if isinstance(error, type) else type(error)
    return tuple(c.__name__ for c in cls.__mro__ if isinstance(c, type) and issubclass(c, CheckpointError))


def shown_kind(error) -> str:
    """The nearest public family of an error (what messages show as ``[Kind]``)."""
    return next(name for name in lineage(error) if name in _KINDS)


def error_class(names: tuple[str, ...], default: type = CheckpointError) -> type:
    """The most specific class of ``names`` this rank knows that takes `CheckpointError`'s
    arguments (a class with its own constructor is replaced by its nearest such base)."""
    for name in names:
        cls = _REGISTRY.get(name)
        if cls is not None and cls.__init__ is CheckpointError.__init__:
            return cls
    return default


def kind_of(exc: BaseException) -> str:
    """The failure kind recorded for an exception raised on this rank."""
    if isinstance(exc, CheckpointError):
        return shown_kind(exc)  # the nearest kind the other ranks can rebuild (a subclass keeps its family)
    if isinstance(exc, OSError):
        return WriteError.__name__
    return CheckpointError.__name__


def error_of(exc: BaseException) -> type:
    """The CheckpointError class an exception raised on this rank is reported as."""
    if isinstance(exc, CheckpointError):
        return type(exc)
    return WriteError if isinstance(exc, OSError) else CheckpointError


def failure_from_exception(rank: int, stage: str, exc: BaseException, key: str | None = None) -> RankFailure:
    if isinstance(exc, INTERRUPTS):
        message = f"interrupted ({type(exc).__name__}{': ' + str(exc) if str(exc) else ''}); its writers were stopped"
    else:
        message = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    return RankFailure.of(error_of(exc), rank, stage, message, key)


def combine(stage: str, failures: list[RankFailure]) -> CheckpointError:
    """One error for all failures of a stage; identical on every rank given the same list."""
    ordered = sorted(failures, key=lambda f: (f.rank, f.kind, f.key or "", f.message))
    ranks = sorted({r for f in ordered for r in f.involved_ranks})
    kinds = {f.kind for f in ordered}
    family = _KINDS[ordered[0].kind] if len(kinds) == 1 else _KINDS.get(ordered[0].kind, CheckpointError)
    # the most specific class every failure shares, where one is known here (else the family)
    shared = [n for n in ordered[0].lineage if all(n in f.lineage for f in ordered)] if len(kinds) == 1 else []
    cls = error_class(tuple(shared), family)
    cls = cls if issubclass(cls, family) else family
    shown = ordered[:20]
    lines = [f"safe_ckpt: save failed during {stage} on rank(s) {', '.join(map(str, ranks))}:"]
    lines += [f"  {f.describe()}" for f in shown]
    if len(ordered) > len(shown):
        lines.append(f"  ... and {len(ordered) - len(shown)} more")
    return cls("\n".join(lines), ordered)


def problems_error(stage: str, problems) -> CheckpointError:
    """`combine` for the planning stage's `Problem` records (each names its key and ranks)."""
    return combine(stage, [
        RankFailure(rank=p.ranks[0], stage=stage, kind=p.kind, message=p.message, key=p.key, ranks=tuple(p.ranks),
                    lineage=p.lineage or (p.kind,))
        for p in problems
    ])
