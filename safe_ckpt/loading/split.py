"""Large items read by every reader thread at once: piece-sized byte ranges, checked as one item.

One job: turn a read plan's batches into the reader's tasks, cutting each item bigger than a
piece (read whole, byte for byte into contiguous destinations, in the standard archive) into
piece-sized payload ranges that any reader thread may take, so that one big tensor keeps every
thread busy; and check such an item's checksum across its pieces:
- a grid checksum from each piece's row and column sums (the rows are independent, the column
  sums add), in whatever order the pieces finish; where the whole payload lands in one
  contiguous GPU tensor, from that tensor once its last piece is in (the sums on the device,
  as the save made them: the host never reads those bytes again; they are enqueued on a check
  stream behind the pieces' copies and compared once every reader thread is done, so no reader
  thread blocks on the device in the middle of its reads, and none of its copies waits for them);
- a sequential one (xxh3, CRC-32) by feeding the pieces strictly in order: a thread whose piece
  is not next waits for the one before it, which an earlier task holds (tasks of one item are
  handed out in order, so the wait always ends);
- none where the manifest has no checksum for it, or checks are off.
Each item's framing is read and checked before its pieces are handed out (an item that is not
the standard archive stays whole, for the decoding path). The pieces of the split items are
handed out first, round robin across items, so threads work on different items at once.
Must not: allocate pinned memory, or talk to other ranks.
"""

from __future__ import annotations

import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from .. import integrity
from ..errors import ReadError
from . import container, copies
from .plan import DIRECT, FLAT, Batch, ItemRead

# A thread waiting for the piece before its own looks at the cancel flag this often.
_WAIT_S = 0.5


class _Grid:
    """A grid checksum assembled from pieces in any order (see `integrity` for its definition)."""

    def __init__(self, fold: str, payload_bytes: int) -> None:
        integrity.Hasher(fold)  # an unknown fold algorithm fails here, before any piece is read
        self.fold, self.n = fold, payload_bytes
        self.rows_end = integrity.grid_rows(payload_bytes) * integrity.GRID_ROW_BYTES
        self.rows = np.zeros(integrity.grid_rows(payload_bytes), dtype=np.uint32)
        self.cols = np.zeros(integrity.GRID_COLUMNS, dtype=np.uint32)
        self.tail = b""

    def add(self, start: int, data, lock) -> None:
        """The sums of payload bytes [start, start + len(data)); ``start`` is a multiple of a row."""
        view = memoryview(data).cast("B")
        whole = max(0, min(view.nbytes, self.rows_end - start))
        cols = None
        if whole:
            words = np.frombuffer(view[:whole], dtype="<u4").reshape(-1, integrity.GRID_COLUMNS)
            first = start // integrity.GRID_ROW_BYTES
            self.rows[first:first + words.shape[0]] = words.sum(axis=1, dtype=np.uint32)
            cols = words.sum(axis=0, dtype=np.uint32)
        with lock:
            if cols is not None:
                self.cols += cols
            if whole < view.nbytes:
                self.tail = bytes(view[whole:])

    def summed(self, payload):
        """The payload's (a contiguous uint8 tensor's) sums then its last partial row, as one uint8
        tensor on the payload's device: what `from_summed` takes once read back."""
        return torch.cat((integrity.grid_sums(payload).view(torch.uint8), payload[self.rows_end:]))

    def from_summed(self, data) -> None:
        """Sums and tail from `summed`'s bytes, read back to the host (a numpy uint8 array)."""
        words = data.nbytes - (self.n - self.rows_end)
        sums = data[:words].view("<u4")
        self.rows, self.cols = sums[:self.rows.size], sums[self.rows.size:]
        self.tail = data[words:].tobytes()

    def value(self, head, suffix) -> int:
        return integrity.checksum_of([bytes(head), struct.pack("<Q", self.n), self.rows.astype("<u4").tobytes(),
                                      self.cols.astype("<u4").tobytes(), self.tail, bytes(suffix)], self.fold)


class SplitItem:
    """One item read as pieces by several threads: its framing bytes, progress and checksum."""

    def __init__(self, read: ItemRead, head: bytearray, tail: bytearray, pieces: int, hasher, grid) -> None:
        self.read, self.head, self.tail = read, head, tail
        self.left = pieces
        self.next = 0  # the piece a sequential hasher takes next
        self.hasher, self.grid = hasher, grid
        self.on_device = None  # the payload's bytes in one GPU tensor, where the grid is summed there
        self.events: list = []  # the pieces' copies into it
        self.cond = threading.Condition()

    def feed(self, index: int, parts: list, start: int, cancel: threading.Event) -> None:
        """Hash this piece's bytes (``parts``, payload bytes from ``start``) as the checksum needs."""
        if self.on_device is not None:
            return
        if self.grid is not None:
            data = parts[0] if len(parts) == 1 else b"".join(bytes(p) for p in parts)
            self.grid.add(start, data, self.cond)
            return
        if self.hasher is None:
            return
        with self.cond:
            while self.next != index:  # the pieces before it are held by tasks handed out earlier
                if cancel.is_set():
                    raise ReadError("stopped: another read failed")
                self.cond.wait(_WAIT_S)
        for part in parts:  # only this thread may feed now: the others wait for `next` to pass them
            self.hasher.update(part)
        with self.cond:
            self.next += 1
            self.cond.notify_all()

    def done(self) -> bool:
        """Count one piece finished; True for the thread that finished the last."""
        with self.cond:
            self.left -= 1
            return self.left == 0

    def value(self) -> int:
        if self.grid is not None:
            return self.grid.value(self.head, self.tail)
        self.hasher.update(self.tail)
        return self.hasher.value()


