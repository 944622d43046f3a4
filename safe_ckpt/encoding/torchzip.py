"""The torch.save-compatible container around one tensor chunk's raw bytes.

One job: given a dtype and a shape, produce the bytes that go *before* and *after*
the chunk's raw payload so that the three together are a complete archive that
`torch.load(weights_only=True)` reads back as that tensor. All sizes are known before
any payload byte exists, so a writer can place the item in a file up front and
stream the payload straight from the tensor's own memory.

The layout mirrors what torch's own writer produces (records in the same order,
64-byte aligned record data through an ``FB`` padding extra field, data descriptors,
a zip64 end record), which a golden test checks byte for byte against `torch.save`.

Must not: touch tensor data, pickle tensors through Python, know about files.

Spec (little endian, sizes in bytes; all offsets relative to the item's start):
  for each record (data.pkl, .format_version, .storage_alignment, byteorder,
  data/0, version, .data/serialization_id):
    local header (30) | name | extra "FB" + u16 pad + pad*"Z" | data | descriptor (16)
  central directory (46 + name per record) | zip64 end (56) | zip64 locator (20) |
  end of central directory (22)
The payload is the data of record ``data/0``; everything before it is the prefix,
everything after it the suffix. The suffix depends on the payload only through its
CRC-32, which is 0 unless the caller asks for it (torch's reader does not check it).
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
import secrets
import struct
import zlib
from dataclasses import dataclass

import torch

from .. import compat

ARCHIVE_NAME = "archive"
ALIGNMENT_BYTES = 64
# Items stay below the zip32 limits, so the writer never needs zip64 extra fields.
MAX_ITEM_BYTES = 0xFFFFFFFF - (1 << 20)

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_DESCRIPTOR = struct.Struct("<IIII")
_CENTRAL_HEADER = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
_FLAGS_UTF8 = 0x0800
_FLAGS_DESCRIPTOR = 0x0008  # a data descriptor follows the data (torch omits it for empty records)
_PAYLOAD_RECORD = "data/0"


class _StorageRef:
    """Stands in for the tensor's storage while pickling: only its identity matters."""

    __slots__ = ("persistent_id",)

    def __init__(self, persistent_id: tuple) -> None:
        self.persistent_id = persistent_id


class _TensorRef:
    """Pickles exactly as torch pickles a contiguous tensor that owns its storage."""

    __slots__ = ("rebuild_args", "rebuild_fn")

    def __init__(self, rebuild_fn, rebuild_args: tuple) -> None:
        self.rebuild_fn = rebuild_fn
        self.rebuild_args = rebuild_args

    def __reduce_ex__(self, protocol):
        return (self.rebuild_fn, self.rebuild_args)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            return obj.persistent_id
        return None


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(strides))


def tensor_pickle(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """The ``data.pkl`` record torch writes for a contiguous tensor of this dtype/shape."""
    numel = 1
    for dim in shape:
        numel *= dim
    itemsize = compat.dtype_itemsize(dtype)
    hooks = collections.OrderedDict()
    storage_type = compat.legacy_storage_type(dtype)
    if storage_type is not None:
        storage = _StorageRef(("storage", storage_type, "0", "cpu", numel))
        args = (storage, 0, tuple(shape), contiguous_strides(shape), False, hooks)
        ref = _TensorRef(torch._utils._rebuild_tensor_v2, args)
    else:
        # Dtypes without a typed storage class go through an untyped (byte) storage.
        storage = _StorageRef(("storage", torch.storage.UntypedStorage, "0", "cpu", numel * itemsize))
        args = (storage, 0, tuple(shape), contiguous_strides(shape), False, hooks, dtype)
        ref = _TensorRef(torch._utils._rebuild_tensor_v3, args)
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(ref)
    return buf.getvalue()


def new_serialization_id() -> str:
    return f"{secrets.randbits(64):020d}{secrets.randbits(64):020d}"


@dataclass(frozen=True)
class Container:
    """An item's bytes around its payload.

    ``prefix`` goes first, then ``payload_bytes`` raw bytes, then ``suffix(crc32)``.
    """

    prefix: bytes
    payload_bytes: int
    suffix_template: bytes
    crc_offsets: tuple[int, ...]
    serialization_id_at: int = -1  # where the id lies in the suffix; -1: not replaceable (CRCs cover it)
    serialization_id_len: int = 0

    def with_serialization_id(self, serialization_id: str) -> "Container":
        """The same container with another id of the same length."""
        sid = serialization_id.encode()
        at = self.serialization_id_at
        if at < 0 or len(sid) != self.serialization_id_len:
            raise ValueError("this container's serialization id cannot be replaced in place")
        suffix = bytearray(self.suffix_template)
        suffix[at:at + len(sid)] = sid
        return Container(self.prefix, self.payload_bytes, bytes(suffix), self.crc_offsets, at, len(sid))

    @property
    def total_bytes(self) -> int:
        return len(self.prefix) + self.payload_bytes + len(self.suffix_template)

    def suffix(self, payload_crc32: int = 0) -> bytes:
        if payload_crc32 == 0:
            return self.suffix_template
        out = bytearray(self.suffix_template)
        for at in self.crc_offsets:
            struct.pack_into("<I", out, at, payload_crc32)
        return bytes(out)


@dataclass(frozen=True)
class _Record:
    name: str
    header_offset: int
    crc32: int
    size: int

    @property
    def flags(self) -> int:
        return _FLAGS_UTF8 | (_FLAGS_DESCRIPTOR if self.size else 0)


class _ZipBuilder:
    """Lays records out the way torch's writer does; the payload record is left open."""

    def __init__(self, crc32: bool) -> None:
        self.crc32 = crc32
        self.cursor = 0
        self.records: list[_Record] = []

    def _header(self, name: str, size: int) -> bytes:
        flags = _FLAGS_UTF8 | (_FLAGS_DESCRIPTOR if size else 0)
        full = f"{ARCHIVE_NAME}/{name}".encode()
        start = self.cursor + _LOCAL_HEADER.size + len(full) + 4
        pad = (-start) % ALIGNMENT_BYTES
        extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        header = _LOCAL_HEADER.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(full), len(extra))
        return header + full + extra

    def record(self, name: str, data: bytes) -> bytes:
        offset = self.cursor
        head = self._header(name, len(data))
        crc = zlib.crc32(data) if self.crc32 else 0
        out = head + data + self._descriptor(crc, len(data))
        self.records.append(_Record(name, offset, crc, len(data)))
        self.cursor += len(out)
        return out

    def open_payload(self, size: int) -> bytes:
        offset = self.cursor
        head = self._header(_PAYLOAD_RECORD, size)
        self.records.append(_Record(_PAYLOAD_RECORD, offset, 0, size))
        self.cursor += len(head) + size
        return head

    @staticmethod
    def _descriptor(crc: int, size: int) -> bytes:
        return _DESCRIPTOR.pack(0x08074B50, crc, size, size) if size else b""

    def close_payload(self) -> bytes:
        out = self._descriptor(0, self.records[-1].size)
        self.cursor += len(out)
        return out

    def central_directory(self) -> tuple[bytes, list[int]]:
        out = bytearray()
        payload_crc_at = []
        cd_start = self.cursor
        for rec in self.records:
            full = f"{ARCHIVE_NAME}/{rec.name}".encode()
            if rec.name == _PAYLOAD_RECORD and rec.size:
                payload_crc_at.append(len(out) + 16)
            out += _CENTRAL_HEADER.pack(
                0x02014B50, 0, 0, rec.flags, 0, 0, 0, rec.crc32, rec.size, rec.size,
                len(full), 0, 0, 0, 0, 0, rec.header_offset,
            )
            out += full
        cd_size = len(out)
        n = len(self.records)
        zip64_end_at = cd_start + cd_size
        out += _ZIP64_END.pack(0x06064B50, 44, 0x031E, 45, 0, 0, n, n, cd_size, cd_start)
        out += _ZIP64_LOCATOR.pack(0x07064B50, 0, zip64_end_at, 1)
        out += _END.pack(0x06054B50, 0, 0, n, n, cd_size, cd_start, 0)
        return bytes(out), payload_crc_at


