"""`safe-ckpt verify DIR`: re-read every stored item and check it against the index and manifest.

One job: report what is wrong with a checkpoint directory: missing or truncated files,
extra files, items whose CRC-32 differs from the manifest, items whose archive
structure does not match the chunk the index promises (payload size, records), and
with ``deep`` items that `torch.load(weights_only=True)` cannot read back as the right
tensor. Works on any torch_dist checkpoint (without a manifest: structure only).
`.metadata` and the common state are read through `safe_load`, so a crafted file is
reported, never run.
Must not: modify the directory, or unpickle anything except through `safe_load` and
`torch.load(weights_only=True)`; bytes items (objects) are checked by checksum only.
"""

from __future__ import annotations

import io
import os
import struct
from dataclasses import dataclass, field

from ..integrity import MANIFEST_FILE, Hasher, Manifest, checksum_of, item_hasher
from .safe_load import UnreadableCheckpointError, load_common_state, read_metadata

KNOWN_FILES = {".metadata", "metadata.json", "common.pt", MANIFEST_FILE}
_PIECE_BYTES = 64 << 20


@dataclass(frozen=True)
class Finding:
    severity: str  # "error" or "warning"
    path: str
    message: str


@dataclass
class VerifyReport:
    directory: str
    items_checked: int = 0
    bytes_checked: int = 0
    checksummed_items: int = 0
    deep: bool = False
    deep_loaded_items: int = 0  # tensor items torch.load(weights_only=True) read back (deep only)
    deep_loaded_bytes: int = 0  # tensor data bytes those items held
    object_items: int = 0  # bytes items: checked by checksum, never unpickled
    common_state_loaded: bool = False
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    def add(self, severity: str, path: str, message: str) -> None:
        self.findings.append(Finding(severity, path, message))


def _payload_record_size(tail: bytes, item_length: int) -> int | None:
    """Size of the `*/data/0` record, from the central directory at the end of an item."""
    end = tail.rfind(b"PK\x05\x06")
    if end < 0 or end + 22 > len(tail):
        return None
    cd_size, cd_offset = struct.unpack_from("<II", tail, end + 12)
    pos = cd_offset - (item_length - len(tail))  # the directory's place inside `tail`
    if pos < 0 or pos + cd_size > len(tail):
        return None
    while pos + 46 <= len(tail) and tail[pos:pos + 4] == b"PK\x01\x02":
        usize, = struct.unpack_from("<I", tail, pos + 24)
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", tail, pos + 28)
        if tail[pos + 46:pos + 46 + name_len].endswith(b"/data/0"):
            return usize
        pos += 46 + name_len + extra_len + comment_len
    return None


def _read_item(fd: int, offset: int, length: int, want_bytes: bool, hasher):
    """Checksum of the item, its last 64 KiB, and (if asked) all of it."""
    done, tail, whole = 0, b"", bytearray() if want_bytes else None
    while done < length:
        piece = os.pread(fd, min(_PIECE_BYTES, length - done), offset + done)
        if not piece:
            break
        hasher.update(piece)
        done += len(piece)
        tail = (tail + piece)[-65536:]
        if whole is not None:
            whole += piece
    return hasher.value(), done, tail, whole


