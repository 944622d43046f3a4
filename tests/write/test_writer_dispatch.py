"""The writers' dispatch: staging order, one writer per file at a time, last-item detection;
and, through a real save, that a slow writer thread does not hold back the files it touched."""

import random
import threading
import time

import pytest
import torch

import safe_ckpt
from safe_ckpt.sinks.posix import PosixSink
from safe_ckpt.staging.dispatch import Dispatch
from safe_ckpt_lab.synthetic import bits_equal
from tests.helpers.hooked_sinks import HookedSink


def test_one_writer_takes_entries_in_staging_order():
    d = Dispatch([2, 1, 2])
    for i, f in enumerate([0, 1, 2, 0, 2]):
        d.put(f, i)
    d.close()
    seen, last = [], []
    while (e := d.take()) is not None:
        seen.append(e.payload)
        last.append(d.done(e))
    assert seen == [0, 1, 2, 3, 4]
    assert last == [False, True, False, True, True]


def test_a_busy_file_is_skipped_until_its_writer_is_done():
    d = Dispatch([2, 1])
    d.put(0, "a0")
    d.put(0, "a1")
    d.put(1, "b0")
    first = d.take()
    second = d.take()  # a0's file is busy: b0 jumps the queue
    assert (first.payload, second.payload) == ("a0", "b0")
    got = []
    waiter = threading.Thread(target=lambda: got.append(d.take()))
    waiter.start()  # only a1 is pending, and its file is busy: it must wait
    time.sleep(0.1)
    assert waiter.is_alive() and not got
    assert d.done(first) is False
    waiter.join(5)
    assert got[0].payload == "a1"
    assert d.done(second) is True and d.done(got[0]) is True
    d.close()
    assert d.take() is None


def test_put_refuses_after_close_and_beyond_a_files_items():
    d = Dispatch([1])
    with pytest.raises(ValueError, match="file 0"):
        Dispatch([0]).put(0, "x")
    d.close()
    with pytest.raises(RuntimeError, match="closed"):
        d.put(0, "x")


def test_many_writers_never_share_a_file_and_each_file_ends_once():
    rng = random.Random(3)
    counts = [rng.randint(1, 12) for _ in range(9)]
    order = [f for f, n in enumerate(counts) for _ in range(n)]
    rng.shuffle(order)
    d = Dispatch(counts)
    lock = threading.Lock()
    active, taken, ended, clash = set(), [], [], []

    def writer(seed):
        r = random.Random(seed)
        while (e := d.take()) is not None:
            with lock:
                if e.file_index in active:
                    clash.append(e.file_index)
                active.add(e.file_index)
                taken.append(e.payload)
            time.sleep(r.random() * 0.002)
            with lock:
                active.discard(e.file_index)
            if d.done(e):
                with lock:
                    ended.append(e.file_index)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for k, f in enumerate(order):
        d.put(f, k)
        if k % 7 == 0:
            time.sleep(0.001)
    d.close()
    for t in threads:
        t.join(30)
    assert not clash
    assert sorted(taken) == list(range(len(order)))
    assert sorted(ended) == list(range(len(counts)))


class _SlowThreadSink(HookedSink):
    """Writes from one named writer thread take 30 ms longer (a writer on a busy core)."""

    slow_thread = "safe_ckpt-write-0"

    def __init__(self, root):
        super().__init__(root)
        self.by_thread = {}
        self.lock = threading.Lock()

    def before_write(self):
        name = threading.current_thread().name
        with self.lock:
            self.by_thread[name] = self.by_thread.get(name, 0) + 1
        if name == self.slow_thread:
            time.sleep(0.03)


def test_a_slow_writer_thread_writes_fewer_items_and_every_byte_lands(tmp_path):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(11)
    tensors = {f"w{i}": torch.randn(64, 64, generator=g) for i in range(24)}  # 16 KiB each: one item
    state = {k: ShardedTensor(k, v, v.dtype, tuple(v.shape), tuple(v.shape), (0, 0), axis_fragmentations=None)
             for k, v in tensors.items()}
    sinks = []

    def factory(root):
        sinks.append(_SlowThreadSink(root))
        return sinks[0]

    path = str(tmp_path / "ck")
    safe_ckpt.save(state, path, options=safe_ckpt.SaveOptions(io_threads=3, chunk_bytes=16 * 1024,
                                                              progress_interval_s=0, sink_factory=factory))
    counts = sinks[0].by_thread
    fair = sum(counts.values()) / 3
    # bound to its two files, the slow writer would write exactly its third; the others drain
    # every file it does not hold while it sleeps (it keeps winning back the one it holds)
    assert counts.get(_SlowThreadSink.slow_thread, 0) < fair, counts
    out = {k: torch.empty_like(v) for k, v in tensors.items()}
    dcp.load(out, checkpoint_id=path, no_dist=True)
    assert all(bits_equal(out[k], v) for k, v in tensors.items())


