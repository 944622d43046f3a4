"""`safe-ckpt copy SRC DST`: copy a checkpoint between a local directory and any kvstore.

One job: copy every file of a complete checkpoint so that the destination becomes visible as
a checkpoint only when it is whole; e.g. a local directory to a bucket, or a bucket to a local
directory for loading with stock Megatron. SRC may be a save root: its tracker is followed as
`verify` and `inspect` follow it (`Target.follow_tracker`). DST imports the checkpoint as its
target publishes a save (`Target.import_checkpoint`): a local DST holds the old content or
exactly the copied checkpoint, never a mix; a kvstore DST gets the data files first and
`.metadata` / `metadata.json` last, and a checkpoint already there stops being one (its
`metadata.json` goes) before any of its files change. ``replace``: "checkpoint" replaces only an empty DST or a complete checkpoint; "any"
replaces whatever DST holds, and DST then holds exactly the copied checkpoint (other files are
removed); a save running into DST is never replaced.
Each file travels as one value (kvstores take whole values), so memory peaks at the largest file,
and each request is bounded by ``request_timeout_s``. A source that cannot be listed or read is a
`CommitError` naming the file (one with no key, in a bucket that does not exist, or a save root
without a tracker, a `PathUsageError`); a write that fails is the sink's `WriteError`; either way
the destination never becomes a checkpoint. A local source is read through `safe_read.files`:
regular files inside it only (a FIFO, a device or a symlink leading out is refused, not read).
Must not: modify the source, or know which kind of target either end is (`Target.reader`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import CommitError, PathUsageError
from ..names import CONFIG_FILE, DATA_SUFFIX, METADATA_FILE, OWNER_OBJECT_PREFIX, SHARDED_BACKEND
from ..sinks.tensorstore import DEFAULT_REQUEST_TIMEOUT_S, StoreNotFoundError
from ..targets import TargetSettings, resolve

# progress(done_bytes, total_bytes or None when the source cannot say, note)
ProgressFn = Callable[[int, Optional[int], str], None]


@dataclass(frozen=True)
class CopyReport:
    files: int
    bytes: int
    source: str = ""  # the checkpoint copied, as the user would write it (a save root's tracker followed)
    destination: str = ""
    via_tracker: str | None = None  # the tracker's content, when SRC was a save root


def _read(source, name: str) -> bytes:
    try:
        return source.read(name)
    except Exception as exc:
        raise CommitError(f"cannot read {source.root}{name} from the source: {type(exc).__name__}: {exc}") from exc


def copy(src: str, dst: str, *, src_spec: dict | None = None, dst_spec: dict | None = None,
         replace: str = "checkpoint", request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
         progress: ProgressFn | None = None) -> CopyReport:
    """``src`` / ``dst``: local directories, kvstore URLs, or paths inside ``src_spec`` /
    ``dst_spec`` (see `safe_ckpt.sinks.tensorstore.resolve_target` for `s3://` at an endpoint);
    ``replace`` as the module docstring says."""
    if replace not in ("checkpoint", "any"):
        raise ValueError(f"replace={replace!r}: 'checkpoint' or 'any'")
    settings = TargetSettings(request_timeout_s=request_timeout_s)
    followed = resolve(src, spec=src_spec, settings=settings).follow_tracker()
    source = followed.target.reader()
    destination = resolve(dst, spec=dst_spec, settings=settings)
    if destination.is_same_place(followed.target):
        raise PathUsageError(f"{dst}: the destination is the checkpoint being copied")
    try:
        names = [n for n in source.list() if not n.startswith(OWNER_OBJECT_PREFIX)]
    except StoreNotFoundError as exc:
        raise PathUsageError(str(exc)) from None
    except Exception as exc:  # a kvstore's own error types: one message naming the source
        raise CommitError(f"cannot list the source {source.root}: {type(exc).__name__}: {exc}") from exc
    if not names:
        raise PathUsageError(f"{source.root}: no such checkpoint (no key under it)")
    if METADATA_FILE not in names or CONFIG_FILE not in names:
        raise CommitError(f"{source.root} is not a complete {SHARDED_BACKEND} checkpoint "
                          f"(no {METADATA_FILE} / {CONFIG_FILE})")
    data = [n for n in names if n.endswith(DATA_SUFFIX)]
    small = [n for n in names if n not in data and n != METADATA_FILE] + [METADATA_FILE]
    moved = _Moved(source, len(names), source.total_bytes(names), progress)
    shown_dst = destination.import_checkpoint(moved.read, data, small, replace)
    return CopyReport(len(names), moved.done_bytes, source.shown, shown_dst, followed.via_tracker)


class _Moved:
    """Reads each file of the source once and counts what it read (for progress and the report)."""

    def __init__(self, source, files: int, total_bytes: int | None, progress: ProgressFn | None) -> None:
        self.source, self.files, self.total_bytes, self.progress = source, files, total_bytes, progress
        self.done_bytes = self.done_files = 0

    def read(self, name: str) -> bytes:
        blob = _read(self.source, name)
        self.done_bytes += len(blob)
        self.done_files += 1
        if self.progress is not None:
            self.progress(self.done_bytes, self.total_bytes, f"{self.done_files} of {self.files} files")
        return blob
