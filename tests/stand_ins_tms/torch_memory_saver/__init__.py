"""Stand-in for torch_memory_saver on a machine without CUDA (the real one needs a GPU).

Mirrors the public interface of `torch_memory_saver` 0.0.10 (fzyzcjy/torch_memory_saver at
4a43c97, whose `entrypoint.py` equals the 0.0.10 wheel's): the `torch_memory_saver` singleton of
`TorchMemorySaver` with `region`, `cuda_graph`, `disable`, `pause`, `resume`, `enabled`,
`hook_mode`, `memory_margin_bytes`, `retain_cpu_backup`, `get_cpu_backup` and
`set_disk_backup_dir`, and `configure_subprocess`. Same signatures and the same initialise-on-
first-use. `pause` and `resume` append ``(name, tag)`` to `calls`.

Host memory stands for device memory: a tensor allocated inside `region(...)` (any torch call there
whose result has storage of its own) belongs to that region, and `pause`/`resume` treat its bytes
as the real saver treats device bytes, as far as they can be seen from the CPU:
- a region without backup (`enable_cpu_backup=False`, as slime's patched DDP allocates the
  parameter and gradient buffers) loses its bytes at `pause`: they are overwritten with 0xFF bytes
  (NaN in every float dtype), and `resume` leaves them so (the real one maps fresh pages, whose
  contents are undefined); the owner must restore them, as slime's `wake_up` does;
- a region with disk backup loses them at `pause` too and gets them back at `resume`;
- a region with CPU backup keeps its bytes in place: on the CPU, safe_ckpt reads host tensors where
  they are (on the GPU it reads the backup, which holds the same bytes).
Nothing here is a device pointer, so `get_cpu_backup` returns None. It lives in its own directory so
that only the CPU tests that put it on `sys.path` import it; the GPU tests use the real package.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
from torch.overrides import TorchFunctionMode

_TAG_DEFAULT = "default"
CpuBackupBackend = Literal["mmap", "pinned"]


@dataclass
class _Region:
    tag: str
    cpu_backup: bool
    disk_backup: bool
    storages: list = field(default_factory=list)  # uint8 tensors over each allocation's whole storage
    paused: bool = False
    stash: list = field(default_factory=list)  # a disk backup's bytes while paused


class _Allocations(TorchFunctionMode):
    """Inside a region: every tensor a torch call returns on storage none of its inputs has."""

    def __init__(self, region: _Region):
        super().__init__()
        self.region = region

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        seen = {s.data_ptr() for s in self.region.storages}
        for t in _tensors(out):
            ptr = t.untyped_storage().data_ptr()
            if ptr and ptr not in inputs and ptr not in seen:
                whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
                self.region.storages.append(whole)
                seen.add(ptr)
        return out


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


class _Impl:
    def __init__(self, hook_mode="preload"):
        self.hook_mode = hook_mode
        self.calls = []
        self.retain_cpu_backup = False
        self.memory_margin_bytes = 0
        self.disk_backup_dir = None
        self.regions: list = []

    def matching(self, tag):
        return [r for r in self.regions if tag is None or r.tag == tag]


class TorchMemorySaver:
    def __init__(self):
        self._impl_ctor_kwargs = {}
        self._impl: Optional[_Impl] = None

    @property
    def calls(self) -> list:  # stand-in only: what pause/resume were asked
        self._ensure_initialized()
        return self._impl.calls

    @contextmanager
    def region(self, tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False, enable_disk_backup: bool = False,
               cpu_backup_backend: Optional[CpuBackupBackend] = None):
        if cpu_backup_backend is not None and not enable_cpu_backup:
            raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
        self._ensure_initialized()
        assert not (enable_cpu_backup and enable_disk_backup), \
            "enable_cpu_backup and enable_disk_backup are mutually exclusive"
        region = _Region(tag, enable_cpu_backup, enable_disk_backup)
        self._impl.regions.append(region)
        with torch.no_grad(), _Allocations(region):
            yield

    @contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode='global', tag: str = _TAG_DEFAULT,
                   enable_cpu_backup: bool = False, cpu_backup_backend: Optional[CpuBackupBackend] = None):
        raise RuntimeError("torch_memory_saver stand-in: no CUDA graphs without a GPU")
        yield  # noqa: unreachable, keeps this a generator as the real one is

    @contextmanager
    def disable(self):
        self._ensure_initialized()
        yield

    def pause(self, tag: Optional[str] = None):
        """Pause memory for specific tag or all memory if tag is None"""
        self._ensure_initialized()
        self._impl.calls.append(("pause", tag))
        for region in self._impl.matching(tag):
            if region.paused:
                continue
            region.paused = True
            if region.disk_backup:
                region.stash = [s.clone() for s in region.storages]
            if not region.cpu_backup:
                for s in region.storages:
                    s.fill_(0xFF)

    def resume(self, tag: Optional[str] = None):
        """Resume memory for specific tag or all memory if tag is None"""
        self._ensure_initialized()
        self._impl.calls.append(("resume", tag))
        for region in self._impl.matching(tag):
            if not region.paused:
                continue
            region.paused = False
            for s, saved in zip(region.storages, region.stash):
                s.copy_(saved)
            region.stash = []

    @property
    def enabled(self):
        return True

    @property
    def hook_mode(self):
        raise AttributeError

    @hook_mode.setter
    def hook_mode(self, hook_mode):
        assert self._impl_ctor_kwargs is not None, "Cannot configure after initialization"
        self._impl_ctor_kwargs["hook_mode"] = hook_mode

    @property
    def memory_margin_bytes(self):
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int):
        self._ensure_initialized()
        self._impl.memory_margin_bytes = value

    @property
    def retain_cpu_backup(self) -> bool:
        self._ensure_initialized()
        return self._impl.retain_cpu_backup

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool):
        self._ensure_initialized()
        self._impl.retain_cpu_backup = bool(value)

    def get_cpu_backup(self, x, zero_copy: bool = False):
        self._ensure_initialized()
        return None  # nothing is ever paused here

    def set_disk_backup_dir(self, path: str):
        import os

        self._ensure_initialized()
        os.makedirs(path, exist_ok=True)
        self._impl.disk_backup_dir = path

    def _ensure_initialized(self):
        if self._impl is not None:
            return
        self._impl = _Impl(**self._impl_ctor_kwargs)
        del self._impl_ctor_kwargs


@contextmanager
def configure_subprocess():
    """Configure environment variables for subprocesses. Only needed for hook_mode=preload."""
    yield


torch_memory_saver = TorchMemorySaver()
