"""A reader thread's two pinned pieces and its copies out of them into the destinations.

One job: hand a reader thread a buffer to read into (one of its two pieces of the process-wide
pinned pool, in turn, or a temporary host tensor for a read bigger than a piece), and copy
byte ranges out of it into destination tensors: host destinations synchronously, GPU ones on
the thread's own stream per device (made current for the thread once, after the caller's
stream), with one event per device recorded after each call's copies, so a piece is read into
again only once every copy out of it has finished. The events are the thread's own, reused.
A byte range from a piece into a contiguous GPU destination is enqueued through the CUDA
driver where it loads and the thread's current context is the destination's device (one
call from two addresses, against two tensor views and a dispatched `copy_` that hold the GIL
for tens of microseconds each: per item, with a thousand small items, that is time every
other reader thread waits); anything else through torch.
Must not: read files, check checksums, or block on the device beyond the copies it issued.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .. import cuda_driver
from ..errors import ReadError


@dataclass(frozen=True, slots=True)
class Span:
    """``nbytes`` from byte ``src_start`` of a buffer to byte ``dest_start`` of destination ``dest``'s
    contiguous bytes (`plan.Destination.flat_bytes`)."""

    dest: int
    dest_start: int
    src_start: int
    nbytes: int


class Copier:
    """One reader thread's pieces, streams and events; ``reader`` gives the pool, piece size and caller's streams."""

    def __init__(self, reader) -> None:
        self.r = reader
        self.leases: list = []
        self.pending: list = [[], []]  # per slot: the events its last copies recorded
        self.slot_events: list = [{}, {}]  # per slot: device -> this thread's reusable event
        self.turn = 0
        self.streams: dict = {}
        self.wait_s = 0.0
        self.copy_s = 0.0  # issuing copies (and, for host destinations, making them)
        self.views: list = []  # per slot: the whole piece as a byte memoryview, made once
        self.addresses: list = []  # per slot: the piece's first byte
        self.driver: dict = {}  # device -> whether this thread enqueues its copies there through the driver
        self.targets: dict = {}  # destination index -> (flat bytes, device, address)

    def buffer(self, nbytes: int):
        """(slot, uint8 tensor, memoryview of ``nbytes``): a pool piece (slot 0/1; the tensor is the
        whole piece), or for a read bigger than a piece, a temporary host tensor of ``nbytes`` (slot
        None, copied synchronously)."""
        if nbytes > self.r.piece_bytes:
            t = torch.empty(nbytes, dtype=torch.uint8)
            return None, t, memoryview(t.numpy()).cast("B")
        self.take_pieces()
        slot, self.turn = self.turn, self.turn ^ 1
        if self.pending[slot]:
            t0 = time.perf_counter()
            for event in self.pending[slot]:
                if not event.query():  # asked first: a wait gives up the GIL even when nothing is left to wait for
                    event.synchronize()
            self.wait_s += time.perf_counter() - t0
            self.pending[slot] = []
        return slot, self.leases[slot].tensor, self.views[slot][:nbytes]

    def take_pieces(self) -> None:
        """This thread's two pool pieces, held until `finish`."""
        if not self.leases:
            t0 = time.perf_counter()
            pool = self.r.pool()
            for _ in range(2):
                self.leases.append(pool.lease(self.r.piece_bytes, timeout_s=self.r.timeout_s, cancel=self.r.cancel))
                self.views.append(memoryview(self.leases[-1].tensor.numpy()).cast("B"))
                self.addresses.append(self.leases[-1].tensor.data_ptr())
            self.wait_s += time.perf_counter() - t0

    def stream(self, device):
        """This thread's stream on ``device``, current for the thread from its first use (only reader
        threads run here, so no caller's stream is changed)."""
        s = self.streams.get(device)
        if s is None:
            torch.cuda.set_device(device)  # this thread's: its driver calls go to the device's context
            s = self.streams[device] = torch.cuda.Stream(device=device)
            s.wait_stream(self.r.caller_streams[device])
            torch.cuda.set_stream(s)
            if len(self.streams) > 1:  # one current context at a time: several devices go through torch
                self.driver = dict.fromkeys(self.streams, False)
        return s

    def copy_spans(self, spans: list, slot, src: torch.Tensor) -> None:
        """Copy each `Span` out of ``src`` (the tensor `buffer` gave) as `copy_all` copies its pairs."""
        t0 = time.perf_counter()
        try:
            devices, pairs = None, []
            address = self.addresses[slot] if slot is not None else 0
            for span in spans:
                target = self.targets.get(span.dest)
                if target is None:
                    flat = self.r.plan.destinations[span.dest].flat_bytes
                    target = self.targets[span.dest] = (flat, flat.device, flat.data_ptr())
                flat, device, dest_address = target
                if slot is None or device.type != "cuda":
                    pairs.append((flat[span.dest_start:span.dest_start + span.nbytes],
                                  src[span.src_start:span.src_start + span.nbytes]))
                    continue
                if device not in self.streams:
                    self.stream(device)
                driver = self.driver.get(device)
                if driver is None:  # asked once the thread has used the device (its context is current)
                    driver = self.driver[device] = self.r.driver_copies and \
                        cuda_driver.current_device() == device.index
                if driver:
                    # torch's copy_ would refuse a range past either end; a raw address copy would not
                    if span.dest_start + span.nbytes > flat.numel() or span.src_start + span.nbytes > src.numel():
                        raise ReadError(f"internal error: a copy of {span.nbytes} bytes falls outside its destination "
                                        f"({flat.numel()} bytes) or its read ({src.numel()} bytes)")
                    cuda_driver.memcpy_htod_async(dest_address + span.dest_start, address + span.src_start,
                                                  span.nbytes, self.streams[device].cuda_stream)
                    if devices is None:
                        devices = [device]
                    elif device not in devices:
                        devices.append(device)
                else:
                    pairs.append((flat[span.dest_start:span.dest_start + span.nbytes],
                                  src[span.src_start:span.src_start + span.nbytes]))
            self._copy_all(pairs, slot, devices)
        finally:
            self.copy_s += time.perf_counter() - t0

    def copy(self, dst: torch.Tensor, src: torch.Tensor, slot) -> None:
        self.copy_all(((dst, src),), slot)

    def copy_all(self, pairs, slot) -> None:
        """Copy each (destination, source) pair; where a source lies in a piece (``slot``), one event
        per device marks the end of these copies before the piece is read into again."""
        t0 = time.perf_counter()
        try:
            self._copy_all(pairs, slot)
        finally:
            self.copy_s += time.perf_counter() - t0

    def _copy_all(self, pairs, slot, devices=None) -> None:
        """``devices``: those copies were already enqueued to (through the driver)."""
        for dst, src in pairs:
            if dst.device.type != "cuda":
                dst.copy_(src)
                continue
            device = dst.device
            if device not in self.streams:
                self.stream(device)
            # on the thread's current stream for the device; from a temporary buffer, synchronous
            dst.copy_(src, non_blocking=slot is not None)
            if devices is None:
                devices = [device]
            elif device not in devices:
                devices.append(device)
        if devices is None or slot is None:  # without a slot the copies were synchronous
            return
        for device in devices:
            event = self.slot_events[slot].get(device)
            if event is None:
                event = self.slot_events[slot][device] = torch.cuda.Event()
            event.record(self.streams[device])
            if event not in self.pending[slot]:
                self.pending[slot].append(event)

    def finish_copies(self) -> None:
        """Wait for every copy this thread issued, then give its pieces back."""
        try:
            t0 = time.perf_counter()
            for s in self.streams.values():
                s.synchronize()
            self.wait_s += time.perf_counter() - t0
        finally:
            for lease in self.leases:
                lease.release()
            self.leases, self.views, self.addresses = [], [], []
