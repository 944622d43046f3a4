"""One real sink with hooks around its data writes: a writer held at a gate, slowed, interrupted
or observed at an exact point, without faking any of the writing itself.

`HookedSink` wraps a real sink, or, given a directory, a `PosixSink(directory, fsync=False)` (so a
subclass is a `SaveOptions.sink_factory` for directories as it is): every item write calls
`before_write()` in the writer's thread, then the real write, then `after_write(file)`; the small
whole files the commit writes are recorded in `small_files`. Anything else (`list`, `read`,
`delete`, a kvstore sink's attributes) is the wrapped sink's.
- `EventGate`: the first data write announces itself (``arrived``) and waits for ``go`` (events
  that may cross processes); a gate never opened fails that write (ETIMEDOUT) instead of hanging.
- `OnFirstLanded`: once the first data write has landed (written and synced), ``callback`` runs,
  once (a server killed, a rank killed, with one object durable).
"""

from __future__ import annotations

import errno
import os
import threading

from safe_ckpt.sinks.posix import PosixSink


class HookedSink:
    """Subclasses override `before_write` and `after_write` (both run in the writer's thread)."""

    def __init__(self, inner, fsync: bool = False) -> None:
        self.inner = PosixSink(os.fspath(inner), fsync=fsync) if isinstance(inner, (str, os.PathLike)) else inner
        self.root = self.inner.root
        self.small_files: list[str] = []

    def __getattr__(self, name):  # list, read, delete, fsync, one_item_per_file, ...
        if name == "inner":  # not set yet: never look it up through itself
            raise AttributeError(name)
        return getattr(self.inner, name)

    def before_write(self) -> None:
        pass

    def after_write(self, file) -> None:
        """``file``: the wrapped sink's file just written to (``file.sync()`` makes it land)."""

    def open(self, relative_path, size_bytes):
        return _HookedFile(self, self.inner.open(relative_path, size_bytes))

    def write_file(self, relative_path, data) -> None:
        self.small_files.append(relative_path)
        self.inner.write_file(relative_path, data)

    def sync_root(self) -> None:
        self.inner.sync_root()


class _HookedFile:
    def __init__(self, sink: HookedSink, inner) -> None:
        self._sink, self._inner = sink, inner

    def write_at(self, offset_bytes, buffers) -> None:
        self._sink.before_write()
        self._inner.write_at(offset_bytes, buffers)
        self._sink.after_write(self._inner)

    def sync(self) -> None:
        self._inner.sync()

    def close(self) -> None:
        self._inner.close()


class EventGate(HookedSink):
    """The first data write sets ``arrived`` and waits for ``go``, at most ``wait_s``."""

    def __init__(self, inner, arrived, go, wait_s: float) -> None:
        super().__init__(inner)
        self._arrived, self._go, self._wait_s = arrived, go, wait_s
        self._lock = threading.Lock()
        self._passed = False

    def before_write(self) -> None:
        with self._lock:
            if self._passed:
                return
            self._arrived.set()
            if not self._go.wait(self._wait_s):
                raise OSError(errno.ETIMEDOUT, f"the test's gate was not opened within {self._wait_s} s")
            self._passed = True


class OnFirstLanded(HookedSink):
    """After this sink's first data write lands (written, then synced), ``callback()`` runs once."""

    def __init__(self, inner, callback) -> None:
        super().__init__(inner)
        self.callback = callback
        self.fired = threading.Event()
        self._lock = threading.Lock()

    def after_write(self, file) -> None:
        with self._lock:
            first = not self.fired.is_set()
            self.fired.set()
        if first:
            file.sync()  # landed
            self.callback()
