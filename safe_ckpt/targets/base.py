"""The `Target` interface: the life of one save's destination, and the save root around it.

One job: name the calls the orchestrator (`saving/`), retention and the tools make on a
checkpoint's destination, in the order they make them, and the small frozen types that travel
between them. The implementations are `directory.target.DirectoryTarget` (a staging directory
renamed into place) and `objectstore.target.ObjectStoreTarget` (tagged keys, `metadata.json`
last as the commit marker); `registry` picks one for a path. Must not: know about tensors,
plans or ranks beyond "did this rank prepare".
"""

from __future__ import annotations

import abc
import contextlib
import enum
import uuid
from dataclasses import dataclass, field
from typing import Callable, Mapping

from ..interrupts import Deferred
from ..names import SAVE_ID_CHARS, TRACKER_FILE
from ..sinks.tensorstore import KvTarget


def new_save_id() -> str:
    """A fresh save's id: every name the save leaves on its target carries it."""
    return uuid.uuid4().hex[:SAVE_ID_CHARS]


class PublishMode(enum.Enum):
    WHOLE = "whole"  # the save owns the checkpoint: staged, then published at once
    INTO_EXISTING = "into"  # Megatron's own save owns the directory; the save adds its items and `.metadata`


@dataclass(frozen=True)
class TargetSettings:
    """A target's knobs, from `SaveOptions` at the edge of a save (`of`) or from CLI flags."""

    fsync: bool = True
    request_timeout_s: float = 30.0
    save_timeout_s: float | None = None

    @staticmethod
    def of(options) -> "TargetSettings":
        return TargetSettings(options.fsync, options.kvstore_request_timeout_s, options.kvstore_save_timeout_s)


@dataclass(frozen=True)
class Prepared:
    """Rank 0's `prepare` result, as every rank learns it from the planning exchange."""

    save_id: str
    staging: str | None  # where every rank writes (a directory); None where the target writes in place


@dataclass(frozen=True)
class LayoutRules:
    """How the target wants the data files cut (`encoding.layout.lay_out`)."""

    one_item_per_file: bool = False
    file_tag: str = ""


@dataclass(frozen=True)
class WriterSink:
    sink: object  # what the writers write into (`sinks.base.Sink`, with `SaveOptions.sink_factory` applied)
    whole_writes: bool  # each item reaches the sink in one write_at (stores that take whole values)


@dataclass(frozen=True)
class WholeFiles:
    """Rank 0's files written in one piece (`common.pt`), split by who writes them."""

    to_writers: Mapping[str, bytes] = field(default_factory=dict)  # by the writers, into the staging area
    to_publish: Mapping[str, bytes] = field(default_factory=dict)  # by `publish`, in the target's commit order


@dataclass(frozen=True)
class Survey:
    """The iterations of a save root, by kind (retention's view)."""

    complete: Mapping[int, str] = field(default_factory=dict)  # iteration -> what `remove_checkpoint` takes
    incomplete: Mapping[int, str] = field(default_factory=dict)
    links: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Followed:
    """The checkpoint a tool argument means (`Target.follow_tracker`): the argument itself, or
    the checkpoint its save root's tracker names; ``shown``: as the user would write it."""

    target: "Target"
    shown: str
    via_tracker: str | None = None  # the tracker's content, when the argument was a save root

    def note(self) -> str | None:
        if self.via_tracker is None:
            return None
        return f"followed {TRACKER_FILE} ({self.via_tracker}) to {self.shown}"


@dataclass(frozen=True)
class LocalView:
    """A local directory holding a checkpoint's files, for the read-only tools (`Target.local_view`)."""

    directory: str
    copied: bool = False  # a temporary copy: reports name the checkpoint as `Followed.shown`, not this directory
    config_required: bool = False  # `metadata.json` is this target's commit marker: missing, it is an error