@dataclass(frozen=True)
class PieceTask:
    """Payload bytes [start, end) of a split item."""

    item: SplitItem
    index: int
    start: int
    end: int

    @property
    def fqn(self) -> str:
        return self.item.read.fqn


def _splittable(batch: Batch, piece_bytes: int) -> bool:
    read = batch.items[0]
    return (len(batch.items) == 1 and read.frame is not None and read.whole and read.byte_copies
            and read.frame.payload_bytes > piece_bytes)


def _checking(read: ItemRead, algorithm: str):
    """(sequential hasher fed nothing yet, grid) for the item; (None, None) unchecked (no checksum, or
    checks off: the plan then carries none); None: leave it whole."""
    c = read.checksum
    if c is None:
        return None, None
    if c.length_bytes != read.item.length_bytes:
        return None  # the whole-item path names the mismatch
    name = c.algorithm or algorithm
    try:
        if name.startswith(integrity.GRID_PREFIX):
            if (c.payload_offset_bytes, c.payload_length_bytes) != (read.frame.prefix_bytes, read.frame.payload_bytes):
                return None
            return None, _Grid(name[len(integrity.GRID_PREFIX):], read.frame.payload_bytes)
        return integrity.Hasher(name), None
    except (RuntimeError, ValueError):
        return None  # the whole-item path names the unknown algorithm


def _framed(source, read: ItemRead):
    """(head, tail) of an item that is the standard archive, else None."""
    f = read.frame
    head, tail = bytearray(f.prefix_bytes), bytearray(f.suffix_bytes)
    try:
        source.readv(read.item.relative_path, read.item.offset_bytes, [memoryview(head)])
        source.readv(read.item.relative_path, read.item.offset_bytes + read.item.length_bytes - f.suffix_bytes,
                     [memoryview(tail)])
    except Exception:  # the whole-item path reads it again and names the problem
        return None
    return (head, tail) if container.payload_is_framed(f, head, tail) else None


def _device_payload(read: ItemRead, destinations: tuple):
    """The payload's bytes as one GPU tensor, where all of it goes to one (4-byte aligned for the sums)."""
    if len(read.pieces) != 1 or read.pieces[0].mode != FLAT:
        return None
    p = read.pieces[0]
    flat = destinations[p.dest].flat_bytes
    payload = flat[p.dest_start:p.dest_start + read.frame.payload_bytes]
    return payload if flat.device.type == "cuda" and payload.data_ptr() % 4 == 0 else None


def tasks(batches: tuple, source, *, piece_bytes: int, threads: int, algorithm: str, destinations: tuple = ()) -> list:
    """The reader's tasks: each split item's `PieceTask`s (round robin across items), then the other batches."""
    candidates = [b for b in batches if _splittable(b, piece_bytes)] if threads > 1 else []
    if not candidates:
        return list(batches)
    with ThreadPoolExecutor(max_workers=min(threads, len(candidates))) as pool:
        frames = list(pool.map(lambda b: _framed(source, b.items[0]), candidates))
    split_ids, lists = set(), []
    for batch, framed in zip(candidates, frames):
        read = batch.items[0]
        checking = _checking(read, algorithm)
        if framed is None or checking is None:
            continue
        n = read.frame.payload_bytes
        starts = range(0, n, piece_bytes)
        item = SplitItem(read, *framed, len(starts), *checking)
        if item.hasher is not None:
            item.hasher.update(item.head)
        if item.grid is not None:
            item.on_device = _device_payload(read, destinations)
        lists.append([PieceTask(item, i, s, min(s + piece_bytes, n)) for i, s in enumerate(starts)])
        split_ids.add(id(batch))
    out = [lst[i] for i in range(max((len(lst) for lst in lists), default=0)) for lst in lists if i < len(lst)]
    return out + [b for b in batches if id(b) not in split_ids]


def through_pool(tasks: list) -> bool:
    """Whether some split item goes through pool pieces (then a thread takes its pieces first)."""
    return any(isinstance(t, PieceTask) and any(p.mode != DIRECT for p in t.item.read.pieces) for t in tasks)


