"""Stand-in for torch_memory_saver on a machine without CUDA (the real one needs a GPU).

Mirrors the public interface of `torch_memory_saver` 0.0.10 (fzyzcjy/torch_memory_saver at
4a43c97, whose `entrypoint.py` equals the 0.0.10 wheel's): the `torch_memory_saver` singleton of
`TorchMemorySaver` with `region`, `cuda_graph`, `disable`, `pause`, `resume`, `enabled`,
`hook_mode`, `memory_margin_bytes`, `retain_cpu_backup`, `get_cpu_backup` and
`set_disk_backup_dir`, and `configure_subprocess`. Same signatures and the same initialise-on-
first-use; what it cannot do without a device it records instead: `pause` and `resume` append
``(name, tag)`` to `calls` and move no memory, and no tensor is ever paused, so
`get_cpu_backup` returns None. It lives in its own directory so that only the CPU tests that
put it on `sys.path` import it; the GPU tests use the real package.
"""

from contextlib import contextmanager
from typing import Literal, Optional

_TAG_DEFAULT = "default"
CpuBackupBackend = Literal["mmap", "pinned"]


class _Impl:
    def __init__(self, hook_mode="preload"):
        self.hook_mode = hook_mode
        self.calls = []
        self.retain_cpu_backup = False
        self.memory_margin_bytes = 0
        self.disk_backup_dir = None


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

    def resume(self, tag: Optional[str] = None):
        """Resume memory for specific tag or all memory if tag is None"""
        self._ensure_initialized()
        self._impl.calls.append(("resume", tag))

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