class Target(abc.ABC):
    """Where one checkpoint (or a save root) lives, and the life of a save into it.

    One save (S: every rank, 0: rank 0 only); a failure anywhere is noted and the next vote
    fails every rank, whose `abort()` then runs:
      S  open(mode)                         planning, before any collective
      0  prepare(save_id, replace)          planning: replace check, claim, staging area
         -- planning exchange: rank 0's `Prepared` reaches every rank in its PlanMessage --
      S  layout_rules(save_id)              after the exchange
      S  route_whole_files(files)           after the exchange (rank 0 has whole files)
      S  writer_sink(prepared, factory)     before the writers start
      S  check_staged(prepared, planned)    after the writers joined, before the write vote
      0  integrity_into(mode)               while building the small files
      0  publish(prepared, sink, small, data_files, mode, interrupts)   after the write vote
      S  abort()                            on any failure after open; idempotent; only the
                                            rank that prepared removes anything
    A Target is per save and keeps rank 0's claim between prepare and publish or abort (the
    claim never travels). A save root (retention, the tracker, gc) uses the second group.
    """

    name: str  # printable and normalized (an absolute path, a URL): SaveResult.checkpoint_dir
    location: KvTarget  # the path as given (inside ``location.spec`` where given): what `tools.copy` takes
    settings: TargetSettings

    # --- one save -------------------------------------------------------------------------
    @abc.abstractmethod
    def open(self, mode: PublishMode) -> None:
        """Every rank, planning. A `ValidationError` where this target cannot take ``mode``;
        any other error where it cannot be reached."""

    @abc.abstractmethod
    def prepare(self, save_id: str, replace: str) -> Prepared:
        """Rank 0, after `open`: refuse what ``replace`` forbids or another running save, then
        claim the target and make the staging area."""

    def layout_rules(self, save_id: str) -> LayoutRules:
        return LayoutRules()

    def route_whole_files(self, files: Mapping[str, bytes]) -> WholeFiles:
        return WholeFiles(to_writers=dict(files))

    @abc.abstractmethod
    def writer_sink(self, prepared: Prepared, factory: Callable | None) -> WriterSink:
        """Every rank. ``factory`` is `SaveOptions.sink_factory` (see its contract in options.py)."""

    def check_staged(self, prepared: Prepared, planned_bytes: Mapping[str, int]) -> None:
        """Every rank: the staging area is still this save's and holds each planned file whole."""

    def integrity_into(self, mode: PublishMode) -> str | None:
        """The existing directory whose other files Megatron's integrity manifest must cover too."""
        return None

    @abc.abstractmethod
    def publish(self, prepared: Prepared, sink, small: Mapping[str, bytes], data_files: frozenset,
                mode: PublishMode, interrupts: Deferred) -> None:
        """Rank 0 after the write vote: the small files through ``sink`` (the writers' sink, so a
        sink_factory sees them) in this target's order, then make the checkpoint visible. An
        interrupt arriving meanwhile is kept in ``interrupts``, raised once the save is over."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Undo what this rank prepared (nothing where it prepared nothing); idempotent."""

    # --- a save root: tracker, retention, gc ----------------------------------------------
    @abc.abstractmethod
    def write_tracker(self, value: str) -> None:
        """Point the save root's `latest_checkpointed_iteration.txt` at ``value``, atomically."""

    def bounded(self) -> contextlib.AbstractContextManager["Target"]:
        """This save root with one deadline for a sequence of calls (retention's survey and removals)."""
        return contextlib.nullcontext(self)

    @abc.abstractmethod
    def survey(self) -> Survey:
        """The iterations under this save root (only complete ones are retention's candidates)."""

    @abc.abstractmethod
    def remove_checkpoint(self, name: str) -> None:
        """Remove one checkpoint of `survey()` so that no crash leaves a half-removed one under its name."""

    def shown(self, name: str) -> str:
        """One of `survey()`'s names as a log line shows it."""
        return name

    @abc.abstractmethod
    def collect_leftovers(self, dry_run: bool, force: bool = False) -> list[str]:
        """`safe-ckpt gc`, on a save root (no other call first): what interrupted saves left here
        and one level below, removed (or only listed, ``dry_run``). ``force``: no save is running,
        so nothing is left alone as a running save's. A missing save root is a `PathUsageError`."""

    # --- the read-only tools: verify, inspect -------------------------------------------------
    @abc.abstractmethod
    def follow_tracker(self) -> Followed:
        """First call of a tool given a checkpoint or a save root: this checkpoint, or the one the
        save root's tracker names. A `PathUsageError` where there is nothing, or a save root
        without a tracker (naming its checkpoints); a `TrackerError` where the tracker names
        nothing there."""

    @abc.abstractmethod
    def local_view(self, purpose: str, progress=None) -> contextlib.AbstractContextManager[LocalView]:
        """After `follow_tracker`, on its checkpoint: a local directory holding its files, valid
        inside the ``with`` (a copy is fetched first, with ``progress``, and removed after).
        ``purpose`` names the tool (in a temporary copy's name)."""

    def require_exists(self, what: str) -> None:
        """Before `follow_tracker` where a missing target is the user's mistake: a
        `PathUsageError` naming it as ``what`` (a store learns it only when it lists)."""

    def can_hold_a_checkpoint(self) -> bool:
        """False where a checkpoint cannot be written here at all (a local path that is a file)."""
        return True

    # --- copy: one target read, another importing -------------------------------------------
    @abc.abstractmethod
    def reader(self):
        """After `follow_tracker`, on its checkpoint: its files as `copy` reads them: ``root`` (a
        prefix for messages), ``shown`` (the checkpoint as the report names it), ``list()``,
        ``read(name)`` (one whole file), ``total_bytes(names)`` (None where it cannot say cheaply)."""

    def is_same_place(self, other: "Target") -> bool:
        """Whether importing here would overwrite ``other`` (checked before anything is read)."""
        return False

    @abc.abstractmethod
    def import_checkpoint(self, read: Callable[[str], bytes], data: list[str], small: list[str],
                          replace: str) -> str:
        """`copy`'s last call, on the destination: the files ``read`` gives (``data``, then
        ``small`` with `.metadata` last) become a checkpoint here only once all are in, as a
        save's `publish` makes one visible; ``replace`` as `prepare` takes it. Returns the
        destination as the report names it."""

    @abc.abstractmethod
    def parent(self) -> "Target | None":
        """The save root this checkpoint lies in (None where there is none)."""

    @abc.abstractmethod
    def read_tracker(self) -> str | None:
        """On a save root: its tracker's content, stripped; None where it has none."""

    @abc.abstractmethod
    def place_key(self) -> str:
        """Equal for two spellings of one location (a symbolic link and its target, a prefix with
        and without its trailing slash); touches nothing, so it cannot fail on an absent place."""
