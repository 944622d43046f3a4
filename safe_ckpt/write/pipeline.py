"""One rank's write phase: stage → container → sink, pipelined.

One job: write every item of this rank's layout. A staging thread walks the items
(interleaved across files so every writer has work) and brings each payload to host
memory: host chunks as views of their own memory, device chunks through the pinned
pool. Writer threads take the staged items in order, each the first one whose file no
other writer is writing (`staging.dispatch`), wrap it in its container and write prefix,
payload and suffix with one vectored write (`item_writes`, which also keeps the item's
checksum); whoever writes a file's last item fsyncs it.
While a writer writes chunk k, later chunks are already being copied.

Small device chunks on average: the writers start once the last device copy is issued (or when the
full pool needs writes to free it), since issuing many small copies while writers compete for the
GIL is slow; large chunks: at once. Figures: benchmarks/results/HISTORY.md. An async save's host
gate (`window`) is told of each host chunk written; one that returns right after planning stages
through its copy window instead (`overlap`: `window_staging`).

Must not: decide what goes where (the layout did), talk to other ranks, or publish.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
import time

from ..encoding import torchzip
from ..encoding.integrity_manifest import FileDigests
from ..encoding.layout import PlacedItem
from ..errors import CheckpointError, StagingTimeoutError
from ..integrity import ItemChecksum, checksum_of
from .item_writes import ItemWriteFailed, ItemWrites, modified_while_written
from .progress import Progress
from .work import RankWork, WriteStats
from ..residence.classify import HOST_RESIDENCES, Residence
from ..sinks.base import Sink
from ..host import cpu
from ..host.cpu import checksum_threads as _checksum_threads, lower_thread_priority
from ..staging.dispatch import Dispatch
from ..staging.stager import Stager, StagedChunk
from ..staging.views import chunk_view

log = logging.getLogger(__name__)

# Host sources an asynchronous save hashes twice (before and after writing) to catch a caller
# changing them meanwhile. torch_memory_saver's CPU backup among them: its resume frees the
# backup by default, but with the backup retained (`TMS_RETAIN_CPU_BACKUP`) a resume, a step and a
# pause during the save rewrite it in place at the same address, which only the second hash sees.
RECHECKED_RESIDENCES = HOST_RESIDENCES

# Device chunks at least this large on average: the writers start at once (see above).
EARLY_WRITERS_MIN_CHUNK_BYTES = 16 << 20


class RankWriter:
    """Runs the write phase in background threads; `join()` returns stats or raises."""

    def __init__(self, work: RankWork, sink: Sink, stager: Stager, *, crc32: bool, progress: Progress,
                 checksums: bool = False, lanes: int | None = None, checksum_threads: int | None = None,
                 whole_writes: bool = False, nice: int | None = None, recheck_host_sources: bool = False,
                 file_digests: bool = False) -> None:
        """``whole_writes``: the sink takes each item in one `write_at` (kvstore values);
        ``file_digests``: keep every written file's SHA-256 (Megatron's integrity manifest);
        ``nice``: how much nicer the writer threads run (None: `cpu.WRITER_NICE_INCREMENT`);
        ``recheck_host_sources``: the caller may change host sources while they are written
        (an async save): hash each one written from its own memory before and after its write."""
        self.work = work
        self.checksums = checksums
        sizes = {**{f.relative_path: f.size_bytes for f in work.layout.files},
                 **{name: len(data) for name, data in work.whole_files.items()}}
        self._digests = FileDigests(sizes) if file_digests else None
        self._writes = ItemWrites(checksums, whole_writes, self._digests)
        self.sink = sink
        self.stager = stager
        self.crc32 = crc32
        self.progress = progress
        self._abort = threading.Event()
        self._staged = threading.Event()
        self._writers_go = threading.Event()
        self._errors: list[ItemWriteFailed] = []
        self._lock = threading.Lock()
        files = work.layout.files
        self._lanes = max(1, min(lanes or len(files), len(files)))  # writer threads
        self._dispatch = Dispatch([len(f.items) for f in files])
        self._handles: list = [None] * len(files)  # open files (one writer at a time each)
        self._checksum_threads = _checksum_threads(checksum_threads, self._lanes) if checksums or file_digests else 0
        self._nice = nice
        self._recheck = recheck_host_sources
        self._files_finished = 0  # files whose last item was written (then synced and closed)
        self._threads: list[threading.Thread] = []
        self._t0 = 0.0
        self._staged_at = 0.0
        self._residence_bytes: dict[str, int] = {}
        self.window = None  # an async save's host gate (`staging.host_gate`), or its copy window
        self.overlap = None  # `window_staging.WindowStaging`: staging through the copy window

    # ----------------------------------------------------------------- control
    def start(self) -> None:
        self._t0 = time.perf_counter()
        if self.overlap is not None:  # opens the window in this thread now, or at the next trigger
            self.overlap.begin(self)
        if self._checksum_threads and self.work.layout.files:
            self._writes.hasher = ThreadPoolExecutor(self._checksum_threads, thread_name_prefix="safe_ckpt-sum")
        # The stager first: until the first copies are issued no writer has anything to write.
        self._threads.append(threading.Thread(target=self._stage_all, name="safe_ckpt-stage", daemon=True))
        if self.work.layout.files:
            for lane in range(self._lanes):
                self._threads.append(threading.Thread(target=self._writer_thread, name=f"safe_ckpt-write-{lane}",
                                                      daemon=True))
        for t in self._threads:
            try:
                t.start()
            except BaseException as exc:  # e.g. the process's thread limit: the save fails through the vote
                self.fail(None, exc)
                break
        self._threads = [t for t in self._threads if t.ident is not None]
        if not self._threads:  # not even the stager: nothing is staged, nobody may wait for it
            if self.overlap is not None:
                self.overlap.abandon()
            self._writers_go.set()
            self._mark_staged()
            self._dispatch.close()

    def wait_staged(self, timeout_s: float | None = None) -> bool:
        return self._staged.wait(timeout_s)

    def cancel(self) -> None:
        self._abort.set()
        if self.window is not None:
            self.window.fail(CheckpointError("the save was cancelled"))
        if self.overlap is not None:
            self.overlap.abandon()

    def join(self) -> WriteStats:
        for t in self._threads:
            t.join()
        if self.work.layout.files and not any(t.name.startswith("safe_ckpt-write") for t in self._threads):
            self._write_loop()  # no writer started: give back what was staged (the failure writes nothing)
        for index, handle in enumerate(self._handles):  # left open by a failure: not synced
            if handle is not None:
                self._handles[index] = None
                try:
                    handle.close()
                except Exception as exc:  # the save already failed; the first error is the one to report
                    log.debug("closing an abandoned file failed: %s", exc)
        if self._writes.hasher is not None:
            self._writes.hasher.shutdown(wait=True)
        try:  # closes the host gate (untracked); its abandonment is the cause of what followed
            if self.window is not None:
                self.window.settle()
        except StagingTimeoutError as exc:
            self._errors.insert(0, ItemWriteFailed(None, exc))
        except BaseException as exc:
            self._errors or self.fail(None, exc)
        files = len(self.work.layout.files)
        if not self._errors and self._files_finished != files:  # a writer gone without a word
            self.fail(None, CheckpointError(f"internal error: {files - self._files_finished} of {files} data files "
                                             "were never finished; nothing is published"))
        if not self._errors:
            try:
                for name, data in self.work.whole_files.items():
                    self.sink.write_file(name, data)
                    if self._digests is not None:
                        self._digests.update(name, 0, [data])
                    if self.checksums:
                        self._writes.record(ItemChecksum(name, 0, len(data), checksum_of([data]), name))
            except BaseException as exc:
                self.fail(name, exc)
        digests = {}
        if not self._errors and self._digests is not None:
            try:
                digests = self._digests.digests()
            except BaseException as exc:
                self.fail(None, exc)
        if self._errors:
            raise self._errors[0]
        files = [f.relative_path for f in self.work.layout.files] + list(self.work.whole_files)
        return WriteStats(
            payload_bytes=sum(self._residence_bytes.values()),
            file_bytes=self.work.layout.file_bytes + sum(len(d) for d in self.work.whole_files.values()),
            bytes_by_residence=dict(self._residence_bytes),
            device_bytes=self.stager.device_bytes if self.overlap is None else self.window.stats().copied_bytes,
            staged_s=self._staged_at - self._t0 if self._staged_at else 0.0,
            written_s=time.perf_counter() - self._t0,
            files=files,
            checksums=self._writes.recorded(),
            file_digests=digests,
        )

    def fail(self, key: str | None, exc: BaseException, first_only: bool = False) -> None:
        """Note a failure (``first_only``: only if none was noted yet) and stop the save's work."""
        with self._lock:
            if first_only and self._errors:
                return
            self._errors.append(ItemWriteFailed(key, exc))
        self._abort.set()
        if self.window is not None:  # every step waiting at the gate goes on at once
            self.window.fail(exc)
        if self.overlap is not None:
            self.overlap.abandon()

    def release_writers(self) -> None:
        self._writers_go.set()

    def hand_on(self, file_index: int, item: PlacedItem, staged) -> None:
        self._dispatch.put(file_index, (item, staged))

    def staging_done(self) -> None:
        self._mark_staged()
        self._dispatch.close()

    # ----------------------------------------------------------------- staging
    def _interleaved(self):
        """(file index, item) in staging order: by where the item starts as a fraction of its
        file, so every file advances at the same rate and none is left with most of its items
        when the others are done (only its one writer at a time could then write them)."""
        entries = [(item.offset_bytes / max(1, f.size_bytes), i, item)
                   for i, f in enumerate(self.work.layout.files) for item in f.items]
        entries.sort(key=lambda e: (e[0], e[1]))
        return [(i, item) for _, i, item in entries]

    def _on_device(self, item: PlacedItem) -> bool:
        return item.chunk is not None and self.work.residences[item.chunk.local_index] == Residence.CUDA.value

    def _mark_staged(self) -> None:
        if not self._staged.is_set():
            self._staged_at = time.perf_counter()
            self._staged.set()

    def _stage_all(self) -> None:
        if self.overlap is not None:
            self.overlap.stage_all()
            return
        waiter = None
        try:
            entries = list(self._interleaved())
            device = [k for k, (_, item) in enumerate(entries) if self._on_device(item)]
            last_device = device[-1] if device else -1
            if last_device < 0:
                self._writers_go.set()
                self._mark_staged()
            elif self.large_chunks([entries[k][1] for k in device]):
                self._writers_go.set()
            for k, (file_index, item) in enumerate(entries):
                if self._abort.is_set():
                    break
                try:
                    staged = self._stage(item)
                except BaseException as exc:
                    self.fail(item.fqn, exc)
                    break
                self._dispatch.put(file_index, (item, staged))
                if k == last_device:
                    self._writers_go.set()
                    self.stager.flush_sums()
                    # Host items keep flowing to the writers while the last copies land.
                    waiter = threading.Thread(target=self._await_device_copies, name="safe_ckpt-staged", daemon=True)
                    waiter.start()
        except BaseException as exc:
            self.fail(None, exc)
        finally:
            if self._abort.is_set():
                self.stager.drop_sums()  # the writers only release what is left
            self._writers_go.set()
            if waiter is not None:
                waiter.join()
            else:
                self._await_device_copies()  # a failure before the last device chunk: let issued copies land
            self._dispatch.close()

    @staticmethod
    def large_chunks(device_items: list[PlacedItem]) -> bool:
        payload = sum(item.chunk.payload_bytes for item in device_items)
        return payload >= EARLY_WRITERS_MIN_CHUNK_BYTES * len(device_items)

    def _await_device_copies(self) -> None:
        """Every device-to-host copy issued so far has landed (or failed): async_save may return."""
        try:
            self.stager.wait_copies()
        except BaseException as exc:
            self.fail(None, exc)
        finally:
            self._mark_staged()

    def _stage(self, item: PlacedItem):
        if item.obj is not None:
            return self.work.object_payloads[item.fqn]
        chunk = item.chunk
        source = self.work.sources[chunk.local_index]
        # A full pool is emptied only by writing: let the writers start before waiting for it.
        # Held-back writers wait for the copies only: their sums follow once they start.
        return self.stager.stage(chunk_view(source, chunk.shard_box.offsets, chunk.shard_box.sizes), self._abort,
                                 on_wait=self._writers_go.set, defer_sums=not self._writers_go.is_set())

    # ----------------------------------------------------------------- writing
    def _writer_thread(self) -> None:
        try:
            lower_thread_priority(cpu.WRITER_NICE_INCREMENT if self._nice is None else self._nice)
        except Exception as exc:  # a priority left as it was must not cost the save a writer
            log.warning("writer thread kept its priority: %s", exc)
        self._write_loop()

    def _write_loop(self) -> None:
        """Take staged items until none are left; open a file at its first item, and sync and
        close it after its last. Never leaves early: a writer gone while items remain would
        leave them unwritten (and their leases held) with nothing to say so."""
        self._writers_go.wait()
        while True:
            entry = self._dispatch.take()
            if entry is None:
                break
            item, staged = entry.payload
            index = entry.file_index
            written = False
            try:
                handle = self._handles[index]
                if handle is None and not self._abort.is_set():
                    handle = self._handles[index] = self._open_file(index)
                if self.window is not None and self.window.error is not None:
                    raise self.window.error  # the save was abandoned at the gate: stop writing it
                if handle is not None and not self._abort.is_set():
                    written = True  # _write_item releases the lease, whatever happens
                    self._write_item(handle, item, staged)
            except BaseException as exc:
                self.fail(item.fqn, exc)
            finally:
                if not written and isinstance(staged, StagedChunk):
                    staged.release()
                if self._dispatch.done(entry):
                    self._finish_file(index)

    def _open_file(self, file_index: int):
        spec = self.work.layout.files[file_index]
        try:
            return self.sink.open(spec.relative_path, spec.size_bytes)
        except BaseException as exc:
            self.fail(None, exc)
            return None

    def _finish_file(self, file_index: int) -> None:
        with self._lock:
            self._files_finished += 1
        handle, self._handles[file_index] = self._handles[file_index], None
        if handle is None:
            return
        try:
            if not self._abort.is_set():
                handle.sync()
        except BaseException as exc:
            self.fail(None, exc)
        try:
            handle.close()
        except BaseException as exc:  # a close can report a failed write-back (NFS, EIO)
            self.fail(None, exc)

    def _write_item(self, handle, item: PlacedItem, staged) -> None:
        if item.obj is not None:
            self._writes.write(handle, item, [staged])
            self._account("object", len(staged))
            return
        chunk = item.chunk
        try:
            container = torchzip.tensor_container(chunk.dtype, chunk.global_box.sizes, crc32=self.crc32)
            if container.total_bytes != item.length_bytes:
                raise CheckpointError(
                    f"internal error: container of {container.total_bytes} bytes for a slot of {item.length_bytes}"
                )
            payload = staged.ready()
            crc = torchzip.payload_crc32(payload) if self.crc32 else 0
            sums = staged.grid() if self.checksums else None
            residence = self.work.residences[chunk.local_index]
            own_memory = staged.from_source_memory
            recheck = self._recheck and residence in RECHECKED_RESIDENCES and own_memory
            unchanged = True
            if sums is not None:
                self._writes.write_gridded(handle, item, container.prefix, payload[0], sums, container.suffix(crc))
            else:
                unchanged = self._writes.write(handle, item, [container.prefix, *payload, container.suffix(crc)],
                                               recheck=recheck)
        finally:
            staged.release()
        # A chunk staged through the copy window was checked when it was captured; its source may
        # legitimately change once the gate let the next step go, while its pool copy is written.
        if residence in HOST_RESIDENCES and (self.overlap is None or own_memory):
            source = self.work.sources[chunk.local_index]
            if not unchanged or source._version != self.work.versions[chunk.local_index]:
                raise modified_while_written(chunk.fqn, residence == Residence.OFFLOAD_BACKUP.value,
                                             "its bytes changed while they were written" if not unchanged
                                             else "its version counter moved")
            if self.window is not None and self.overlap is None:
                self.window.captured(chunk.local_index, chunk.payload_bytes)
        self._account(residence, chunk.payload_bytes)

    def _account(self, residence: str, nbytes: int) -> None:
        with self._lock:
            self._residence_bytes[residence] = self._residence_bytes.get(residence, 0) + nbytes
        self.progress.add(nbytes)
