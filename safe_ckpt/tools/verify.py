"""`safe-ckpt verify DIR`: re-read every stored item and check it against the index and manifest.

One job: report what is wrong with a checkpoint directory: missing or truncated files,
extra files, items whose CRC-32 differs from the manifest, items whose archive
structure does not match the chunk the index promises (payload size, records), and
with ``deep`` items that `torch.load(weights_only=True)` cannot read back as the right
tensor. Works on any torch_dist checkpoint (without a manifest: structure only), and on a
plain DCP checkpoint (`torch.distributed.checkpoint.save`: no `metadata.json`, no manifest):
files, sizes and structure, with checksums reported unavailable.
`.metadata` and the common state are read through `safe_read`, so a crafted file is
reported, never run. Every file is opened through `safe_read.files`: only regular files
inside the directory are read (a FIFO, a device or a symlink leading out is an error, not a
hang), and only the ranges the index declares, each byte once (overlapping items are errors).
Must not: modify the directory, or unpickle anything except through `safe_read` and
`torch.load(weights_only=True)`; bytes items (objects) are checked by checksum only.
"""

from __future__ import annotations

import io
import os
import struct
from dataclasses import dataclass, field

from ..integrity import Hasher, Manifest, checksum_of, item_hasher
from ..names import COMMON_STATE_FILE, CONFIG_FILE, DATA_SUFFIX, MANIFEST_FILE, METADATA_FILE, is_data_file
from ..encoding.safe_read.files import describe, open_file
from ..encoding.safe_read import MAX_METADATA_BYTES, UnreadableCheckpointError, load_common_state, read_metadata
from ..units import counted

KNOWN_FILES = {METADATA_FILE, CONFIG_FILE, COMMON_STATE_FILE, MANIFEST_FILE}
# A manifest holds a row of about 100 bytes per item (the index about 160).
MAX_MANIFEST_BYTES = MAX_METADATA_BYTES
# What a tensor item (a torch.save archive of one chunk) holds besides the chunk's bytes: zip
# headers, the pickled tensor record, alignment. `deep` buffers no item larger than that allows.
ARCHIVE_OVERHEAD_BYTES = 1 << 20


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
    has_manifest: bool = False  # safe_ckpt's checksum manifest was there and readable
    plain_dcp: bool = False  # no metadata.json: a DCP checkpoint, not Megatron's torch_dist
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


def _read_item(f, offset: int, length: int, want_bytes: bool, hasher):
    """Checksum of the item, its last 64 KiB, and (if asked) all of it."""
    done, tail, whole = 0, b"", bytearray() if want_bytes else None
    for piece in f.pieces(offset, length):
        hasher.update(piece)
        done += len(piece)
        tail = (tail + piece)[-65536:]
        if whole is not None:
            whole += piece
    return hasher.value(), done, tail, whole


def _chunk_bytes(sizes, itemsize: int) -> int:
    n = itemsize
    for s in sizes:
        n = min(n * s, 1 << 64)  # past any file: capped rather than multiplied into ever larger ints
    return n


def _check_present(report: VerifyReport, directory: str, name: str, missing: str) -> bool:
    if not os.path.lexists(os.path.join(directory, name)):
        report.add("error", name, missing)
        return False
    kind = describe(directory, name)
    if not kind.regular:
        report.add("error", name, f"refused: {kind.description}, not a regular file; not read")
    return True


def _metadata_missing(directory: str) -> str:
    """Why a directory without `.metadata` fails: not a checkpoint, or a checkpoint that lost it."""
    found = [n for n in (CONFIG_FILE, COMMON_STATE_FILE, MANIFEST_FILE) if os.path.lexists(os.path.join(directory, n))]
    if any(is_data_file(n) for n in os.listdir(directory)):
        found.append(f"data files (*{DATA_SUFFIX})")
    if not (found and (found[-1].startswith("data files") or MANIFEST_FILE in found)):  # no data was written here
        return "missing: this is not a torch_dist or DCP checkpoint"
    return (f"missing, while {', '.join(found)} are here: a damaged or incomplete checkpoint (no loader can read "
            "it without its index); restore it from a copy or use an earlier checkpoint")


