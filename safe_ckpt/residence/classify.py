"""Where each source tensor's bytes live right now, checked before anything reads them.

One job: classify a tensor as device memory that is mapped, device memory that is
paused (virtual address reserved, no physical pages: what torch_memory_saver's
`pause()` leaves), pinned host, pageable host, or invalid (meta, freed). Device
pointers are checked with the CUDA driver (`cuPointerGetAttribute(MAPPED)`) because
any copy out of a paused range kills the process instead of raising.

A tensor's owner may keep its bytes elsewhere while its device memory is paused (slime keeps
the trained weights in its own host copy, in a region torch_memory_saver keeps no backup of):
code that knows such a copy registers a lookup for the duration of a save (`host_copies`), and
`classify(..., allow_cpu_backup=True)` asks it first.

Must not: copy, read or synchronize anything. (The optional CPU-backup and host-copy lookups
only return views of memory their owners keep.)
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from enum import Enum

import torch

from .. import cuda_driver

log = logging.getLogger(__name__)


class Residence(str, Enum):
    CUDA = "cuda"
    CUDA_UNMAPPED = "cuda_unmapped"
    OFFLOAD_BACKUP = "offload_backup"
    HOST_COPY = "host_copy"  # a copy the tensor's owner keeps in host memory (`host_copies`)
    PINNED = "pinned"
    PAGEABLE = "pageable"
    INVALID = "invalid"


HOST_RESIDENCES = (Residence.PINNED.value, Residence.PAGEABLE.value, Residence.OFFLOAD_BACKUP.value,
                   Residence.HOST_COPY.value)

_host_copy_lookups: list = []  # registered by `host_copies`, newest last
_without_backup: list = []  # registered by `regions_without_backup`, newest last


@contextlib.contextmanager
def host_copies(lookup, what: str = "its owner's host copy"):
    """While inside: `classify(t, allow_cpu_backup=True)` first asks ``lookup(t)``, which returns
    a host tensor of ``t``'s shape and dtype holding the bytes the owner restores into ``t`` when
    it wakes up, or None; a tensor it answers for is read from that copy, whatever its own
    residence. ``what`` names the copy in the classification's detail."""
    entry = (lookup, what)
    _host_copy_lookups.append(entry)
    try:
        yield
    finally:
        _host_copy_lookups.remove(entry)


@contextlib.contextmanager
def regions_without_backup(holds, what: str):
    """While inside: a paused tensor for which ``holds(t)`` is true is classified as unmapped
    without asking torch_memory_saver for a backup: asked about a paused allocation made without
    one, torch_memory_saver terminates the process (`exit(1)` in its `get_cpu_backup_pointer`).
    ``what`` names the region in the classification's detail."""
    entry = (holds, what)
    _without_backup.append(entry)
    try:
        yield
    finally:
        _without_backup.remove(entry)


def _known_without_backup(tensor: torch.Tensor) -> str | None:
    for holds, what in tuple(_without_backup):
        if holds(tensor):
            return what
    return None


@dataclass(frozen=True)
class Classified:
    """A source's residence; ``source`` replaces the tensor when its bytes come from elsewhere."""

    residence: str
    detail: str = ""
    source: torch.Tensor | None = None


def device_address_mapped(address: int) -> bool:
    """Whether the driver reports physical memory behind ``address`` (see `cuda_driver`)."""
    return cuda_driver.address_mapped(address)


def _cpu_backup(tensor: torch.Tensor) -> torch.Tensor | None:
    """torch_memory_saver's snapshot of a paused tensor, or None.

    Only asked when the memory saver is active in this process: it initialises itself
    lazily, and a paused pointer it does not own makes it terminate the process.
    """
    import sys

    module = sys.modules.get("torch_memory_saver")
    saver = getattr(module, "torch_memory_saver", None) if module is not None else None
    if saver is None or getattr(saver, "_impl", None) is None:
        return None
    getter = getattr(saver, "get_cpu_backup", None)
    if getter is None:  # 0.0.9 wheels have no backup access
        return None
    # The saver answers for contiguous tensors only; a strided view (half of a fused weight,
    # say) is asked as the contiguous byte range it spans and re-viewed over the backup.
    if tensor.is_contiguous():
        query = tensor
    else:
        query = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
            tensor.untyped_storage(), tensor.storage_offset() * tensor.element_size(), (_span_bytes(tensor),))
    try:
        try:
            backup = getter(query, zero_copy=True)
        except TypeError:  # versions before zero_copy always clone
            backup = getter(query)
    except Exception as exc:
        log.warning("torch_memory_saver.get_cpu_backup failed: %s", exc)
        return None
    if backup is None or query is tensor:
        return backup
    return backup.view(tensor.dtype).as_strided(tensor.shape, tensor.stride(), 0)


def classify(tensor: torch.Tensor, *, allow_cpu_backup: bool = False) -> Classified:
    device = tensor.device.type
    if device == "meta":
        return Classified(Residence.INVALID.value, "meta tensor has no data")
    if allow_cpu_backup:
        for lookup, what in tuple(_host_copy_lookups):
            copy = lookup(tensor)
            if copy is not None:
                return Classified(Residence.HOST_COPY.value, f"read from {what}", copy)
    if device == "cpu":
        if tensor.numel() and tensor.data_ptr() == 0:
            return Classified(Residence.INVALID.value, "host tensor without storage")
        pinned = torch.cuda.is_available() and tensor.is_pinned()
        return Classified(Residence.PINNED.value if pinned else Residence.PAGEABLE.value)
    if device != "cuda":
        return Classified(Residence.INVALID.value, f"device type {device!r} is not supported")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return Classified(Residence.CUDA.value)
    start = tensor.data_ptr()
    last = start + _span_bytes(tensor) - 1
    if device_address_mapped(start) and device_address_mapped(last):
        return Classified(Residence.CUDA.value)
    detail = (
        f"device memory at {start:#x}..{last:#x} on cuda:{tensor.device.index} is not mapped "
        f"(paused by a memory saver, or freed)"
    )
    if allow_cpu_backup:
        region = _known_without_backup(tensor)
        if region is not None:
            return Classified(Residence.CUDA_UNMAPPED.value, f"{detail}; it lies in {region}, kept without CPU backup")
        backup = _cpu_backup(tensor)
        if backup is not None:
            return Classified(Residence.OFFLOAD_BACKUP.value, detail, backup)
        detail += "; torch_memory_saver has no CPU backup for it"
    return Classified(Residence.CUDA_UNMAPPED.value, detail)


def _span_bytes(tensor: torch.Tensor) -> int:
    """Bytes from the first to one past the last element the view can touch."""
    if tensor.numel() == 0:
        return 0
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    return extent * tensor.element_size()


UNMAPPED_REMEDY = (
    "resume the memory saver (e.g. torch_memory_saver.resume()) before saving, or pass "
    "SaveOptions(unmapped_policy='cpu_backup') (slime: --safe-ckpt-unmapped-policy cpu_backup) "
    "to read the bytes from its CPU backup"
)
