"""`safe-ckpt copy SRC DST`: copy a checkpoint between a local directory and any kvstore.

One job: copy every file of a complete checkpoint (data files first, `.metadata` and
`metadata.json` last, with the kvstore commit order) so that the destination becomes
visible as a checkpoint only when it is whole; e.g. a local directory to a bucket, or a
bucket to a local directory for loading with stock Megatron. Each file travels as one
value (kvstores take whole values), so memory peaks at the largest file, and each
request is bounded by ``request_timeout_s`` (see `SaveOptions.kvstore_request_timeout_s`).
A source that cannot be listed or read is a `CommitError` naming the file (one with no key, or
in a bucket that does not exist, a `PathUsageError`); a write that fails is the sink's
`WriteError`; either way the destination never becomes a checkpoint.
A local source is read through `checkpoint_files`: regular files inside it only (a FIFO,
a device or a symlink leading out is refused, not read).
Must not: modify the source.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .. import kvcommit
from ..errors import CommitError
from ..sinks.tensorstore import DEFAULT_REQUEST_TIMEOUT_S, KvDeadlines, KvTarget, StoreNotFoundError, open_sink
from .checkpoint_files import check_name, read_file
from .locate import PathUsageError

# A local file is read whole, as one kvstore value: no cap but its size when opened.
_ANY_SIZE = 1 << 62


@dataclass(frozen=True)
class CopyReport:
    files: int
    bytes: int


class _LocalSource:
    """A local source directory, read as `copy` reads a kvstore (names, whole values), through
    `checkpoint_files`."""

    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(directory)
        self.root = self.directory + "/"

    def list(self) -> list[str]:
        return sorted(n for n in os.listdir(self.directory) if not os.path.isdir(os.path.join(self.directory, n)))

    def read(self, name: str) -> bytes:
        return read_file(self.directory, name, _ANY_SIZE)


def _read(source, name: str) -> bytes:
    try:
        return source.read(name)
    except Exception as exc:
        raise CommitError(f"cannot read {source.root}{name} from the source: {type(exc).__name__}: {exc}") from exc


def copy(src: str, dst: str, *, src_spec: dict | None = None, dst_spec: dict | None = None,
         replace: str = "checkpoint", request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> CopyReport:
    """``src`` / ``dst``: local directories, kvstore URLs, or paths inside ``src_spec`` /
    ``dst_spec`` (see `safe_ckpt.sinks.tensorstore.resolve_target` for `s3://` at an endpoint)."""
    deadlines = KvDeadlines(request_timeout_s)
    source_target = KvTarget(src, src_spec)
    source = open_sink(source_target, deadlines) if source_target.is_kvstore else _LocalSource(src)
    target = open_sink(KvTarget(dst, dst_spec), deadlines)
    try:
        names = source.list()
    except StoreNotFoundError as exc:
        raise PathUsageError(str(exc)) from None
    except Exception as exc:  # a kvstore's own error types: one message naming the source
        raise CommitError(f"cannot list the source {source.root}: {type(exc).__name__}: {exc}") from exc
    if not names:
        raise PathUsageError(f"{source.root}: no such checkpoint (no key under it)")
    if kvcommit.METADATA_FILE not in names or kvcommit.CONFIG_FILE not in names:
        raise CommitError(f"{source.root} is not a complete torch_dist checkpoint (no .metadata / metadata.json)")
    kvcommit.check_target(target, replace)
    data = [n for n in names if n.endswith(".distcp")]
    total = 0
    for name in data:
        blob = _read(source, name)
        target.write_file(name, blob)
        total += len(blob)
    small = {n: _read(source, n) for n in names if n not in data and not n.startswith(kvcommit.OWNER_PREFIX)}
    total += sum(len(b) for b in small.values())
    kvcommit.publish(target, small, set(data))
    return CopyReport(len(names), total)


def download(src: KvTarget, local_dir: str, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> list[str]:
    """Every file directly under ``src`` into ``local_dir`` as it is (complete or not: for
    `verify` and `inspect`, which report what is missing); returns the names. A key that is not
    a plain file name ('..', 'a/b') is refused; a name already in ``local_dir`` is not overwritten."""
    source = open_sink(src, KvDeadlines(request_timeout_s))
    os.makedirs(local_dir, exist_ok=True)
    names = source.list()
    for name in names:
        path = check_name(local_dir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        with open(fd, "wb") as f:
            f.write(source.read(name))
    return names
