"""Where a checkpoint's bytes come from: a TensorStore kvstore (S3, GCS, `file://`, `memory://`).

One job: the `source.Source` interface over a kvstore prefix, with ranged reads (each request
bounded in time, TensorStore's own retries included, as the save bounds its writes). Opening
follows the save's endpoint rules (`sinks.tensorstore.open_location`: a URL, or a path inside a
spec). A value shorter than an item needs fails with `ReadError` naming the key.
Must not: interpret bytes, or read environment variables.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import ReadError
from ..sinks.tensorstore import KvDeadlines, KvTarget, is_kvstore_url, open_location


class KvSource:
    """`Source` over the keys below a kvstore prefix."""

    def __init__(self, target: KvTarget, request_timeout_s: float) -> None:
        path = target.path
        if target.spec is None and not is_kvstore_url(path):
            raise ReadError(f"{path}: not a kvstore URL and no kvstore spec given")
        self._deadlines = KvDeadlines(request_timeout_s)
        try:
            self._location = open_location(path, target.spec, self._deadlines)
        except Exception as exc:
            raise ReadError(f"cannot open {path}: {exc}") from None
        self.root = self._location.description

    def describe(self, name: str) -> str:
        return self.root + name

    def _read(self, name: str, byte_range: slice | None):
        future = self._location.kvstore.read(self._location.prefix + name, byte_range=byte_range)
        timeout_s = self._deadlines.timeout_s()
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            future.cancel()
            raise ReadError(f"{self.describe(name)}: the store did not answer within {timeout_s:.1f} s (unreachable, "
                            f"or too slow); check the endpoint and credentials, or raise "
                            f"LoadOptions.kvstore_request_timeout_s") from None
        except Exception as exc:
            raise ReadError(f"{self.describe(name)}: read failed: {exc}") from None

    def size_bytes(self, name: str) -> int | None:
        return None  # a ranged read past the end is reported there

    def exists(self, name: str) -> bool:
        return self._read(name, slice(0, 0)).state == "value"

    def read_whole(self, name: str, limit_bytes: int) -> bytes:
        result = self._read(name, None)
        if result.state != "value":
            raise FileNotFoundError(self.describe(name))
        data = bytes(result.value)
        if len(data) > limit_bytes:
            raise ReadError(f"{self.describe(name)}: refused: {len(data)} bytes, more than the {limit_bytes} such a "
                            f"file is read up to")
        return data

    def readv(self, name: str, offset_bytes: int, buffers: Sequence[memoryview]) -> None:
        wanted = sum(b.nbytes for b in buffers)
        if not wanted:
            return
        result = self._read(name, slice(offset_bytes, offset_bytes + wanted))
        if result.state != "value":
            raise ReadError(f"{self.describe(name)}: missing (the checkpoint's index names it)")
        data = memoryview(result.value)
        if data.nbytes != wanted:
            raise ReadError(f"{self.describe(name)}: ends early: {wanted} bytes wanted at offset {offset_bytes}, "
                            f"only {data.nbytes} there (truncated?)")
        at = 0
        for b in buffers:
            b[:] = data[at:at + b.nbytes]
            at += b.nbytes

    def close(self) -> None:
        """Nothing held: TensorStore's context keeps its connections."""
