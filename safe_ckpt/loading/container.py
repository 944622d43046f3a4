"""Where a stored chunk's raw bytes lie inside its torch.save archive, and proof that they do.

One job: for a chunk of a given dtype and shape, say how many bytes precede its payload and
follow it in the archive torch's writer (and safe_ckpt's `encoding.torchzip`) produces, and
check, from those bytes as read, that an item really is that archive: its leading records
(the tensor's pickle, format version, alignment, byte order, the payload's local header) must
equal the expected ones byte for byte (with or without the small records' CRCs, which torch
may leave out), and its central directory must name the payload record at the expected place
and size, uncompressed. Then the payload is exactly the chunk in C order, and a reader can
put it straight into a destination. Anything else (another torch's pickle, a non-contiguous or
offset storage, big-endian data, a zip64 record) is decoded the slow, general way:
`torch.load(weights_only=True)` of the whole item, as stock DCP loads every item.
Must not: read files, or unpickle with anything but torch's weights-only unpickler.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache

import torch

from .. import compat
from ..encoding import torchzip
from ..errors import ReadError

_END = struct.Struct("<IHHHHIIH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")
_PAYLOAD_SUFFIX = b"/data/0"


@dataclass(frozen=True)
class Frame:
    """The bytes around a chunk's payload in its archive."""

    prefix: bytes  # the leading bytes safe_ckpt's writer (and torch's, CRCs left out) produces
    prefix_bytes: int
    payload_bytes: int
    suffix_bytes: int
    payload_header_at: int  # where the payload record's local header starts
    dtype: torch.dtype
    sizes: tuple

    @property
    def item_bytes(self) -> int:
        return self.prefix_bytes + self.payload_bytes + self.suffix_bytes

    def accepts(self, head: bytes) -> bool:
        """Whether ``head`` is one of the accepted leading bytes: the CRC-less ones, or (built only
        when needed: it costs as much again per shape, and safe_ckpt writes none) those with CRCs."""
        return head == self.prefix or head == _prefix_with_crcs(self.dtype, self.sizes)


@lru_cache(maxsize=4096)
def frame(dtype: torch.dtype, sizes: tuple) -> Frame | None:
    """The frame of a chunk, or None where safe_ckpt cannot lay out that dtype (then items
    are decoded with torch.load)."""
    if not compat.is_saveable_dtype(dtype):
        return None
    plain = torchzip.tensor_container(dtype, sizes)
    return Frame(plain.prefix, len(plain.prefix), plain.payload_bytes, len(plain.suffix_template),
                 plain.prefix.rfind(b"PK\x03\x04"), dtype, tuple(sizes))


@lru_cache(maxsize=4096)
def _prefix_with_crcs(dtype: torch.dtype, sizes: tuple) -> bytes | None:
    plain = torchzip.tensor_container(dtype, sizes)
    with_crcs = torchzip.build_container(torchzip.tensor_pickle(dtype, sizes), plain.payload_bytes, crc32=True)
    if len(with_crcs.prefix) != len(plain.prefix) or len(with_crcs.suffix_template) != len(plain.suffix_template):
        return None  # another layout: such an item is decoded by torch.load
    return with_crcs.prefix


def _central_directory(tail: memoryview, tail_at: int) -> tuple[int, int, int]:
    """(entries, offset, size) of the central directory, offsets relative to the item's start."""
    if tail.nbytes < _END.size:
        raise ValueError("too short for an end record")
    sig, _, _, _, entries, cd_size, cd_at, comment = _END.unpack_from(tail, tail.nbytes - _END.size)
    if sig != 0x06054B50 or comment:
        raise ValueError("no end-of-central-directory record at the end")
    if cd_at == 0xFFFFFFFF or entries == 0xFFFF or cd_size == 0xFFFFFFFF:
        loc_at = tail.nbytes - _END.size - _ZIP64_LOCATOR.size
        sig, _, end64_at, _ = _ZIP64_LOCATOR.unpack_from(tail, loc_at)
        if sig != 0x07064B50 or end64_at < tail_at:
            raise ValueError("bad zip64 locator")
        fields = _ZIP64_END.unpack_from(tail, end64_at - tail_at)
        if fields[0] != 0x06064B50:
            raise ValueError("bad zip64 end record")
        entries, cd_size, cd_at = fields[7], fields[8], fields[9]
    return entries, cd_at, cd_size


def payload_is_framed(frame_: Frame, head, tail) -> bool:
    """Whether an item whose first `prefix_bytes` are ``head`` and last `suffix_bytes` are ``tail``
    holds its payload, raw, right after ``head``."""
    if not frame_.accepts(bytes(head)):
        return False
    known = _known_suffix(frame_.dtype, frame_.sizes)
    if known is not None and _masked(tail, known[1]) == known[0]:
        return True  # byte for byte the layout checked below, but for the id and CRC fields it never reads
    return _suffix_is_framed(frame_, tail)


def _masked(tail, windows: tuple) -> bytes:
    out = bytearray(tail)
    for start, end in windows:
        out[start:end] = bytes(end - start)
    return bytes(out)


@lru_cache(maxsize=4096)
def _known_suffix(dtype: torch.dtype, sizes: tuple):
    """(suffix, windows) of safe_ckpt's own archive for a chunk, the serialization id and CRC fields
    (``windows``) zeroed: a tail equal to it outside those windows passes `_suffix_is_framed`, which
    reads none of them. None where that suffix itself would not pass."""
    f, plain = frame(dtype, sizes), torchzip.tensor_container(dtype, sizes)
    at = plain.serialization_id_at
    windows = tuple((c, c + 4) for c in plain.crc_offsets) + ((at, at + plain.serialization_id_len),) * (at >= 0)
    suffix = _masked(plain.suffix_template, windows)
    return (suffix, windows) if f is not None and _suffix_is_framed(f, suffix) else None


def _suffix_is_framed(frame_: Frame, tail) -> bool:
    tail = memoryview(tail).cast("B")
    tail_at = frame_.prefix_bytes + frame_.payload_bytes
    try:
        entries, cd_at, cd_size = _central_directory(tail, tail_at)
        pos = cd_at - tail_at
        if pos < 0 or pos + cd_size > tail.nbytes or entries > 64:
            return False
        found = False
        for _ in range(entries):
            (sig, _, _, flags, method, _, _, _, csize, usize, name_len, extra_len, comment_len, _, _, _,
             header_at) = _CENTRAL.unpack_from(tail, pos)
            if sig != 0x02014B50:
                return False
            name = bytes(tail[pos + _CENTRAL.size:pos + _CENTRAL.size + name_len])
            if name.endswith(_PAYLOAD_SUFFIX) and name.count(b"/") == 2:
                if found or method != 0 or csize != usize or usize != frame_.payload_bytes \
                        or header_at != frame_.payload_header_at or flags & 0x1:
                    return False
                found = True
            pos += _CENTRAL.size + name_len + extra_len + comment_len
        return found or frame_.payload_bytes == 0
    except (struct.error, ValueError):
        return False


def decode_chunk(data, where: str, sizes: tuple) -> torch.Tensor:
    """The tensor an item holds, through torch's weights-only loader (the general path)."""
    from .objects import decode

    tensor = decode(data, where, map_location="cpu", megatron_globals=False)  # a tensor needs none
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(sizes):
        shown = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ReadError(f"{where}: holds {shown}, not the chunk of shape {tuple(sizes)} the index names")
    return tensor