def test_staging_order_advances_every_file_at_the_same_rate():
    """A file of many small items is not left behind by files of few large ones."""
    from safe_ckpt.encoding.layout import FileSpec, PlacedItem, RankLayout
    from safe_ckpt.write.pipeline import RankWork, RankWriter
    from safe_ckpt.write.progress import Progress

    def file(name, lengths):
        items, at = [], 0
        for k, n in enumerate(lengths):
            items.append(PlacedItem(f"{name}{k}", name, at, n))
            at += n
        return FileSpec(name, at, items)

    files = [file("a", [400, 400]), file("b", [100] * 8)]
    work = RankWork(RankLayout(0, files), [], [], [], {}, {})
    writer = RankWriter(work, sink=None, stager=None, crc32=False, progress=Progress(0, 0, 0), lanes=2)
    order = [item.fqn for _, item in writer._interleaved()]
    assert order == ["a0", "b0", "b1", "b2", "b3", "a1", "b4", "b5", "b6", "b7"]


class _CloseFailsSink(PosixSink):
    """The first file closed reports an I/O error (as a close on NFS can, for a failed write-back)."""

    def __init__(self, root):
        super().__init__(root, fsync=False)
        self.closed = 0

    def open(self, relative_path, size_bytes):
        inner = super().open(relative_path, size_bytes)
        sink, real_close = self, inner.close

        def close():
            real_close()
            sink.closed += 1
            if sink.closed == 1:
                raise OSError(5, "injected EIO on close")

        inner.close = close
        return inner


@pytest.mark.parametrize("io_threads", [1, 3])
def test_an_error_closing_a_file_fails_the_save_and_commits_nothing(tmp_path, io_threads):
    """One writer holds two files: had the error ended its thread, the second file's items
    would be missing from a checkpoint that committed anyway."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    g = torch.Generator().manual_seed(12)
    tensors = {f"w{i}": torch.randn(64, 64, generator=g) for i in range(24)}
    state = {k: ShardedTensor(k, v, v.dtype, tuple(v.shape), tuple(v.shape), (0, 0), axis_fragmentations=None)
             for k, v in tensors.items()}
    path = tmp_path / "ck"
    with pytest.raises(safe_ckpt.CheckpointError, match="EIO on close"):
        safe_ckpt.save(state, str(path), options=safe_ckpt.SaveOptions(
            io_threads=io_threads, chunk_bytes=16 * 1024, progress_interval_s=0, collective_timeout_s=30,
            sink_factory=_CloseFailsSink))
    assert not (path / ".metadata").exists()
    # the pool is free again: the next save of the same state succeeds and loads bit-exact
    safe_ckpt.save(state, str(path), options=safe_ckpt.SaveOptions(io_threads=io_threads, chunk_bytes=16 * 1024,
                                                                   progress_interval_s=0))
    import torch.distributed.checkpoint as dcp
    out = {k: torch.empty_like(v) for k, v in tensors.items()}
    dcp.load(out, checkpoint_id=str(path), no_dist=True)
    assert all(bits_equal(out[k], v) for k, v in tensors.items())


@pytest.mark.parametrize("refused", ["safe_ckpt-write", "safe_ckpt-stage"])
def test_a_thread_that_cannot_start_fails_the_save_and_gives_every_lease_back(tmp_path, monkeypatch, refused):
    """The process's thread limit met while a save starts its writers (or its stager): the save
    fails on its rank with the error, commits nothing, hangs nowhere, and leaves the shared pool
    as it found it, so the next save succeeds."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from safe_ckpt.staging.pool import shared_pool

    g = torch.Generator().manual_seed(13)
    # transposed: runs of 4 bytes, so each chunk is copied into a pool lease by the stager
    tensors = {f"w{i}": torch.randn(96, 96, generator=g).t() for i in range(6)}
    state = {k: ShardedTensor(k, v, v.dtype, tuple(v.shape), tuple(v.shape), (0, 0), axis_fragmentations=None)
             for k, v in tensors.items()}
    opts = safe_ckpt.SaveOptions(io_threads=2, chunk_bytes=16 * 1024, staging_budget_bytes=1 << 20,
                                 progress_interval_s=0, collective_timeout_s=30)
    start = threading.Thread.start

    def refuse(self):
        if self.name.startswith(refused):
            raise RuntimeError("can't start new thread")
        return start(self)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    path = tmp_path / "ck"
    with pytest.raises(safe_ckpt.CheckpointError, match="can't start new thread"):
        safe_ckpt.save(state, str(path), options=opts)
    monkeypatch.setattr(threading.Thread, "start", start)
    assert not (path / ".metadata").exists()
    assert shared_pool(opts.staging_budget_bytes).stats().leased_bytes == 0
    safe_ckpt.save(state, str(path), options=opts)
    import torch.distributed.checkpoint as dcp
    out = {k: torch.empty(v.shape) for k, v in tensors.items()}
    dcp.load(out, checkpoint_id=str(path), no_dist=True)
    assert all(bits_equal(out[k], v.contiguous()) for k, v in tensors.items())
