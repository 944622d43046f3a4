"""A reader thread's two pinned pieces and its copies out of them into the destinations.

One job: hand a reader thread a buffer to read into (one of its two pieces of the process-wide
pinned pool, in turn, or a temporary host tensor for a read bigger than a piece), and copy
byte ranges out of it into destination tensors: host destinations synchronously, GPU ones on
the thread's own stream per device (made current for the thread once, after the caller's
stream), with one event per device recorded after each call's copies, so a piece is read into
again only once every copy out of it has finished. The events are the thread's own, reused.
Must not: read files, check checksums, or block on the device beyond the copies it issued.
"""

from __future__ import annotations

import time

import torch


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

    def buffer(self, nbytes: int):
        """(slot, uint8 tensor, memoryview) of ``nbytes``: a pool piece (slot 0/1), or for a
        read bigger than a piece, a temporary host tensor (slot None, copied synchronously)."""
        if nbytes > self.r.piece_bytes:
            t = torch.empty(nbytes, dtype=torch.uint8)
            return None, t, memoryview(t.numpy()).cast("B")
        self.take_pieces()
        slot, self.turn = self.turn, self.turn ^ 1
        if self.pending[slot]:
            t0 = time.perf_counter()
            for event in self.pending[slot]:
                event.synchronize()
            self.wait_s += time.perf_counter() - t0
            self.pending[slot] = []
        t = self.leases[slot].tensor[:nbytes]
        return slot, t, memoryview(t.numpy()).cast("B")

    def take_pieces(self) -> None:
        """This thread's two pool pieces, held until `finish`."""
        if not self.leases:
            t0 = time.perf_counter()
            pool = self.r.pool()
            for _ in range(2):
                self.leases.append(pool.lease(self.r.piece_bytes, timeout_s=self.r.timeout_s, cancel=self.r.cancel))
            self.wait_s += time.perf_counter() - t0

    def stream(self, device):
        """This thread's stream on ``device``, current for the thread from its first use (only reader
        threads run here, so no caller's stream is changed)."""
        s = self.streams.get(device)
        if s is None:
            s = self.streams[device] = torch.cuda.Stream(device=device)
            s.wait_stream(self.r.caller_streams[device])
            torch.cuda.set_stream(s)
        return s

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

    def _copy_all(self, pairs, slot) -> None:
        devices = None
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
            self.leases = []
