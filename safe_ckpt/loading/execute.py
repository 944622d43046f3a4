"""Carrying out a read plan: a bounded pool of threads moving bytes from the source to the tensors.

One job: read every batch of a `plan.ReadPlan` into its destinations. Each thread takes the next
task (a large item's pieces first, `split`; then batches in file order) and:
- reads whole items bound for contiguous host tensors with one positioned call straight into
  their memory (the small archive bytes around them into scratch buffers in the same call);
- reads what goes to GPU tensors into its two pieces of the process-wide pinned pool, in turn
  (several items that lie back to back in one read of a piece), copied host-to-device on its
  own stream (`copies`), so the next read overlaps the copies; a piece is reused only once its
  copies have finished;
- reads strided overlaps (resharding across a non-leading axis, dtype conversion, tensor
  subclasses) as whole rows of the stored chunk into a piece, then copies the sub-box;
- checks each item's archive framing (`container`), decoding a non-standard archive with torch's
  weights-only loader, and hashes every item it reads whole where the manifest has a checksum
  (an item in one buffer with one call into the hash);
- once its tasks are done, waits for its copies; the device grid sums of the large items are
  compared once every thread is done (`split.DeviceChecks`).
The first failure stops the other threads; the caller votes on it, so every rank fails together.
Must not: talk to other ranks, allocate pinned memory outside the pool, or block on the device
beyond the copies it issued.
"""
from __future__ import annotations

import logging
import threading
import time
from time import thread_time

import torch

from .. import integrity
from ..errors import INTERRUPTS, RankFailure, ReadError, failure_from_exception
from .. import cuda_driver
from . import boxes, container, copies, split
from .plan import DIRECT, FLAT, Batch, ItemRead, ReadPlan
from .report import ReadReport, Tally

log = logging.getLogger("safe_ckpt")

HASH_PIECE_BYTES = 4 << 20  # a checksummed whole item is read and hashed this much at a time, while in cache


def _where(source, read: ItemRead) -> str:
    return f"{source.describe(read.item.relative_path)} at offset {read.item.offset_bytes} (key {read.fqn!r})"


def _index(box: boxes.Box) -> tuple:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


