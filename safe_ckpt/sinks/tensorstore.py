"""TensorStore kvstore sink: the same layout to any kvstore (`file`, `memory`, `gcs`, `s3`, ...).

One job: put whole values under keys through TensorStore's kvstore API, each request
bounded in time. Writes are asynchronous futures served by TensorStore's own threads, so
they do not hold the GIL. A kvstore writes whole values, not byte ranges, so each data
file holds exactly one item (the layout's one-item-per-file mode) and a value is
assembled once in memory: peak extra memory is bounded by writer threads x chunk_bytes.

TensorStore retries a failed request (refused connection, 5xx) with backoff and no
overall bound, and a store that accepts a connection but never answers is waited for
without end; so every wait here has a deadline (`KvDeadlines`), after which the request
is cancelled and a `WriteError` names the key, the store and the remedy.

Must not: know about tensors, assume a rename exists, or read environment variables
(`resolve_target` takes the endpoint the edge read).
"""

from __future__ import annotations

import re
import socket
import time
from dataclasses import dataclass
from typing import Optional, Sequence
from urllib.parse import urlsplit

from ..errors import WriteError
from .base import Buffer

DEFAULT_REQUEST_TIMEOUT_S = 30.0
DEFAULT_REGION = "us-east-1"
PROBE_TIMEOUT_S = 2.0  # a TCP connect to the endpoint, to tell a refused connection from a silent store
# TensorStore's error text carries the raw HTTP response (S3's XML) and headers as "[name='value']" parts.
_ANNOTATION = re.compile(r"\s*\[[a-z0-9_-]+='(?:[^'\\]|\\.)*'\]", re.IGNORECASE)


class StoreNotFoundError(WriteError):
    """The bucket (or the store itself) a kvstore target names does not exist."""


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
class KvTarget:
    """Where a checkpoint (or a save root) lives: ``path`` inside the kvstore ``spec``, or,
    with no spec, ``path`` is a URL ("gs://b/x", "file:///x") or a local directory."""

    path: str
    spec: Optional[dict] = None

    @property
    def is_kvstore(self) -> bool:
        return self.spec is not None or is_kvstore_url(self.path)

    def child(self, name: str) -> "KvTarget":
        return KvTarget(self.path.rstrip("/") + "/" + name, self.spec)


ENVIRONMENT_CREDENTIALS = {"type": "environment"}


def resolve_target(target: str, spec: Optional[dict] = None, endpoint: Optional[str] = None,
                   region: Optional[str] = None, credentials: Optional[dict] = None) -> KvTarget:
    """``s3://bucket/prefix`` with an ``endpoint`` (an S3-compatible store: MinIO, Ceph RGW)
    becomes the `s3` driver's spec for that endpoint and the prefix inside it; TensorStore's
    own URL form carries no endpoint. With ``spec`` the target is already a path inside it.
    ``credentials`` (a TensorStore `aws_credentials` spec, e.g. `ENVIRONMENT_CREDENTIALS`) goes
    into every `s3` spec that names none; an `s3://` URL then becomes a spec too."""
    if spec is not None:
        spec = dict(spec)
        if credentials is not None and spec.get("driver") == "s3" and "aws_credentials" not in spec:
            spec["aws_credentials"] = dict(credentials)
        return KvTarget(target, spec)
    if (endpoint or credentials is not None) and isinstance(target, str) and target.startswith("s3://"):
        bucket, _, prefix = target[len("s3://"):].partition("/")
        if not bucket:
            raise WriteError(f"{target!r}: an s3:// URL needs a bucket (s3://BUCKET/PREFIX)")
        spec = {"driver": "s3", "bucket": bucket}
        if endpoint:
            spec.update(endpoint=endpoint, aws_region=region or DEFAULT_REGION)
        elif region:
            spec["aws_region"] = region
        if credentials is not None:
            spec["aws_credentials"] = dict(credentials)
        return KvTarget(prefix.strip("/"), spec)
    return KvTarget(target, None)


@dataclass(frozen=True)
class KvDeadlines:
    """``request_timeout_s`` bounds every request (one value, a listing, a delete), TensorStore's
    retries included; ``save_deadline`` (a `time.monotonic()` value, or None) bounds them all."""

    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    save_deadline: Optional[float] = None

    def timeout_s(self) -> float:
        if self.save_deadline is None:
            return self.request_timeout_s
        return max(0.0, min(self.request_timeout_s, self.save_deadline - time.monotonic()))


