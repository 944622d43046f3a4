"""The stream and event operations a copy window needs, behind one small interface.

One job: enqueue work "on a device's copy stream" (a payload copy into host memory, a checksum
kernel), mark how far that stream has come, keep a source's memory from reuse until the stream
is past it, and order the caller's stream after a mark, or block the host on one, boundedly.
Two implementations:
- `CudaStreams`: the real thing. One side stream per device; `fence` makes it wait for the
  caller's current stream; copies go through the CUDA driver (or `copy_(non_blocking=True)`);
  a mark is a `torch.cuda.Event` recorded on it; `keep` is `tensor.record_stream(copy stream)`;
  `order_current_after` is `torch.cuda.current_stream(device).wait_event(event)`, which does
  not block the host.
- `HostStreams`: for CPU tests and CPU-only runs. A "device" is a worker thread that runs its
  work in the order it was enqueued; a mark is set when the worker reaches it. The caller's
  stream is the calling thread itself, so ordering it after a mark blocks it. `hold(device)`
  holds the worker (as a spin kernel enqueued first on a CUDA copy stream would) so that a test
  can keep copies from landing.

Must not: decide what is copied or in which order (the window and its copier do), allocate host
memory, synchronize a whole device, or copy anything host-to-device.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Protocol

import torch

from .. import cuda_driver

log = logging.getLogger(__name__)

_POLL_MAX_S = 0.005  # longest nap between two queries of a CUDA event while the host waits on it


class Mark(Protocol):
    """How far one device's copy stream had come when it was taken."""

    device: int

    def done(self) -> bool: ...

    def synchronize(self) -> None: ...


