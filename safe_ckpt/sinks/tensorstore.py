"""TensorStore kvstore sink: the same layout to any kvstore (`file`, `memory`, `gcs`, `s3`, ...).

One job: put whole values under keys through TensorStore's kvstore API. Writes are
asynchronous futures served by TensorStore's own threads, so they do not hold the GIL.
A kvstore writes whole values, not byte ranges, so each data file holds exactly one
item (the layout's one-item-per-file mode) and a value is assembled once in memory:
peak extra memory is bounded by writer threads x chunk_bytes. Must not: know about
tensors, or assume a rename exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import WriteError
from .base import Buffer


def _ts():
    try:
        import tensorstore
    except ImportError as exc:  # an optional dependency
        raise WriteError("saving to a kvstore needs TensorStore: pip install tensorstore") from exc
    return tensorstore


_context: list = []


def _shared_context():
    """One TensorStore context per process, so that e.g. `memory://` names the same store
    in every call (and the `file` driver shares its resources)."""
    if not _context:
        _context.append(_ts().Context())
    return _context[0]


def is_kvstore_url(path: str) -> bool:
    return isinstance(path, str) and "://" in path


@dataclass(frozen=True)
class KvLocation:
    """A kvstore and the key prefix (ending in "/") that plays the checkpoint directory."""

    kvstore: object
    prefix: str
    description: str


def open_location(checkpoint_dir: str, spec: dict | None = None) -> KvLocation:
    """``checkpoint_dir`` as a URL ("file:///ckpt/iter_0000042", "gs://bucket/ckpt/iter_1", "memory://x"),
    or a path inside the kvstore described by ``spec`` (a TensorStore kvstore spec)."""
    ts = _ts()
    try:
        if spec is not None:
            kv = ts.KvStore.open(spec, context=_shared_context()).result()
            prefix = checkpoint_dir.strip("/") + "/"
            return KvLocation(kv, prefix, f"{spec.get('driver', 'kvstore')}:{kv.path}{prefix}")
        url = checkpoint_dir.rstrip("/") + "/"
        return KvLocation(ts.KvStore.open(url, context=_shared_context()).result(), "", url)
    except WriteError:
        raise
    except Exception as exc:
        raise WriteError(f"cannot open kvstore {checkpoint_dir!r}: {exc}") from exc


class TensorStoreFile:
    def __init__(self, sink: "TensorStoreSink", relative_path: str) -> None:
        self._sink = sink
        self._key = relative_path
        self._future = None

    def write_at(self, offset_bytes: int, buffers: Sequence[Buffer]) -> None:
        if offset_bytes != 0 or self._future is not None:
            raise WriteError(f"{self._key}: a kvstore value is written whole, once (got offset {offset_bytes})")
        self._future = self._sink._write(self._key, b"".join(buffers))

    def sync(self) -> None:
        if self._future is not None:
            self._sink._wait(self._key, self._future)

    def close(self) -> None:
        self._future = None


class TensorStoreSink:
    """Implements the `Sink` protocol over a kvstore location."""

    one_item_per_file = True  # the layout must give every item its own key

    def __init__(self, location: KvLocation) -> None:
        self.location = location
        self.root = location.description

    def _key(self, relative_path: str) -> str:
        return self.location.prefix + relative_path

    def _write(self, relative_path: str, data: bytes):
        try:
            return self.location.kvstore.write(self._key(relative_path), data)
        except Exception as exc:
            raise WriteError(f"{self.root}{relative_path}: {exc}") from exc

    def _wait(self, relative_path: str, future) -> None:
        try:
            future.result()
        except Exception as exc:
            raise WriteError(f"{self.root}{relative_path}: {exc}") from exc

    def open(self, relative_path: str, size_bytes: int) -> TensorStoreFile:
        return TensorStoreFile(self, relative_path)

    def write_file(self, relative_path: str, data: bytes) -> None:
        self._wait(relative_path, self._write(relative_path, bytes(data)))

    def sync_root(self) -> None:
        """Every write was already waited for; a kvstore has no directory to sync."""

    # ---- used by the commit protocol and tools -------------------------------------------
    def list(self) -> list[str]:
        kv, prefix = self.location.kvstore, self.location.prefix
        keys = [k.decode() if isinstance(k, bytes) else k for k in kv.list().result()]
        return sorted(k[len(prefix):] for k in keys if k.startswith(prefix) and "/" not in k[len(prefix):])

    def read(self, relative_path: str) -> bytes:
        result = self.location.kvstore.read(self._key(relative_path)).result()
        if result.state != "value":
            raise FileNotFoundError(f"{self.root}{relative_path}")
        return bytes(result.value)

    def delete(self, relative_path: str) -> None:
        self.location.kvstore.delete_range(
            _ts().KvStore.KeyRange(self._key(relative_path), self._key(relative_path) + "\x00")).result()