def run_piece(worker, task: PieceTask) -> None:
    """Read one piece of a split item into its destinations (through a pool piece where one is not
    plain host memory), hash it, and check the item once its last piece is in."""
    item, read = task.item, task.item.read
    dests = worker.r.plan.destinations
    spans = []  # (destination piece, first payload byte, end) inside this task's range
    for p in read.pieces:
        lo, hi = max(task.start, p.payload_start), min(task.end, p.payload_end)
        if lo < hi:
            spans.append((p, lo, hi))
    path, payload_at = read.item.relative_path, read.item.offset_bytes + read.frame.prefix_bytes
    if all(p.mode == DIRECT for p, _, _ in spans):
        parts = [dests[p.dest].memory[p.dest_start + lo - p.payload_start:p.dest_start + hi - p.payload_start]
                 for p, lo, hi in spans]
        worker.readv(path, payload_at + task.start, parts)
        _feed(worker, item, task, parts)
    else:
        slot, t, mv = worker.buffer(task.end - task.start)
        worker.readv(path, payload_at + task.start, [mv])
        _feed(worker, item, task, [mv])
        worker.copy_spans([copies.Span(p.dest, p.dest_start + lo - p.payload_start, lo - task.start, hi - lo)
                           for p, lo, hi in spans], slot, t)
        if item.on_device is not None:
            item.events.append(_mark(worker, item.on_device.device))
    worker.r.count(nbytes=task.end - task.start)
    if not item.done():
        return
    if item.on_device is not None:
        worker.r.device_checks.add(item)
        return
    finish_item(worker, item)


def finish_item(worker, item: SplitItem) -> None:
    """Compare a split item's checksum, all its bytes in (for a device grid, its sums read back)."""
    read = item.read
    checked = item.hasher is not None or item.grid is not None
    if checked and item.value() != read.checksum.checksum:
        worker.check(read, _Mismatch())
    worker.r.count(items=1, verified=1 if checked else 0, unverified=0 if checked else 1,
                   nbytes=read.frame.prefix_bytes + read.frame.suffix_bytes)


class DeviceChecks:
    """The grid sums of split items whose whole payload lands in one GPU tensor, made on the device.

    Call order: `add` (any reader thread, once an item's last piece was copied), then `finish` (one
    thread, once every reader thread ended). The sums go on one check stream per device, never on
    a reader thread's copy stream: copies issued there after them would queue behind the other
    threads' copies of the item and the sums, and the thread would wait for that before reusing its
    pieces. `finish` reads every item's sums back in one copy per device and compares them.
    """

    def __init__(self, caller_streams: dict) -> None:
        self._caller_streams = caller_streams
        self._lock = threading.Lock()
        self._streams: dict = {}
        self._items: list = []  # (item, `_Grid.summed` of its payload)
        self.seconds = 0.0  # the time `finish` took, waiting for the device included

    def add(self, item: SplitItem) -> None:
        device = item.on_device.device
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = torch.cuda.Stream(device=device)
                stream.wait_stream(self._caller_streams[device])  # the caller's writes to the destinations
                self._streams[device] = stream
            for event in item.events:  # every piece's copy, whichever thread issued it
                stream.wait_event(event)
            with torch.cuda.stream(stream):
                self._items.append((item, item.grid.summed(item.on_device)))

    def finish(self, checker, compare: bool = True) -> None:
        """Compare every added item (``checker``: a reader thread's `finish_item` methods; its
        ``key`` names the item a failure is about); with ``compare`` false (the read failed) only
        wait for the sums."""
        t0 = time.perf_counter()
        failed = False
        try:
            for device, stream in self._streams.items() if compare else ():
                checker.key = None  # a failure reading this device's sums back is about no one item
                mine = [(item, data) for item, data in self._items if data.device == device]
                with torch.cuda.stream(stream):
                    host = torch.cat([data for _, data in mine]).cpu().numpy()  # waits for this stream alone
                at = 0
                for item, data in mine:
                    checker.key = item.read.fqn
                    item.grid.from_summed(host[at:at + data.numel()])
                    at += data.numel()
                    finish_item(checker, item)
            checker.key = None
        except BaseException:
            failed = True
            raise
        finally:
            self._items = []
            errors = []
            for stream in self._streams.values():  # the sums read the destinations: done before the caller has them
                try:
                    stream.synchronize()
                except Exception as exc:  # a device fault: every other stream still waited for
                    errors.append(exc)
            self.seconds += time.perf_counter() - t0
            if errors and not failed:  # never in place of the failure already on its way
                raise errors[0]


def _feed(worker, item: SplitItem, task: PieceTask, parts: list) -> None:
    t0 = time.perf_counter()  # hashing, and waiting for the pieces before this one where hashed in order
    item.feed(task.index, parts, task.start, worker.r.cancel)
    worker.hash_s += time.perf_counter() - t0


def _mark(worker, device):
    """An event after this thread's copies so far to ``device``."""
    event = torch.cuda.Event()
    event.record(worker.stream(device))
    return event


class _Mismatch:
    """A hasher whose value matches no checksum: `_Worker.check` then raises its mismatch error."""

    @staticmethod
    def value() -> None:
        return None