def verify(directory: str, *, deep: bool = False, progress=None, config_required: bool = False) -> VerifyReport:
    """``config_required``: a missing `metadata.json` is an error (on a kvstore it is the commit
    marker); otherwise the directory is checked as a plain DCP checkpoint."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    report = VerifyReport(os.path.abspath(directory), deep=deep)
    if not os.path.isdir(directory):
        report.add("error", directory, "no such directory" if not os.path.exists(directory) else "not a directory")
        return report
    if not _check_present(report, directory, METADATA_FILE, _metadata_missing(directory)):
        return report
    if os.path.lexists(os.path.join(directory, CONFIG_FILE)):
        _check_present(report, directory, CONFIG_FILE, "")  # a FIFO or a link leading out is refused
    elif config_required:
        report.add("error", CONFIG_FILE, "missing: the commit marker of a checkpoint in an object store; "
                                         "without it this is an interrupted save (`safe-ckpt gc` removes it)")
    else:
        report.plain_dcp = True
        report.add("warning", CONFIG_FILE, "missing: a plain DCP checkpoint (torch.distributed.checkpoint "
                                           f"loads it; megatron.core.dist_checkpointing.load needs {CONFIG_FILE})")
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

    manifest = _read_manifest(report, directory)
    report.has_manifest = manifest is not None
    expected_crc = {(m.relative_path, m.offset_bytes): m for m in manifest.items} if manifest else {}
    algorithm = manifest.algorithm if manifest else "crc32"
    if manifest is not None:
        try:
            Hasher(algorithm)
        except RuntimeError as exc:
            report.add("warning", MANIFEST_FILE, f"{exc}; checking structure only")
            manifest, expected_crc, algorithm = None, {}, "crc32"
            report.has_manifest = False

    chunk_bytes = {}
    for fqn, md in meta.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            for chunk in md.chunks:
                chunk_bytes[(fqn, tuple(chunk.offsets))] = (_chunk_bytes(chunk.sizes, md.properties.dtype.itemsize),
                                                            md.properties.dtype, tuple(chunk.sizes))
    by_file: dict[str, list] = {}
    for index, info in meta.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index, info))

    present = set(os.listdir(directory))
    for extra in sorted(present - set(by_file) - KNOWN_FILES):
        report.add("warning", extra, "extra file not referenced by the checkpoint")
    total = sum(info.length for entries in by_file.values() for _, info in entries)
    for path, entries in sorted(by_file.items()):
        if not os.path.lexists(os.path.join(directory, path)):
            report.add("error", path, f"missing file ({counted(len(entries), 'item')})")
            continue
        try:
            f = open_file(directory, path)
        except UnreadableCheckpointError as exc:
            report.add("error", path, f"{exc.reason}; {counted(len(entries), 'item')} in it not checked")
            continue
        with f:
            _check_file(report, f, path, entries, chunk_bytes, expected_crc, deep, algorithm,
                        lambda: progress(report.bytes_checked, total) if progress is not None else None)
    if manifest is not None:
        _check_whole_files(report, directory, manifest, algorithm)
    return report


def _check_file(report, f, path, entries, chunk_bytes, expected_crc, deep, algorithm, progressed) -> None:
    need = max(info.offset + info.length for _, info in entries)
    if f.size_bytes < need:
        report.add("error", path, f"truncated: {f.size_bytes} bytes, items need {need}")
    elif f.size_bytes > need:
        report.add("warning", path, f"{f.size_bytes - need} bytes after the last item the index names; not read")
    end = 0
    for index, info in sorted(entries, key=lambda e: (e[1].offset, e[1].length)):
        if info.offset < end:  # each byte is read once: a crafted index cannot make verify read a file over
            report.add("error", f"{path}@{info.offset}", f"item {index.fqn!r} overlaps the item before it "
                                                         f"(which ends at {end}); not read")
            continue
        end = info.offset + info.length
        _check_item(report, f, path, index, info, chunk_bytes, expected_crc, deep, algorithm)
        progressed()


def _read_manifest(report: VerifyReport, directory: str):
    if not os.path.lexists(os.path.join(directory, MANIFEST_FILE)):
        report.add("warning", MANIFEST_FILE, "no manifest: checksums unavailable; files, sizes and structure "
                                             "checked")
        return None
    try:
        with open_file(directory, MANIFEST_FILE) as f:
            return Manifest.parse(f.read_all(MAX_MANIFEST_BYTES, "manifest"))
    except UnreadableCheckpointError as exc:
        report.add("error", MANIFEST_FILE, exc.reason)
    except Exception as exc:
        report.add("error", MANIFEST_FILE, f"unreadable manifest: {exc}")
    return None


def _check_whole_files(report: VerifyReport, directory: str, manifest, algorithm: str) -> None:
    """The files the manifest checksums whole (index, config, common state), read up to their size."""
    for name, crc in manifest.whole_files.items():
        try:
            with open_file(directory, name) as f:
                if checksum_of(f.pieces(0, f.size_bytes), algorithm) != crc:
                    report.add("error", name, "checksum mismatch")
        except UnreadableCheckpointError as exc:
            missing = not os.path.lexists(exc.path)
            report.add("error", name, "missing file listed in the manifest" if missing else exc.reason)


def _check_item(report, f, path, index, info, chunk_bytes, expected_crc, deep, algorithm) -> None:
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
    # deep buffers a tensor item whole: no more than its chunk and an archive's overhead
    buffer = deep and chunk is not None and info.length <= chunk[0] + ARCHIVE_OVERHEAD_BYTES
    crc, got, tail, whole = _read_item(f, info.offset, info.length, buffer, hasher)
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
    if deep and not buffer:
        report.add("error", where, f"tensor item {index.fqn!r}: {info.length} bytes, more than its chunk "
                                   f"({chunk[0]} bytes) and an archive's overhead; not loaded")
    elif deep:
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
