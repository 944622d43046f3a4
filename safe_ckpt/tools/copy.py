"""`safe-ckpt copy SRC DST`: copy a checkpoint between a local directory and any kvstore.

One job: copy every file of a complete checkpoint so that the destination becomes visible as
a checkpoint only when it is whole; e.g. a local directory to a bucket, or a bucket to a local
directory for loading with stock Megatron. SRC may be a save root: its tracker is followed as
`verify` and `inspect` follow it (`locate`). A local DST is published as a save publishes
(`commit`: written into a hidden staging directory beside it, then one atomic rename or
exchange), so it holds the old content or exactly the copied checkpoint, never a mix. A kvstore
DST gets the data files first and `.metadata` / `metadata.json` last (`kvcommit.publish`); a
checkpoint already there stops being one (its `metadata.json` goes) before any of its files
change. ``replace``: "checkpoint" replaces only an empty DST or a complete checkpoint; "any"
replaces whatever DST holds, and DST then holds exactly the copied checkpoint (other files are
removed); a save running into DST is never replaced.
Each file travels as one value (kvstores take whole values), so memory peaks at the largest file,
and each request is bounded by ``request_timeout_s``. A source that cannot be listed or read is a
`CommitError` naming the file (one with no key, in a bucket that does not exist, or a save root
without a tracker, a `PathUsageError`); a write that fails is the sink's `WriteError`; either way
the destination never becomes a checkpoint. A local source is read through `safe_read.files`:
regular files inside it only (a FIFO, a device or a symlink leading out is refused, not read).
Must not: modify the source.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

from ..targets.directory import prepare as dir_prepare, publish as commit
from ..targets.objectstore import publish as kvcommit
from ..errors import CommitError, PathUsageError
from ..names import CONFIG_FILE, DATA_SUFFIX, METADATA_FILE, OWNER_OBJECT_PREFIX, SHARDED_BACKEND
from ..sinks.tensorstore import DEFAULT_REQUEST_TIMEOUT_S, KvDeadlines, KvTarget, StoreNotFoundError, open_sink
from ..encoding.safe_read.files import check_name, read_file
from ..targets.directory.locate import locate
from ..targets.objectstore.locate import download  # noqa: F401  (its former home)

# A local file is read whole, as one kvstore value: no cap but its size when opened.
_ANY_SIZE = 1 << 62

# progress(done_bytes, total_bytes or None when the source cannot say, note)
ProgressFn = Callable[[int, Optional[int], str], None]


@dataclass(frozen=True)
class CopyReport:
    files: int
    bytes: int
    source: str = ""  # the checkpoint copied, as the user would write it (a save root's tracker followed)
    destination: str = ""
    via_tracker: str | None = None  # the tracker's content, when SRC was a save root


class _LocalSource:
    """A local source directory, read as `copy` reads a kvstore (names, whole values), through
    `safe_read.files`; ``shown``: the directory as the user wrote it."""

    def __init__(self, directory: str, shown: str) -> None:
        self.directory = os.path.abspath(directory)
        self.root = shown.rstrip("/") + "/"

    def list(self) -> list[str]:
        return sorted(n for n in os.listdir(self.directory) if not os.path.isdir(os.path.join(self.directory, n)))

    def read(self, name: str) -> bytes:
        return read_file(self.directory, name, _ANY_SIZE)

    def total_bytes(self, names) -> int:
        return sum(os.lstat(os.path.join(self.directory, n)).st_size for n in names)


def _read(source, name: str) -> bytes:
    try:
        return source.read(name)
    except Exception as exc:
        raise CommitError(f"cannot read {source.root}{name} from the source: {type(exc).__name__}: {exc}") from exc


def _open_source(src: str, src_spec: dict | None, request_timeout_s: float):
    """The source to read and the tracker content followed to it (None: SRC was the checkpoint)."""
    target = KvTarget(src, src_spec)
    if target.is_kvstore:
        from ..targets.objectstore.locate import locate as locate_prefix

        located = locate_prefix(target, request_timeout_s)
        return open_sink(located.target, KvDeadlines(request_timeout_s)), located.via_tracker
    located = locate(src)
    return _LocalSource(located.directory, located.shown or src), located.via_tracker


def copy(src: str, dst: str, *, src_spec: dict | None = None, dst_spec: dict | None = None,
         replace: str = "checkpoint", request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
         progress: ProgressFn | None = None) -> CopyReport:
    """``src`` / ``dst``: local directories, kvstore URLs, or paths inside ``src_spec`` /
    ``dst_spec`` (see `safe_ckpt.sinks.tensorstore.resolve_target` for `s3://` at an endpoint);
    ``replace`` as the module docstring says."""
    if replace not in ("checkpoint", "any"):
        raise ValueError(f"replace={replace!r}: 'checkpoint' or 'any'")
    source, via_tracker = _open_source(src, src_spec, request_timeout_s)
    local_dst = not KvTarget(dst, dst_spec).is_kvstore
    if local_dst and isinstance(source, _LocalSource) and os.path.realpath(dst) == os.path.realpath(source.directory):
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
    total = source.total_bytes(names) if isinstance(source, _LocalSource) else None
    moved = _Moved(source, len(names), total, progress)
    if local_dst:
        _to_directory(dst, replace, moved, data + small)
        shown_dst = dst
    else:
        shown_dst = _to_store(KvTarget(dst, dst_spec), replace, moved, data, small, request_timeout_s)
    shown_src = source.root.rstrip("/") if isinstance(source, _LocalSource) else source.root
    return CopyReport(len(names), moved.done_bytes, shown_src, shown_dst, via_tracker)


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


def _to_directory(dst: str, replace: str, moved: _Moved, order: list[str]) -> None:
    """Write into a staging directory beside ``dst``, then publish it as a save is published."""
    dir_prepare.check_target(dst, replace)  # refused before anything is read, naming DST as given
    parent = os.path.dirname(dst.rstrip("/"))
    if parent and os.path.exists(parent) and not os.path.isdir(parent):
        raise PathUsageError(f"{dst}: {parent} is not a directory")
    try:
        area = dir_prepare.prepare(dst, dir_prepare.new_save_id(), replace)
    except OSError as exc:  # named by DST, not by the staging directory beside it
        raise PathUsageError(f"{dst}: cannot create a checkpoint there ({exc.strerror or exc})") from None
    try:
        for name in order:  # data first, `.metadata` last, as a save writes them
            try:
                _write_local(area.staging_dir, name, moved.read(name))
            except OSError as exc:
                raise CommitError(f"{dst}: cannot write {name} ({exc.strerror or exc}); {dst} is as it was") \
                    from None
        published = commit.publish(area)
    except BaseException:
        commit.abort(area)
        raise
    if published.interrupt is not None:
        raise published.interrupt  # the copy is in place; the interrupt still ends the command


def _write_local(directory: str, name: str, blob: bytes) -> None:
    path = check_name(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    with open(fd, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())


def _to_store(target: KvTarget, replace: str, moved: _Moved, data: list[str], small: list[str],
              request_timeout_s: float) -> str:
    sink = open_sink(target, KvDeadlines(request_timeout_s))
    kvcommit.check_target(sink, replace)
    existing = set(sink.list())
    live = kvcommit.running_saves(sink, existing) if existing else set()
    if live:  # "any" replaces files, never a save that is writing them
        raise CommitError(f"another save of {sink.root} is running (save {', '.join(sorted(live))}); "
                          "copy there once it has finished")
    previous: set[str] = set()
    if CONFIG_FILE in existing:
        try:
            previous = kvcommit.referenced_files(sink) & existing
        except kvcommit.ForeignMetadataError:
            previous = set()  # only "any" gets here with an index it may not read: every key goes anyway
        # The copied data files keep their names and may overwrite the checkpoint there: it stops
        # being one first, so no marker ever stands over a mix of two checkpoints.
        sink.delete(CONFIG_FILE)
    for name in data:
        sink.write_file(name, moved.read(name))
    kvcommit.publish(sink, {name: moved.read(name) for name in small}, set(data))
    keep = set(data) | set(small)
    doomed = set(sink.list_tree()) - keep if replace == "any" else previous - keep
    for name in sorted(doomed):
        sink.delete(name)
    return sink.root