def deadlines_for(options) -> KvDeadlines:
    """The deadlines of one save, from its `SaveOptions` (the save's clock starts now)."""
    total = options.kvstore_save_timeout_s
    return KvDeadlines(options.kvstore_request_timeout_s, None if total is None else time.monotonic() + total)


def unreachable(endpoint: Optional[str], timeout_s: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """Why nothing can be asked at ``endpoint`` (an http(s) URL): a refused connection or a host
    name that does not resolve; None when a connection opens (or there is no endpoint to try)."""
    if not endpoint:
        return None
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return f"the connection to {endpoint} was refused (nothing listens there)"
    except socket.gaierror as exc:
        return f"the host of {endpoint} cannot be resolved ({exc.strerror or exc})"
    except OSError:
        return None  # slow or filtered: the request's own deadline speaks for it
    return None


def store_error(what: str, exc: BaseException) -> WriteError:
    """TensorStore's error as one line: no raw HTTP body or headers; a missing bucket named as such."""
    text = _ANNOTATION.sub("", str(exc)).strip()
    if "NoSuchBucket" in str(exc):
        return StoreNotFoundError(f"{what}: the bucket does not exist (NoSuchBucket); create it, or check "
                                  "the bucket name and the endpoint")
    return WriteError(f"{what}: {text}")


def bounded(future, timeout_s: float, what: str, endpoint: Optional[str] = None):
    """``future``'s result within ``timeout_s``, or a `WriteError` (the request is cancelled)."""
    try:
        return future.result(timeout=timeout_s)
    except TimeoutError as exc:
        future.cancel()
        why = unreachable(endpoint)
        if why is not None:
            raise WriteError(f"{what}: {why}; check the endpoint (--endpoint, AWS_ENDPOINT_URL_S3), "
                             "then retry") from exc
        if endpoint is not None:
            asked = f" at {endpoint}"
        elif what.startswith("s3://"):  # the usual cause: a local store meant, no endpoint given
            asked = (" (no endpoint: a URL takes --endpoint, AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, a kvstore "
                     "spec its own \"endpoint\"; without one the request goes to AWS S3 itself)")
        else:
            asked = ""
        raise WriteError(
            f"{what}: the store{asked} did not answer within {timeout_s:.1f} s (unreachable, or too slow); "
            "check the endpoint and credentials, or raise SaveOptions.kvstore_request_timeout_s "
            "(--request-timeout-s on the command line)"
        ) from exc
    except Exception as exc:
        raise store_error(what, exc) from exc


@dataclass(frozen=True)
class KvLocation:
    """A kvstore and the key prefix (ending in "/") that plays the checkpoint directory."""

    kvstore: object
    prefix: str
    description: str  # printed before key names: e.g. "s3://bucket/run/iter_0000042/"
    endpoint: Optional[str] = None  # an S3-compatible store's URL, for wording a failed request


def open_location(checkpoint_dir: str, spec: dict | None = None,
                  deadlines: KvDeadlines = KvDeadlines()) -> KvLocation:
    """``checkpoint_dir`` as a URL ("file:///ckpt/iter_0000042", "gs://bucket/ckpt/iter_1", "memory://x"),
    or a path inside the kvstore described by ``spec`` (a TensorStore kvstore spec)."""
    ts = _ts()
    endpoint = (spec or {}).get("endpoint")
    try:
        if spec is not None:
            kv = bounded(ts.KvStore.open(spec, context=_shared_context()), deadlines.timeout_s(),
                         f"opening kvstore {spec.get('driver')}")
            prefix = checkpoint_dir.strip("/") + "/" if checkpoint_dir.strip("/") else ""
            description = _describe(spec, f"{kv.path}{prefix}")
        else:
            url = checkpoint_dir.rstrip("/") + "/"
            kv = bounded(ts.KvStore.open(url, context=_shared_context()), deadlines.timeout_s(), f"opening {url}")
            prefix, description = "", url
    except StoreNotFoundError:
        raise
    except Exception as exc:
        raise WriteError(f"cannot open kvstore {checkpoint_dir!r}: {exc}") from exc
    why = unreachable(endpoint)
    if why is not None:  # TensorStore would retry a refused connection until the deadline: say so now
        raise WriteError(f"cannot open kvstore {description}: {why}; check the endpoint (--endpoint, "
                         "AWS_ENDPOINT_URL_S3), then retry")
    return KvLocation(kv, prefix, description, endpoint)


def shown_location(target: KvTarget) -> str:
    """``target`` as a user writes it, opening nothing: the URL itself, or a path inside a spec as
    `s3://bucket/path` (the spec's own base path included)."""
    if target.spec is None:
        return target.path
    base = str(target.spec.get("path") or "")
    base = base if not base or base.endswith("/") else base + "/"
    return _describe(target.spec, base + target.path.strip("/"))


def _describe(spec: dict, path: str) -> str:
    """A kvstore path as a user writes it: `s3://bucket/path`, `gs://bucket/path`, `file:///path`."""
    driver = spec.get("driver", "kvstore")
    scheme = {"s3": "s3", "gcs": "gs"}.get(driver)
    if scheme and spec.get("bucket"):
        return f"{scheme}://{spec['bucket']}/{path}"
    return f"{driver}://{path}"


def _successor(prefix: str) -> str:
    """The smallest key after every key that starts with ``prefix`` (keys here are ASCII)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


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
        if self._future is not None and not self._future.done():
            self._future.cancel()  # a failed save's unsynced value: do not leave it running
        self._future = None


class TensorStoreSink:
    """Implements the `Sink` protocol over a kvstore location."""

    one_item_per_file = True  # the layout must give every item its own key

    def __init__(self, location: KvLocation, deadlines: KvDeadlines = KvDeadlines()) -> None:
        self.location = location
        self.deadlines = deadlines
        self.root = location.description

    def _key(self, relative_path: str) -> str:
        return self.location.prefix + relative_path

    def _write(self, relative_path: str, data: bytes):
        try:
            return self.location.kvstore.write(self._key(relative_path), data)
        except Exception as exc:
            raise WriteError(f"{self.root}{relative_path}: {exc}") from exc

    def _wait(self, relative_path: str, future):
        return bounded(future, self.deadlines.timeout_s(), f"{self.root}{relative_path}", self.location.endpoint)

    def open(self, relative_path: str, size_bytes: int) -> TensorStoreFile:
        return TensorStoreFile(self, relative_path)

    def write_file(self, relative_path: str, data: bytes) -> None:
        self._wait(relative_path, self._write(relative_path, bytes(data)))

    def sync_root(self) -> None:
        """Every write was already waited for; a kvstore has no directory to sync."""

    # ---- used by the commit protocol and tools -------------------------------------------
    def list_tree(self) -> list[str]:
        """Every key under the prefix, relative to it (``sub/name`` for deeper keys)."""
        ts, prefix = _ts(), self.location.prefix
        kv_range = ts.KvStore.KeyRange(prefix, _successor(prefix)) if prefix else ts.KvStore.KeyRange()
        keys = self._wait("<listing>", self.location.kvstore.list(kv_range))
        keys = [k.decode() if isinstance(k, bytes) else k for k in keys]
        return sorted(k[len(prefix):] for k in keys if k.startswith(prefix))

    def list(self) -> list[str]:
        """The keys directly under the prefix (the checkpoint directory's files)."""
        return [k for k in self.list_tree() if "/" not in k]

    def read(self, relative_path: str) -> bytes:
        result = self._wait(relative_path, self.location.kvstore.read(self._key(relative_path)))
        if result.state != "value":
            raise FileNotFoundError(f"{self.root}{relative_path}")
        return bytes(result.value)

    def delete(self, relative_path: str) -> None:
        key = self._key(relative_path)
        self._wait(relative_path, self.location.kvstore.delete_range(_ts().KvStore.KeyRange(key, key + "\x00")))

    def delete_tree(self, relative_dir: str) -> None:
        """Every key under ``relative_dir/``."""
        prefix = self._key(relative_dir.strip("/") + "/")
        self._wait(relative_dir, self.location.kvstore.delete_range(_ts().KvStore.KeyRange(prefix, _successor(prefix))))

    def child(self, relative_dir: str) -> "TensorStoreSink":
        """The sink of a directory below this one (same store, same deadlines)."""
        loc = self.location
        prefix = loc.prefix + relative_dir.strip("/") + "/"
        return TensorStoreSink(KvLocation(loc.kvstore, prefix, loc.description + relative_dir.strip("/") + "/",
                                          loc.endpoint), self.deadlines)


def open_sink(target: KvTarget, deadlines: KvDeadlines = KvDeadlines()) -> TensorStoreSink:
    """The sink of a kvstore target (a URL, or a path inside a spec); a local path as `file://`."""
    path = target.path
    if target.spec is None and not is_kvstore_url(path):
        import os

        path = "file://" + os.path.abspath(path)
    return TensorStoreSink(open_location(path, target.spec, deadlines), deadlines)