def verify(directory: str, *, deep: bool = False, progress=None) -> VerifyReport:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    report = VerifyReport(os.path.abspath(directory), deep=deep)
    if not os.path.isdir(directory):
        report.add("error", directory, "no such directory" if not os.path.exists(directory) else "not a directory")
        return report
    for name in (".metadata", "metadata.json"):
        if not os.path.isfile(os.path.join(directory, name)):
            report.add("error", name, "missing: this is not a complete torch_dist checkpoint")
    if not report.ok:
        return report
    try:
        meta = read_metadata(directory)
    except UnreadableCheckpointError as exc:
        report.add("error", os.path.basename(exc.path), exc.reason)
        return report
    try:
        report.common_state_loaded = load_common_state(directory, meta) is not None
    except UnreadableCheckpointError as exc:
        report.add("error", os.path.relpath(exc.path, directory), exc.reason)

    manifest = None
    manifest_path = os.path.join(directory, MANIFEST_FILE)
    if os.path.isfile(manifest_path):
        try:
            manifest = Manifest.parse(open(manifest_path, "rb").read())
        except Exception as exc:
            report.add("error", MANIFEST_FILE, f"unreadable manifest: {exc}")
    else:
        report.add("warning", MANIFEST_FILE, "no manifest: checksums cannot be checked, only structure")
    expected_crc = {(m.relative_path, m.offset_bytes): m for m in manifest.items} if manifest else {}
    algorithm = manifest.algorithm if manifest else "crc32"
    if manifest is not None:
        try:
            Hasher(algorithm)
        except RuntimeError as exc:
            report.add("warning", MANIFEST_FILE, f"{exc}; checking structure only")
            manifest, expected_crc, algorithm = None, {}, "crc32"

    chunk_bytes = {}
    for fqn, md in meta.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            for chunk in md.chunks:
                n = 1
                for s in chunk.sizes:
                    n *= s
                chunk_bytes[(fqn, tuple(chunk.offsets))] = (n * md.properties.dtype.itemsize, md.properties.dtype,
                                                            tuple(chunk.sizes))
    by_file: dict[str, list] = {}
    for index, info in meta.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index, info))

    present = set(os.listdir(directory))
    for extra in sorted(present - set(by_file) - KNOWN_FILES):
        report.add("warning", extra, "extra file not referenced by the checkpoint")
    total = sum(info.length for entries in by_file.values() for _, info in entries)
    for path, entries in sorted(by_file.items()):
        full = os.path.join(directory, path)
        if path not in present:
            report.add("error", path, f"missing file ({len(entries)} items)")
            continue
        size = os.path.getsize(full)
        need = max(info.offset + info.length for _, info in entries)
        if size < need:
            report.add("error", path, f"truncated: {size} bytes, items need {need}")
        fd = os.open(full, os.O_RDONLY)
        try:
            for index, info in sorted(entries, key=lambda e: e[1].offset):
                _check_item(report, fd, path, index, info, chunk_bytes, expected_crc, deep, algorithm)
                if progress is not None:
                    progress(report.bytes_checked, total)
        finally:
            os.close(fd)
    if manifest is not None:
        for name, crc in manifest.whole_files.items():
            full = os.path.join(directory, name)
            if not os.path.isfile(full):
                report.add("error", name, "missing file listed in the manifest")
            elif checksum_of([open(full, "rb").read()], algorithm) != crc:
                report.add("error", name, "checksum mismatch")
    return report


def _check_item(report, fd, path, index, info, chunk_bytes, expected_crc, deep, algorithm) -> None:
    where = f"{path}@{info.offset}"
    chunk = chunk_bytes.get((index.fqn, tuple(index.offset) if index.offset is not None else None))
    expected = expected_crc.get((path, info.offset))
    if expected is not None and expected.length_bytes != info.length:
        report.add("error", where, f"item {index.fqn!r}: the manifest says {expected.length_bytes} bytes, "
                                   f"the index {info.length}")
        expected = None
    try:
        hasher = item_hasher(expected, algorithm) if expected is not None else Hasher(algorithm)
    except (RuntimeError, ValueError) as exc:
        report.add("error", where, f"item {index.fqn!r}: cannot check its checksum: {exc}")
        expected, hasher = None, Hasher(algorithm)
    crc, got, tail, whole = _read_item(fd, info.offset, info.length, deep and chunk is not None, hasher)
    report.items_checked += 1
    report.bytes_checked += got
    if got < info.length:
        report.add("error", where, f"item {index.fqn!r} cut short: {got} of {info.length} bytes")
        return
    if expected is not None:
        report.checksummed_items += 1
        if expected.checksum != crc:
            report.add("error", where, f"item {index.fqn!r}: checksum mismatch (corrupted bytes)")
            return
    if chunk is None:
        report.object_items += 1
        return  # a bytes item (ShardedObject): its checksum is all there is to check
    payload = _payload_record_size(tail, info.length)
    if payload != chunk[0]:
        report.add("error", where, f"tensor item {index.fqn!r}: archive holds {payload} payload bytes, "
                                   f"the index promises {chunk[0]}")
        return
    if deep:
        import torch

        try:
            t = torch.load(io.BytesIO(bytes(whole)), weights_only=True)
            if not isinstance(t, torch.Tensor) or t.dtype != chunk[1] or tuple(t.shape) != chunk[2]:
                got_as = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                report.add("error", where, f"{index.fqn!r} loads as {got_as}, expected {chunk[1]} {chunk[2]}")
            else:
                report.deep_loaded_items += 1
                report.deep_loaded_bytes += t.numel() * t.element_size()
        except Exception as exc:
            report.add("error", where, f"{index.fqn!r} does not load: {type(exc).__name__}: {exc}")