class CopyStreams(Protocol):
    ordering_blocks_host: bool  # `order_current_after` blocks the host until the mark (counted as a gate's wait)

    def fence(self, device: int) -> None:
        """From here on, the device's copy stream runs after what the caller's current stream holds now."""

    def copy(self, device: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue a copy of ``src`` (on ``device``) into ``dst``, host uint8 bytes of exactly its size."""

    def call(self, device: int, fn: Callable[[], None]) -> None:
        """Run ``fn`` so that the device work it enqueues happens in the copy stream's order."""

    def mark(self, device: int) -> Mark:
        """A mark after everything enqueued on the device's copy stream so far."""

    def keep(self, device: int, tensor: torch.Tensor) -> None:
        """``tensor``'s memory is not reused before the copy stream's work enqueued so far is done."""

    def order_current_after(self, mark: Mark) -> None:
        """The caller's current stream on the mark's device runs nothing more until the mark is done."""

    def wait(self, mark: Mark, timeout_s: float | None) -> bool:
        """Block the host until the mark is done (True) or ``timeout_s`` passed (False)."""

    def close(self) -> None:
        """No more work will be enqueued."""


# ------------------------------------------------------------------------------------------- CUDA
class CudaMark:
    __slots__ = ("device", "event")

    def __init__(self, device: int, event) -> None:
        self.device = device
        self.event = event

    def done(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()


class CudaStreams:
    """One side stream per device, created at its first use (per window, as the stager's)."""

    ordering_blocks_host = False

    def __init__(self, page_locked: bool = True, driver_copies: bool | None = None) -> None:
        """``page_locked``: destinations are pinned (the pool is); ``driver_copies``: enqueue
        contiguous copies through the CUDA driver (default: where it loads)."""
        self.page_locked = page_locked
        self._driver = cuda_driver.copies_available() if driver_copies is None else driver_copies
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def stream(self, device: int) -> "torch.cuda.Stream":
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device=device)
            return stream

    def fence(self, device: int) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self.stream(device).wait_event(event)

    def copy(self, device: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = self.stream(device)
        nbytes = src.numel() * src.element_size()
        if nbytes == 0:
            return
        if self._driver and src.is_contiguous() and cuda_driver.current_device() == device:
            cuda_driver.memcpy_dtoh_async(dst.data_ptr(), src.data_ptr(), nbytes, stream.cuda_stream)
            return
        with torch.cuda.device(device), torch.cuda.stream(stream):
            # A strided source makes torch build a contiguous temporary on the device first.
            dst.view(src.dtype).view(src.shape).copy_(src, non_blocking=True)

    def call(self, device: int, fn: Callable[[], None]) -> None:
        with torch.cuda.device(device), torch.cuda.stream(self.stream(device)):
            fn()

    def mark(self, device: int) -> CudaMark:
        event = torch.cuda.Event()
        event.record(self.stream(device))
        return CudaMark(device, event)

    def keep(self, device: int, tensor: torch.Tensor) -> None:
        if tensor.device.type == "cuda":
            tensor.record_stream(self.stream(device))

    def order_current_after(self, mark: CudaMark) -> None:
        torch.cuda.current_stream(mark.device).wait_event(mark.event)

    def wait(self, mark: CudaMark, timeout_s: float | None) -> bool:
        if timeout_s is None:
            mark.event.synchronize()
            return True
        deadline = time.monotonic() + timeout_s
        nap = 0.0001
        while not mark.event.query():  # event.synchronize() has no bound
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(nap, left))
            nap = min(nap * 2, _POLL_MAX_S)
        return True

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------- host
class HostMark:
    __slots__ = ("device", "_reached", "error")

    def __init__(self, device: int) -> None:
        self.device = device
        self._reached = threading.Event()
        self.error: BaseException | None = None  # work enqueued before the mark failed

    def done(self) -> bool:
        return self._reached.is_set()

    def synchronize(self) -> None:
        self._reached.wait()
        if self.error is not None:
            raise self.error


class _Worker:
    """One simulated device: runs its work in order on a daemon thread."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.work: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None  # sticky, as a failed CUDA copy is
        self.thread = threading.Thread(target=self._run, name=f"safe_ckpt-copystream-{device}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            fn = self.work.get()
            if fn is None:
                return
            try:
                fn()
            except BaseException as exc:  # the stream goes on; every later mark carries the error
                if self.error is None:
                    self.error = exc


class HostStreams:
    """Copy streams simulated by worker threads (see the module docstring)."""

    ordering_blocks_host = True  # the host is the caller's "current stream"

    def __init__(self) -> None:
        self._workers: dict[int, _Worker] = {}
        self._lock = threading.Lock()

    def _worker(self, device: int) -> _Worker:
        with self._lock:
            worker = self._workers.get(device)
            if worker is None:
                worker = self._workers[device] = _Worker(device)
            return worker

    def fence(self, device: int) -> None:
        self._worker(device)  # host work before this call is already done

    def copy(self, device: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        if src.numel():
            self._worker(device).work.put(lambda: dst.view(src.dtype).view(src.shape).copy_(src))

    def call(self, device: int, fn: Callable[[], None]) -> None:
        self._worker(device).work.put(fn)

    def mark(self, device: int) -> HostMark:
        worker = self._worker(device)
        mark = HostMark(device)

        def reach() -> None:
            mark.error = worker.error
            mark._reached.set()

        worker.work.put(reach)
        return mark

    def keep(self, device: int, tensor: torch.Tensor) -> None:
        pass  # the enqueued work holds its tensors

    def order_current_after(self, mark: HostMark) -> None:
        mark.synchronize()

    def wait(self, mark: HostMark, timeout_s: float | None) -> bool:
        return mark._reached.wait(timeout_s)

    def hold(self, device: int) -> threading.Event:
        """Work enqueued on the device after this call waits until the returned event is set."""
        go = threading.Event()
        self._worker(device).work.put(go.wait)
        return go

    def close(self) -> None:
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
        for worker in workers:
            worker.work.put(None)


def streams_for(devices: set[int], page_locked: bool = True) -> CopyStreams:
    """CUDA streams where the sources are on CUDA devices, else host workers."""
    if devices and torch.cuda.is_available():
        return CudaStreams(page_locked=page_locked)
    return HostStreams()