def build_container(
    pickle_bytes: bytes, payload_bytes: int, *, crc32: bool = False, serialization_id: str | None = None
) -> Container:
    """Container for a payload whose pickle record is ``pickle_bytes``."""
    zb = _ZipBuilder(crc32)
    prefix = bytearray()
    prefix += zb.record("data.pkl", pickle_bytes)
    prefix += zb.record(".format_version", b"1")
    prefix += zb.record(".storage_alignment", str(ALIGNMENT_BYTES).encode())
    prefix += zb.record("byteorder", b"little")
    prefix += zb.open_payload(payload_bytes)
    prefix_len = len(prefix)
    suffix = bytearray()
    suffix += zb.close_payload()
    crc_in_suffix = [4] if payload_bytes else []  # the CRC field of the payload's descriptor
    suffix += zb.record("version", b"3\n")
    sid = (serialization_id or new_serialization_id()).encode()
    sid_record = zb.record(".data/serialization_id", sid)
    sid_at = -1 if crc32 else len(suffix) + len(sid_record) - _DESCRIPTOR.size - len(sid)
    suffix += sid_record
    cd, payload_crc_in_cd = zb.central_directory()
    cd_at = len(suffix)
    suffix += cd
    total = prefix_len + payload_bytes + len(suffix)
    if total > MAX_ITEM_BYTES:
        raise ValueError(f"item of {total} bytes exceeds the container limit of {MAX_ITEM_BYTES}")
    crc_offsets = (*crc_in_suffix, *(cd_at + at for at in payload_crc_in_cd))
    return Container(bytes(prefix), payload_bytes, bytes(suffix), crc_offsets, sid_at, len(sid))


def tensor_container(
    dtype: torch.dtype, shape: tuple[int, ...], *, crc32: bool = False, serialization_id: str | None = None
) -> Container:
    """The container of one chunk; without CRCs built once per (dtype, shape) and given a
    fresh id per call (building one took ~22 us, for every item of a save, twice)."""
    sid = serialization_id or new_serialization_id()
    if not crc32 and len(sid) == _SID_LEN:
        return _template(dtype, tuple(shape)).with_serialization_id(sid)
    return _build_tensor_container(dtype, shape, crc32, sid)


_SID_LEN = 40  # what torch's writer uses, and `new_serialization_id`


# Per process, ~1.5 KB each: a rank's distinct chunk shapes stay cached
# from the layout to the write and from one save to the next.
@functools.lru_cache(maxsize=4096)
def _template(dtype: torch.dtype, shape: tuple[int, ...]) -> Container:
    return _build_tensor_container(dtype, shape, False, "0" * _SID_LEN)


def _build_tensor_container(dtype: torch.dtype, shape: tuple[int, ...], crc32: bool,
                            serialization_id: str) -> Container:
    numel = 1
    for dim in shape:
        numel *= dim
    return build_container(
        tensor_pickle(dtype, shape),
        numel * compat.dtype_itemsize(dtype),
        crc32=crc32,
        serialization_id=serialization_id,
    )


def payload_crc32(buffers, seed: int = 0) -> int:
    crc = seed
    for buf in buffers:
        crc = zlib.crc32(buf, crc)
    return crc
