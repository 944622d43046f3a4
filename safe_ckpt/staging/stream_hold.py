"""Hold the calling thread's CUDA streams at their current point until another thread lets them go.

One job: enqueue on the calling thread's current stream of each given device a wait, on the device,
for a word of page-locked host memory to reach this hold's number (`cuStreamWaitValue32`), so that
whatever the caller enqueues afterwards runs only once `StreamHold.release()` has stored that
number; the host never blocks. The copy window uses it to open on its staging thread: the training
stream still runs nothing new until the opening's copies and sums are done, while the training
thread goes on enqueuing.

The word is one per process, allocated once and never freed (a freed word reused by the host
allocator could leave a stream waiting on someone else's bytes); holds take increasing numbers and
wait for "at least", so a later release also lets an earlier wait go.
`release` is idempotent; the owner calls it on every path: a hold never released leaves the caller's
device waiting forever.

Must not: block the host, synchronize a device, or be taken by a thread that cannot release it.
"""

from __future__ import annotations

import logging
import threading

import torch

from .. import cuda_driver

log = logging.getLogger("safe_ckpt")


class _Word:
    """The process's page-locked word and the numbers handed out (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tensor: torch.Tensor | None = None
        self.address = 0
        self.issued = 0  # the last number a hold waits for
        self.stored = 0  # the number in the word now

    def next_number(self) -> int:
        with self.lock:
            if self.tensor is None:
                self.tensor = torch.zeros(1, dtype=torch.int32, pin_memory=True)
                self.address = cuda_driver.host_device_address(self.tensor.data_ptr())
            self.issued += 1
            return self.issued

    def store(self, number: int) -> None:
        with self.lock:
            if number > self.stored:
                self.stored = number
                self.tensor[0] = number


_word = _Word()


class StreamHold:
    """Streams held until `release` (see the module docstring)."""

    def __init__(self, number: int, devices: tuple[int, ...]) -> None:
        self.number = number
        self.devices = devices
        self._released = threading.Event()

    def release(self) -> None:
        if not self._released.is_set():
            _word.store(self.number)
            self._released.set()

    @property
    def released(self) -> bool:
        return self._released.is_set()


def hold_current(devices) -> StreamHold | None:
    """Hold the calling thread's current stream on each of ``devices``; None where the driver
    cannot (the caller then does the work in its own thread instead)."""
    devices = tuple(sorted(devices))
    if not devices or not cuda_driver.stream_waits_available():
        return None
    try:
        number = _word.next_number()
    except Exception as exc:  # no page-locked memory, no driver: the caller's own thread it is
        log.debug("cannot hold the caller's streams: %s", exc)
        return None
    hold = StreamHold(number, devices)
    try:
        for device in devices:
            with torch.cuda.device(device):
                stream = torch.cuda.current_stream(device)
                cuda_driver.stream_wait_value32(stream.cuda_stream, _word.address, number)
    except Exception as exc:  # a stream already held goes on at once
        hold.release()
        log.debug("cannot hold the caller's streams: %s", exc)
        return None
    return hold