class _Worker(copies.Copier):
    """One reader thread: its reads, checks and (through `copies.Copier`) its pieces and copies."""

    def __init__(self, reader: "Reader") -> None:
        super().__init__(reader)
        self.read_s = self.hash_s = 0.0
        self.key: str | None = None  # the item a failure now is about (one read may gather several)
        self.cpu0 = thread_time()

    def readv(self, path: str, offset: int, buffers: list) -> None:
        t0 = time.perf_counter()
        self.r.source.readv(path, offset, buffers)
        self.read_s += time.perf_counter() - t0

    def hash(self, hasher, data) -> None:
        t0 = time.perf_counter()
        hasher.update(data)
        self.hash_s += time.perf_counter() - t0

    def finish(self) -> None:
        """Wait for this thread's copies."""
        try:
            self.key = None
            self.finish_copies()
        finally:
            self.r.count(read_s=self.read_s, wait_s=self.wait_s, hash_s=self.hash_s, copy_s=self.copy_s,
                         cpu_s=thread_time() - self.cpu0)

    # ---- checksums ----------------------------------------------------------------------
    def hasher(self, read: ItemRead):
        if read.checksum is None:
            return None
        return self._checking(read, lambda: integrity.item_hasher(read.checksum, self.r.algorithm))

    def _checking(self, read: ItemRead, compute):
        """``compute()`` for an item whose manifest row agrees with the index, naming the item where
        its checksum cannot be computed here."""
        c = read.checksum
        if c.length_bytes != read.item.length_bytes:
            raise ReadError(f"{_where(self.r.source, read)}: the checksum manifest records {c.length_bytes} bytes "
                            f"for this item, the index {read.item.length_bytes}: the manifest does not belong to "
                            f"this checkpoint")
        try:
            return compute()
        except (RuntimeError, ValueError) as exc:
            raise ReadError(f"{_where(self.r.source, read)}: cannot check its checksum: {exc}; "
                            f"LoadOptions(verify_checksums=False) loads without checking") from None

    def check(self, read: ItemRead, hasher) -> None:
        self.compare(read, hasher.value())
        self.r.count(verified=1)

    def compare(self, read: ItemRead, value) -> None:
        if value != read.checksum.checksum:
            raise ReadError(f"{_where(self.r.source, read)}: checksum mismatch: the stored bytes differ from what was "
                            f"saved (corrupted or modified since); restore the file or re-save. "
                            f"LoadOptions(verify_checksums=False) skips the check")

    def verify(self, read: ItemRead, data) -> bool:
        """Check an item read whole into one buffer, in one call into the hash; False where the
        manifest has no checksum for it. The caller counts it verified."""
        if read.checksum is None:
            return False
        t0 = time.perf_counter()
        value = self._checking(read, lambda: integrity.item_checksum(read.checksum, self.r.algorithm, data))
        self.hash_s += time.perf_counter() - t0
        self.compare(read, value)
        return True

    # ---- the three ways an item travels -------------------------------------------------
    def run(self, batch: Batch) -> None:
        first = batch.items[0]
        self.key = first.fqn
        whole = all(read.whole for read in batch.items)  # the planner batches whole items only
        hashed_big = len(batch.items) == 1 and first.checksum is not None \
            and first.item.length_bytes > HASH_PIECE_BYTES
        all_direct = all(p.mode == DIRECT for read in batch.items for p in read.pieces)
        if whole and all_direct and not hashed_big:
            self.direct(batch)
        elif whole and not all_direct and (len(batch.items) > 1 or batch.length_bytes <= self.r.piece_bytes):
            self.buffered(batch)
        else:
            self.single(first)

    def direct(self, batch: Batch) -> None:
        """Whole items to contiguous host tensors: one call, payloads straight into the tensors."""
        dests = self.r.plan.destinations
        frames, parts, iov = [], [], []
        for read in batch.items:
            head, tail = bytearray(read.frame.prefix_bytes), bytearray(read.frame.suffix_bytes)
            mine = [dests[p.dest].memory[p.dest_start:p.dest_start + p.payload_end - p.payload_start]
                    for p in read.pieces]
            frames.append((head, tail))
            parts.append(mine)
            iov += [memoryview(head), *mine, memoryview(tail)]
        self.readv(batch.items[0].item.relative_path, batch.items[0].item.offset_bytes, iov)
        for read, (head, tail), mine in zip(batch.items, frames, parts):
            self.key = read.fqn
            self.finish_whole(read, head, tail, mine)

    def finish_whole(self, read: ItemRead, head, tail, payload_parts) -> None:
        if not container.payload_is_framed(read.frame, head, tail):
            self.decode(read)
            return
        hasher = self.hasher(read)
        if hasher is None:
            self.r.count(items=1, unverified=1, nbytes=read.item.length_bytes)
            return
        for part in (head, *payload_parts, tail):
            self.hash(hasher, part)
        self.check(read, hasher)
        self.r.count(items=1, nbytes=read.item.length_bytes)

    def buffered(self, batch: Batch) -> None:
        """Whole small items, some bound for the GPU: one read into a piece, then byte copies, issued
        together once every item's framing and checksum passed."""
        dests = self.r.plan.destinations
        slot, t, mv = self.buffer(batch.length_bytes)
        self.readv(batch.items[0].item.relative_path, batch.items[0].item.offset_bytes, [mv])
        at, spans, items, verified, nbytes = 0, [], 0, 0, 0
        for read in batch.items:
            self.key = read.fqn
            f, length = read.frame, read.item.length_bytes
            head, tail = mv[at:at + f.prefix_bytes], mv[at + length - f.suffix_bytes:at + length]
            if not container.payload_is_framed(f, head, tail):
                self.decode(read)
            else:
                verified += self.verify(read, mv[at:at + length])
                payload_at = at + f.prefix_bytes
                for p in read.pieces:
                    spans.append(copies.Span(p.dest, p.dest_start, payload_at + p.payload_start,
                                             p.payload_end - p.payload_start))
                items, nbytes = items + 1, nbytes + length
            at += length
        self.key = batch.items[0].fqn  # the copies are the whole read's
        self.copy_spans(spans, slot, t)
        self.r.count(items=items, verified=verified, unverified=items - verified, nbytes=nbytes)

    def single(self, read: ItemRead) -> None:
        """One item read in parts: its framing, then each piece (through the pool where needed)."""
        f = read.frame
        if f is None:
            self.decode(read)
            return
        path, base = read.item.relative_path, read.item.offset_bytes
        head, tail = bytearray(f.prefix_bytes), bytearray(f.suffix_bytes)
        self.readv(path, base, [memoryview(head)])
        self.readv(path, base + read.item.length_bytes - f.suffix_bytes, [memoryview(tail)])
        if not container.payload_is_framed(f, head, tail):
            self.decode(read)
            return
        hasher = self.hasher(read)
        if hasher is not None:
            hasher.update(head)
        cursor = [0]  # the payload hashed so far: only reads that continue it in order are hashed

        def feed(start: int, data) -> None:
            if hasher is not None and start == cursor[0]:
                self.hash(hasher, data)
                cursor[0] += data.nbytes

        payload_at = base + f.prefix_bytes
        dests = self.r.plan.destinations
        read_bytes = f.prefix_bytes + f.suffix_bytes
        for p in read.pieces:
            dest = dests[p.dest]
            if p.mode == DIRECT:
                step = HASH_PIECE_BYTES if hasher is not None else p.payload_end - p.payload_start
                for start in range(p.payload_start, p.payload_end, max(step, 1)):
                    n = min(step, p.payload_end - start)
                    at = p.dest_start + start - p.payload_start
                    m = dest.memory[at:at + n]
                    self.readv(path, payload_at + start, [m])
                    feed(start, m)
                    read_bytes += n
            elif p.mode == FLAT:
                for start in range(p.payload_start, p.payload_end, self.r.piece_bytes):
                    n = min(self.r.piece_bytes, p.payload_end - start)
                    slot, t, mv = self.buffer(n)
                    self.readv(path, payload_at + start, [mv])
                    self.copy_spans([copies.Span(p.dest, p.dest_start + start - p.payload_start, 0, n)], slot, t)
                    feed(start, mv)
                    read_bytes += n
            else:
                read_bytes += self.strided(read, p, payload_at, feed)
        verified = hasher is not None and cursor[0] == f.payload_bytes
        if verified:
            hasher.update(tail)
            self.check(read, hasher)
        self.r.count(items=1, unverified=0 if verified else 1, nbytes=read_bytes)

    def strided(self, read: ItemRead, p, payload_at: int, feed) -> int:
        """Whole rows of the stored chunk through a buffer, then a strided (and converting) copy."""
        dest = self.r.plan.destinations[p.dest]
        itemsize = read.dtype.itemsize
        if not read.sizes:  # a 0-dim tensor: its one element
            slot, t, mv = self.buffer(itemsize)
            self.readv(read.item.relative_path, payload_at, [mv])
            feed(0, mv)
            self.copy(dest.view, t[:itemsize].view(read.dtype).view(()), slot)
            return itemsize
        row = boxes.row_elements(read.sizes) * itemsize
        rows = max(1, self.r.piece_bytes // max(row, 1))
        first, end = p.in_chunk.offsets[0], p.in_chunk.offsets[0] + p.in_chunk.sizes[0]
        inner_src = _index(boxes.Box(p.in_chunk.offsets[1:], p.in_chunk.sizes[1:]))
        inner_dst = _index(boxes.Box(p.in_dest.offsets[1:], p.in_dest.sizes[1:]))
        moved = 0
        for r in range(first, end, rows):
            k = min(rows, end - r)
            slot, t, mv = self.buffer(k * row)
            self.readv(read.item.relative_path, payload_at + r * row, [mv])
            feed(r * row, mv)
            src = t[:k * row].view(read.dtype).view((k, *read.sizes[1:]))[(slice(None), *inner_src)]
            d0 = p.in_dest.offsets[0] + r - first
            self.copy(dest.view[(slice(d0, d0 + k), *inner_dst)], src, slot)
            moved += k * row
        return moved

    def decode(self, read: ItemRead) -> None:
        """The general path: the whole item through torch's weights-only loader, then sub-box copies."""
        data = bytearray(read.item.length_bytes)
        self.readv(read.item.relative_path, read.item.offset_bytes, [memoryview(data)])
        verified = self.verify(read, data)
        if verified:
            self.r.count(verified=1)
        tensor = container.decode_chunk(data, _where(self.r.source, read), read.sizes)
        dests = self.r.plan.destinations
        for p in read.pieces:
            self.copy(dests[p.dest].view[_index(p.in_dest)], tensor[_index(p.in_chunk)], None)
        self.r.count(items=1, decoded=1, unverified=0 if verified else 1, nbytes=len(data))


class Reader:
    """Reads one plan with ``threads`` threads; `run` returns (report, first failure or None)."""

    def __init__(self, source, plan: ReadPlan, *, rank: int, threads: int, piece_bytes: int, pool,
                 algorithm: str, timeout_s: float, progress_interval_s: float = 0.0) -> None:
        self.source = source
        self.plan = plan
        self.rank = rank
        self.threads, self.tasks, self.pieces_first = max(1, threads), [], False  # pieces_first: see `run`
        self.piece_bytes = piece_bytes
        self.pool = pool  # () -> PinnedPool, called on the first read that needs a piece
        self.algorithm = algorithm
        self.timeout_s = timeout_s
        self.progress_interval_s = progress_interval_s
        self.cancel = threading.Event()
        self.caller_streams = {}
        self.device_checks = split.DeviceChecks(self.caller_streams)
        self.driver_copies = False  # host-to-device copies through the CUDA driver (`copies`)
        if torch.cuda.is_available():
            self.driver_copies = cuda_driver.htod_copies_available()
            for d in plan.destinations:
                if d.view.device.type == "cuda" and d.view.device not in self.caller_streams:
                    self.caller_streams[d.view.device] = torch.cuda.current_stream(d.view.device)
        self._lock = threading.Lock()
        self._next = 0
        self._done = 0  # tasks finished without an error
        self.tally = Tally()
        self.count = self.tally.add
        self._failure: RankFailure | None = None

    def _progress(self, t0: float) -> None:
        """A log line for a long read (every `progress_interval_s`)."""
        if not self.progress_interval_s:
            return
        done, total, took = self.tally.counts["nbytes"], self.plan.payload_bytes, time.perf_counter() - t0
        log.info("rank %d read %.2f of %.2f GiB in %.0f s (%.2f GiB/s) from %s", self.rank, done / 2**30,
                 total / 2**30, took, done / took / 2**30 if took else 0.0, self.source.root)

    def _fail(self, key: str | None, exc: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                kind_exc = exc if isinstance(exc, (ReadError, *INTERRUPTS)) else \
                    ReadError(f"{type(exc).__name__}: {exc}")
                self._failure = failure_from_exception(self.rank, "read", kind_exc, key=key)
        self.cancel.set()

    def _loop(self) -> None:
        worker = None
        try:
            worker = _Worker(self)
            if self.pieces_first:  # a thread waiting for pool memory then holds no piece another's hash waits for
                worker.take_pieces()
            while not self.cancel.is_set():
                with self._lock:
                    i, self._next = self._next, self._next + 1
                if i >= len(self.tasks):
                    break
                task = self.tasks[i]
                piece = isinstance(task, split.PieceTask)
                try:
                    split.run_piece(worker, task) if piece else worker.run(task)
                    with self._lock:
                        self._done += 1
                except BaseException as exc:
                    self._fail(task.fqn if piece else worker.key or task.items[0].fqn, exc)
                    if piece:
                        with task.item.cond:  # a thread waiting for this piece stops now
                            task.item.cond.notify_all()
                    break
        except BaseException as exc:  # waiting for pool pieces: timed out or cancelled
            self._fail(None, exc)
        finally:
            try:
                if worker is not None:
                    worker.finish()
            except BaseException as exc:
                self._fail(worker.key, exc)

    def run(self) -> tuple[ReadReport, RankFailure | None]:
        t0 = time.perf_counter()
        workers: list = []
        try:
            self.tasks = split.tasks(self.plan.batches, self.source, piece_bytes=self.piece_bytes,
                                     threads=self.threads, algorithm=self.algorithm,
                                     destinations=self.plan.destinations)
            self.threads = max(1, min(self.threads, len(self.tasks)))
            self.pieces_first = split.through_pool(self.tasks)
            workers = [threading.Thread(target=self._loop, name=f"safe_ckpt-read-{i}", daemon=True)
                       for i in range(self.threads)]
            for w in workers:
                w.start()
            next_line = t0 + self.progress_interval_s
            for w in workers:
                while w.is_alive():
                    w.join(max(0.0, next_line - time.perf_counter()) if self.progress_interval_s else None)
                    now = time.perf_counter()
                    if self.progress_interval_s and now >= next_line and w.is_alive():
                        self._progress(t0)  # only once a whole interval passed, not as each thread ends
                        missed = (now - next_line) // self.progress_interval_s  # one line after a stall, no burst
                        next_line += (missed + 1) * self.progress_interval_s
                        next_line += self.progress_interval_s if next_line <= now else 0.0  # float rounding
        except BaseException as exc:  # an interrupt: stop the readers, then report it like theirs
            self._fail(None, exc)
            for w in workers:
                w.join()
        finally:
            checker = _Worker(self)
            try:  # also after an interrupt: the sums still read the destinations until waited for
                self.device_checks.finish(checker, compare=self._failure is None)
            except BaseException as exc:
                self._fail(checker.key, exc)
            self.count(check_s=self.device_checks.seconds)
        if self._failure is None and self._done != len(self.tasks):  # a reader ended without saying why
            self._fail(None, ReadError(f"the reader threads ended with {len(self.tasks) - self._done} of "
                                       f"{len(self.tasks)} reads not done; nothing they were to fill was loaded"))
        return self.tally.report(self.threads, time.perf_counter() - t0), self._failure
