"""One process, no torch.distributed: views, odd shapes, async source checks, SIGKILL mid-save."""

import multiprocessing
import importlib
import os
import signal
import time

import pytest
import torch

import safe_ckpt
from safe_ckpt.sinks.faults import Fault, FaultySink
from safe_ckpt.sinks.posix import PosixSink
from safe_ckpt_lab.synthetic import bits_equal


def _st(key, data, global_shape=None, offset=None, **kw):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    shape = tuple(data.shape)
    return ShardedTensor(key, data, data.dtype, shape, tuple(global_shape or shape), tuple(offset or (0,) * len(shape)),
                         axis_fragmentations=None, **kw)


def _dcp_load(path, shapes):
    import torch.distributed.checkpoint as dcp

    out = {k: torch.empty(s, dtype=d) for k, (s, d) in shapes.items()}
    dcp.load(out, checkpoint_id=path, no_dist=True)
    return out


def _opts(**kw):
    return safe_ckpt.SaveOptions(**{"chunk_bytes": 16 * 1024, "io_threads": 2, "progress_interval_s": 0, **kw})


def test_views_and_odd_shapes_without_distributed(tmp_path):
    g = torch.Generator().manual_seed(0)
    big = torch.randn(512, 256, generator=g)  # 512 KiB storage
    narrow = big[100:104]  # a view into the middle of it
    transposed = torch.randn(48, 64, generator=g).t()  # non-contiguous
    strided = torch.randn(64, 64, generator=g)[::2, ::4]
    scalar = torch.tensor(3.25, dtype=torch.float64)
    empty = torch.empty(0, 7)
    ints = torch.randint(-(2**40), 2**40, (33,), generator=g)
    state = {"narrow": _st("narrow", narrow), "t": _st("t", transposed), "s": _st("s", strided),
             "scalar": _st("scalar", scalar), "empty": _st("empty", empty), "ints": _st("ints", ints)}
    path = str(tmp_path / "ck")
    result = safe_ckpt.save(state, path, options=_opts())
    assert result.world_size == 1 and result.bytes_by_residence["pageable"] > 0
    loaded = _dcp_load(path, {k: (tuple(v.data.shape), v.data.dtype) for k, v in state.items()})
    for k, v in state.items():
        assert bits_equal(loaded[k], v.data), k
    data_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp"))
    payload = sum(v.data.numel() * v.data.element_size() for v in state.values())
    # only the chunks' bytes go in: no whole storage behind a view
    assert payload <= data_bytes < payload + 64 * 1024
    assert data_bytes < big.numel() * 4


def test_async_save_detects_in_place_modification(tmp_path):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))  # 64 KiB -> 4 chunks
    slow = Fault(delay_s=0.3)
    opts = _opts(io_threads=1, sink_factory=lambda d: FaultySink(PosixSink(d), slow))
    path = str(tmp_path / "modified")
    handle = safe_ckpt.async_save({"w": _st("w", w)}, path, options=opts)
    w.add_(1.0)  # the training step runs on while the save still reads w
    with pytest.raises(safe_ckpt.SourceModifiedError, match="'w'"):
        handle.wait(timeout=60)
    assert not os.path.exists(path)

    kept = w.clone()
    path = str(tmp_path / "untouched")
    safe_ckpt.async_save({"w": _st("w", w)}, path, options=opts).wait(timeout=60)
    assert bits_equal(_dcp_load(path, {"w": ((64, 256), torch.float32)})["w"], kept)


def test_async_save_catches_a_cpu_backup_rewritten_in_place(tmp_path, monkeypatch):
    """torch_memory_saver with its backup retained rewrites the backup in place at its next pause
    (a cudaMemcpy into the same host block): no tensor's version counter moves, so only the
    second hash of the written bytes can see it. No GPU here: the classifier reports a host
    tensor as the paused tensor, with a host copy as its backup, written through numpy."""
    import threading

    from safe_ckpt.residence import classify as residence
    from tests.helpers.hooked_sinks import HookedSink

    paused = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    backup = paused.clone()
    real_classify = residence.classify

    def classify(tensor, *, allow_cpu_backup=False):
        if tensor.data_ptr() == paused.data_ptr() and allow_cpu_backup:
            return residence.Classified(residence.Residence.OFFLOAD_BACKUP.value, "paused (test)", backup)
        return real_classify(tensor, allow_cpu_backup=allow_cpu_backup)

    monkeypatch.setattr(residence, "classify", classify)
    entered, release = threading.Event(), threading.Event()

    class Gate(HookedSink):
        def open(self, relative_path, size_bytes):
            self.data_file = relative_path.endswith(".distcp")  # not the small whole files
            return super().open(relative_path, size_bytes)

        def before_write(self):  # w's first piece is hashed; hold its write until the backup changed
            if self.data_file and not entered.is_set():
                entered.set()
                assert release.wait(30)

    opts = _opts(io_threads=1, unmapped_policy="cpu_backup", sink_factory=Gate)
    path = str(tmp_path / "rewritten")
    handle = safe_ckpt.async_save({"w": _st("w", paused)}, path, options=opts)
    assert entered.wait(30)
    backup.numpy()[:] += 1.0  # the next pause's copy into the retained backup
    release.set()
    with pytest.raises(safe_ckpt.SourceModifiedError, match="CPU backup of 'w'.*Keep the saver paused"):
        handle.wait(timeout=60)
    assert not os.path.exists(path)


def _save_slowly(path, ready):
    import safe_ckpt as sc

    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(2))
    opts = sc.SaveOptions(chunk_bytes=16 * 1024, io_threads=1, progress_interval_s=0,
                          sink_factory=lambda d: FaultySink(PosixSink(d), Fault(delay_s=0.5)))
    ready.set()
    sc.save({"w": _st("w", w)}, path, options=opts)


def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ck")
    previous = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    safe_ckpt.save({"w": _st("w", previous)}, path, options=_opts())
    before = {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)}

    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_save_slowly, args=(path, ready))
    child.start()
    assert ready.wait(60)
    deadline = time.monotonic() + 60
    staging = []
    while time.monotonic() < deadline and not any(
        os.path.exists(os.path.join(tmp_path, s, "__0_0.distcp")) for s in staging
    ):
        staging = [n for n in os.listdir(tmp_path) if ".safe_ckpt-staging-" in n]
        time.sleep(0.05)
    assert staging, "the save never started writing"
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    after = {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)}
    assert after == before
    assert bits_equal(_dcp_load(path, {"w": ((8, 8), torch.float32)})["w"], previous)
    # what is left is recognisably a staging directory, never under the target's name
    assert all(n == "ck" or ".safe_ckpt-staging-" in n for n in os.listdir(tmp_path))


def test_options_are_validated():
    with pytest.raises(safe_ckpt.ValidationError, match="io_threads"):
        safe_ckpt.SaveOptions(io_threads=0)
    with pytest.raises(safe_ckpt.ValidationError, match="unmapped_policy"):
        safe_ckpt.SaveOptions(unmapped_policy="ignore")


def test_progress_lines_and_one_summary_per_save(tmp_path, caplog):
    import logging

    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(5))  # 128 KiB -> 8 chunks
    opts = _opts(io_threads=1, progress_interval_s=0.05,
                 sink_factory=lambda d: FaultySink(PosixSink(d), Fault(delay_s=0.1)))
    with caplog.at_level(logging.INFO, logger="safe_ckpt"):
        safe_ckpt.save({"w": _st("w", w)}, str(tmp_path / "ck"), options=opts)
    progress = [r.getMessage() for r in caplog.records if "ETA" in r.getMessage()]
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("saved ")]
    assert progress and all(m.startswith("rank 0 wrote") and "iB/s" in m for m in progress)
    assert len(summary) == 1 and "pageable" in summary[0]


def test_retention_from_megatron_args():
    import argparse

    from safe_ckpt.megatron import retention_from_args
    from safe_ckpt.targets.retention import Retention

    assert retention_from_args(argparse.Namespace(save_retain_interval=5)) == Retention(keep_last=1, keep_every=5)
    assert retention_from_args(argparse.Namespace(safe_ckpt_keep_last=3)) == Retention(keep_last=3)
    assert not retention_from_args(argparse.Namespace()).active


def _as_device(monkeypatch):
    """Report every source as mapped device memory, so that the write phase holds its writers
    until the last "device" chunk is staged; the stager still copies them as host tensors."""
    from safe_ckpt.residence import classify as residence

    monkeypatch.setattr(residence, "classify", lambda t, **kw: residence.Classified(residence.Residence.CUDA.value))


@pytest.mark.timeout(60)
def test_writers_wait_for_device_staging_and_start_when_the_pool_is_full(tmp_path, monkeypatch):
    """Strided chunks with small runs go through pool leases; a pool for two of them at a time
    fills up long before the last "device" chunk, so only the writers can make room: the gate
    must open then (else this save never ends), and every byte must still land."""
    _as_device(monkeypatch)
    g = torch.Generator().manual_seed(4)
    tensors = {f"w{i}": torch.randn(64, 256, generator=g)[:, ::2] for i in range(12)}  # 32 KiB each
    state = {k: _st(k, v) for k, v in tensors.items()}
    path = str(tmp_path / "ck")
    result = safe_ckpt.save(state, path, options=_opts(staging_budget_bytes=64 * 1024 + 8192, io_threads=3,
                                                       collective_timeout_s=60))
    assert result.bytes_by_residence["cuda"] == 12 * 64 * 128 * 4  # (0.19 adds its common state as an object)
    loaded = _dcp_load(path, {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()})
    for k, v in tensors.items():
        assert bits_equal(loaded[k], v), k


def _staging_events(monkeypatch, tmp_path, save):
    """The order of stage and write events of a save of ten small "device" tensors (a slow
    stager gives writers that are not held back every chance to start early)."""
    import safe_ckpt.write.pipeline as pipeline

    _as_device(monkeypatch)
    events = []
    stage, write = pipeline.RankWriter._stage, pipeline.RankWriter._write_item

    def slow_stage(self, item):
        events.append("stage")
        time.sleep(0.02)
        return stage(self, item)

    monkeypatch.setattr(pipeline.RankWriter, "_stage", slow_stage)
    monkeypatch.setattr(pipeline.RankWriter, "_write_item",
                        lambda self, h, item, staged: (events.append("write"), write(self, h, item, staged))[1])
    g = torch.Generator().manual_seed(5)
    tensors = {f"w{i}": torch.randn(32, 64, generator=g) for i in range(10)}
    path = str(tmp_path / "ck")
    save({k: _st(k, v) for k, v in tensors.items()}, path, _opts(io_threads=4))
    assert events.count("stage") == events.count("write") >= 10
    loaded = _dcp_load(path, {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()})
    assert all(bits_equal(loaded[k], v) for k, v in tensors.items())
    return events


def _writes_before_last_stage(events) -> int:
    last = max(i for i, e in enumerate(events) if e == "stage")
    return events[:last].count("write")


def test_no_write_starts_before_the_last_small_device_chunk_is_staged(tmp_path, monkeypatch):
    """Small device chunks, room for everything: the first write follows the last staging."""
    events = _staging_events(monkeypatch, tmp_path, lambda s, p, o: safe_ckpt.save(s, p, options=o))
    assert _writes_before_last_stage(events) == 0, events


def test_large_device_chunks_are_written_while_staging_goes_on(tmp_path, monkeypatch):
    """A save of large chunks (here: any size counts as large), sync or async, lets the
    writers start at once."""
    import safe_ckpt.write.pipeline as pipeline

    monkeypatch.setattr(pipeline, "EARLY_WRITERS_MIN_CHUNK_BYTES", 1)
    events = _staging_events(monkeypatch, tmp_path, lambda s, p, o: safe_ckpt.save(s, p, options=o))
    assert _writes_before_last_stage(events) > 0, events
    events = _staging_events(monkeypatch, tmp_path / "async",
                             lambda s, p, o: safe_ckpt.async_save(s, p, options=o).wait(60))
    assert _writes_before_last_stage(events) > 0, events


def _as_device_only(monkeypatch, tensors):
    """Report only the given tensors as mapped device memory (the rest by their real residence)."""
    from safe_ckpt.residence import classify as residence

    real = residence.classify
    ptrs = {t.data_ptr() for t in tensors}
    monkeypatch.setattr(residence, "classify", lambda t, **kw: residence.Classified(residence.Residence.CUDA.value)
                        if t.data_ptr() in ptrs else real(t, **kw))


def test_host_items_are_written_while_device_copies_land(tmp_path, monkeypatch):
    """The wait for the last device copies must not hold back the host items behind them."""
    import safe_ckpt.write.pipeline as pipeline
    from safe_ckpt.staging.stager import Stager

    g = torch.Generator().manual_seed(6)
    dev = torch.randn(64, 64, generator=g)
    host = {f"h{i}": torch.randn(32, 64, generator=g) for i in range(8)}
    _as_device_only(monkeypatch, [dev])
    times = {}
    real_wait = Stager.wait_copies

    def slow_wait(self):  # the device copies take a while to land
        time.sleep(0.5)
        real_wait(self)

    monkeypatch.setattr(Stager, "wait_copies", slow_wait)
    mark, write = pipeline.RankWriter._mark_staged, pipeline.RankWriter._write_item
    monkeypatch.setattr(pipeline.RankWriter, "_mark_staged",
                        lambda self: (times.setdefault("staged", time.perf_counter()), mark(self))[1])

    def timed_write(self, handle, item, staged):
        times.setdefault(item.fqn, time.perf_counter())
        return write(self, handle, item, staged)

    monkeypatch.setattr(pipeline.RankWriter, "_write_item", timed_write)
    state = {"dev": _st("dev", dev), **{k: _st(k, v) for k, v in host.items()}}
    path = str(tmp_path / "ck")
    safe_ckpt.save(state, path, options=_opts(chunk_bytes=1 << 20, io_threads=2))
    assert any(times[k] < times["staged"] for k in host), times
    loaded = _dcp_load(path, {k: (tuple(v.shape), v.dtype) for k, v in {"dev": dev, **host}.items()})
    assert all(bits_equal(loaded[k], v) for k, v in {"dev": dev, **host}.items())


def test_a_failure_waiting_for_device_copies_fails_the_save(tmp_path, monkeypatch):
    from safe_ckpt.staging.stager import Stager

    _as_device(monkeypatch)
    calls = []
    real_wait = Stager.wait_copies

    def failing_wait(self):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        real_wait(self)

    monkeypatch.setattr(Stager, "wait_copies", failing_wait)
    g = torch.Generator().manual_seed(7)
    state = {f"w{i}": _st(f"w{i}", torch.randn(16, 16, generator=g)) for i in range(4)}
    path = str(tmp_path / "ck")
    with pytest.raises(safe_ckpt.CheckpointError, match="illegal memory access"):
        safe_ckpt.save(state, path, options=_opts())
    assert not os.path.exists(path)


@pytest.fixture(autouse=True)
def _fresh_freezer(monkeypatch):
    """Each test starts with a freezer that has not yet seen the process freeze objects."""
    from safe_ckpt.host import gcfreeze

    monkeypatch.setattr(gcfreeze, "FREEZER", gcfreeze._Freezer())


class _FreezeProbe(PosixSink):
    """Records the collector's frozen-object count (and, given a list, its oldest generation's
    threshold) while the save writes."""

    seen: list
    oldest: list | None = None

    def open(self, relative_path, size_bytes):
        gc = __import__("gc")
        self.seen.append(gc.get_freeze_count())
        if self.oldest is not None:
            self.oldest.append(gc.get_threshold()[2])
        return super().open(relative_path, size_bytes)


def _probe_factory(seen, oldest=None):
    def factory(root):
        sink = _FreezeProbe(root)
        sink.seen, sink.oldest = seen, oldest
        return sink
    return factory


@pytest.mark.parametrize("mode", ["sync", "async", "fault", "off", "user_froze"])
def test_gc_freeze_holds_during_the_save_only(tmp_path, mode):
    import gc

    from safe_ckpt import compat
    from safe_ckpt.host import gcfreeze

    gc.unfreeze()
    seen, oldest = [], []
    factory = _probe_factory(seen, oldest)
    if mode == "fault":
        factory = lambda d: FaultySink(_probe_factory(seen, oldest)(d), Fault(after_bytes=1))  # noqa: E731
    opts = _opts(gc_freeze=mode != "off", sink_factory=factory)
    state = {"w": _st("w", torch.randn(64, 64)), "b": _st("b", torch.randn(300))}
    if mode == "user_froze":
        importlib.import_module("safe_ckpt.plan.collect").draft_memo.clear()  # an earlier save's remembered drafts, frozen here, are freed when this save replaces them
        gc.freeze()
    thresholds = gc.get_threshold()
    try:
        before = gc.get_freeze_count()
        if mode == "async":
            safe_ckpt.async_save(state, str(tmp_path / "ck"), options=opts).wait()
        elif mode == "fault":
            with pytest.raises(safe_ckpt.CheckpointError):
                safe_ckpt.save(state, str(tmp_path / "ck"), options=opts)
        else:
            safe_ckpt.save(state, str(tmp_path / "ck"), options=opts)
        assert seen
        held = gcfreeze.HELD_THRESHOLD if compat.generational_gc() else thresholds[2]
        # Objects still frozen after unfreeze() (seen on the GPU host, CPython 3.12.3: 375) make
        # the process one that freezes objects itself.
        if mode in ("sync", "async", "fault") and before == 0:
            assert min(seen) > 0 and gc.get_freeze_count() == 0 and set(oldest) == {thresholds[2]}
        elif mode == "off":
            assert set(seen) == {before} and set(oldest) == {thresholds[2]}
        else:  # the process's own freeze: left as it was, the oldest generation held off instead
            assert set(seen) == {before} and set(oldest) == {held}
        assert gc.get_freeze_count() == (0 if mode in ("sync", "async", "fault") and before == 0 else before)
        assert gc.get_threshold() == thresholds
    finally:
        gc.unfreeze()


def test_gc_freeze_released_when_planning_fails(tmp_path, monkeypatch):
    import gc

    from safe_ckpt.saving import job as save_job

    gc.unfreeze()
    during = []

    def failing_plan(job):
        during.append(gc.get_freeze_count())
        raise safe_ckpt.CheckpointError("planning failed")

    monkeypatch.setattr(save_job.SaveJob, "plan", failing_plan)
    with pytest.raises(safe_ckpt.CheckpointError, match="planning failed"):
        safe_ckpt.save({"w": _st("w", torch.randn(4, 4))}, str(tmp_path / "ck"), options=_opts())
    assert during and during[0] > 0 and gc.get_freeze_count() == 0


def test_gc_freeze_released_when_waiting_for_staging_fails(tmp_path, monkeypatch):
    import gc

    from safe_ckpt.write import pipeline

    gc.unfreeze()

    def interrupted(self, timeout_s=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline.RankWriter, "wait_staged", interrupted)
    with pytest.raises(KeyboardInterrupt):
        safe_ckpt.async_save({"w": _st("w", torch.randn(8, 8))}, str(tmp_path / "ck"), options=_opts())
    assert gc.get_freeze_count() == 0


def test_gc_freeze_keeps_a_freeze_the_process_made_during_the_save(tmp_path):
    import gc

    gc.unfreeze()

    kept, grew = [], []

    class FreezingSink(PosixSink):
        def open(self, relative_path, size_bytes):
            # New objects, then a freeze: e.g. a data loader about to fork while an async save
            # runs. (Frozen objects that die meanwhile lower the count; these outnumber them.)
            kept.append([[i] for i in range(100_000)])  # lists are always tracked (empty dicts are not)
            before = gc.get_freeze_count()
            gc.freeze()
            grew.append(gc.get_freeze_count() - before)
            return super().open(relative_path, size_bytes)

    opts = _opts(sink_factory=lambda d: FreezingSink(d))
    try:
        safe_ckpt.async_save({"w": _st("w", torch.randn(64, 64))}, str(tmp_path / "ck"), options=opts).wait()
        assert grew and min(grew) >= 100_000
        assert gc.get_freeze_count() > 0
        gc.unfreeze()
        seen = []  # a process that freezes objects itself is left alone from then on
        safe_ckpt.save({"w": _st("w", torch.randn(8, 8))}, str(tmp_path / "ck2"),
                       options=_opts(sink_factory=_probe_factory(seen)))
        assert seen and set(seen) == {0}
    finally:
        gc.unfreeze()


def test_gc_freeze_counts_frozen_objects_only_while_none_are_frozen(tmp_path, monkeypatch):
    """`gc.get_freeze_count()` walks the permanent generation; safe_ckpt may ask it only when
    that is empty (free), never with the heap frozen (0.1-0.4 s in a large process)."""
    import gc

    gc.unfreeze()
    real, answers = gc.get_freeze_count, []
    monkeypatch.setattr(gc, "get_freeze_count", lambda: answers.append(real()) or answers[-1])
    for use_async in (False, True):
        state = {"w": _st("w", torch.randn(64, 64))}
        if use_async:
            safe_ckpt.async_save(state, str(tmp_path / "a"), options=_opts()).wait()
        else:
            safe_ckpt.save(state, str(tmp_path / "s"), options=_opts())
        assert real() == 0
    assert answers == [0, 0], answers


@pytest.mark.parametrize("gc_freeze", [True, False])
def test_a_process_that_froze_objects_itself_meets_no_full_collection_during_a_save(tmp_path, gc_freeze):
    """Where the process froze objects before its first save (a library at import, an engine
    after warm-up), safe_ckpt leaves that freeze alone and holds the collector's oldest
    generation off instead: the save's allocations start no collection of the whole heap, and
    the thresholds are the process's own again afterwards. With gc_freeze off, the same
    allocations do meet one (the control: the hold is what keeps it off)."""
    import gc

    from safe_ckpt import compat

    if gc_freeze and not compat.generational_gc():
        pytest.skip("no oldest generation to hold off: this interpreter's collector is incremental")
    state = {"w": _st("w", torch.randn(8, 8))}  # built first: its first use imports megatron, which collects
    gc.unfreeze()
    kept = [[i] for i in range(1000)]
    gc.freeze()  # the process's own freeze
    thresholds = gc.get_threshold()
    full, opened = [], []

    class AllocatingSink(PosixSink):
        def open(self, relative_path, size_bytes):
            opened.append(relative_path)
            kept.append([[i] for i in range(1_000_000)])  # survivors pile into the oldest generation
            return super().open(relative_path, size_bytes)

    def watch(phase, info):
        if phase == "stop" and info["generation"] == 2:
            full.append(info)

    gc.callbacks.append(watch)
    try:
        safe_ckpt.save(state, str(tmp_path / "ck"),
                       options=_opts(gc_freeze=gc_freeze, sink_factory=lambda d: AllocatingSink(d)))
    finally:
        gc.callbacks.remove(watch)
        gc.unfreeze()
        del kept
    assert opened and gc.get_threshold() == thresholds
    if gc_freeze:
        assert full == [], f"{len(full)} full collection(s) ran during the save"
    else:
        assert full, "the control saw no full collection: the test would pass without the hold"


@pytest.mark.parametrize("change", ["youngest", "oldest"])
def test_a_held_oldest_generation_comes_back_whatever_the_process_set_meanwhile(change):
    """The hold puts back only the oldest generation's threshold, and only if it is still the
    held value: a process that sets the youngest one during an async save keeps it and gets its
    oldest one back; one that sets the oldest one itself keeps that."""
    import gc

    from safe_ckpt import compat
    from safe_ckpt.host import gcfreeze

    if not compat.generational_gc():
        pytest.skip("no oldest generation to hold off: this interpreter's collector is incremental")
    saved = gc.get_threshold()
    freezer = gcfreeze._Freezer()
    freezer._process_freezes = True  # as after seeing the process freeze objects itself
    try:
        freezer.acquire()
        assert gc.get_threshold() == (saved[0], saved[1], gcfreeze.HELD_THRESHOLD)
        if change == "youngest":
            gc.set_threshold(50_000)
        else:
            gc.set_threshold(saved[0], saved[1], 77)
        freezer.release()
        expected = (50_000, saved[1], saved[2]) if change == "youngest" else (saved[0], saved[1], 77)
        assert gc.get_threshold() == expected
    finally:
        gc.set_threshold(*saved)


def _grid_on_host(monkeypatch, log: list | None = None):
    """Every source reported as device memory, large contiguous chunks staged and summed by
    the host stand-in of the device stager (tests/helpers/bodies/common.py); ``log`` records the deferral."""
    from safe_ckpt.saving import job as save_job
    from safe_ckpt.staging import stager
    from tests.helpers.bodies import common as cases

    _as_device(monkeypatch)
    base = cases._host_grid_stager()

    class Logged(base):
        def flush_sums(self):
            if log is not None:
                log.append("flush")
            super().flush_sums()

        def _add_sums(self, pending, defer):
            if log is not None:
                log.append("defer" if defer else "now")
            super()._add_sums(pending, defer)

        def stage(self, chunk, *args, **kwargs):
            if log is not None and not chunk.is_contiguous():
                log.append("strided")
            staged = super().stage(chunk, *args, **kwargs)
            if log is not None and staged._pending_copy is not None:
                log.append("host lease")
            return staged

        def _before_wait(self, on_wait, waited=None):
            inner = super()._before_wait(on_wait, waited)

            def logged():
                if log is not None:
                    log.append(f"wait with {len(self._pending)} deferred")
                inner()
            return logged

    monkeypatch.setattr(save_job, "Stager", Logged)
    monkeypatch.setattr(stager, "GRID_MIN_PAYLOAD_BYTES", 1 << 20)


def _grid_lease_bytes(nbytes: int) -> int:
    from safe_ckpt.integrity import grid_bytes

    return -(-(-(-nbytes // 16) * 16 + grid_bytes(nbytes)) // 4096) * 4096


def _save_and_check(tmp_path, tensors, **opts):
    path = str(tmp_path / "ck")
    safe_ckpt.save({k: _st(k, v) for k, v in tensors.items()}, path,
                   options=_opts(checksums=True, device_checksums=True, collective_timeout_s=60, **opts))
    loaded = _dcp_load(path, {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()})
    assert all(bits_equal(loaded[k], v) for k, v in tensors.items())
    from safe_ckpt.tools.verify import verify

    report = verify(path, deep=True)
    assert report.ok and report.checksummed_items == report.items_checked, report.findings


@pytest.mark.timeout(60)
def test_a_host_lease_that_waits_first_issues_the_deferred_sums(tmp_path, monkeypatch):
    """Two summed chunks fill the pool while the writers wait; a strided chunk (4-byte runs, so
    it is copied through a lease) then has to wait for room. The writers it releases need the
    two chunks' sums to finish them, and only their writes free the pool: the sums must be
    issued before that lease waits, or this save never ends (found in review)."""
    log: list = []
    _grid_on_host(monkeypatch, log)
    g = torch.Generator().manual_seed(11)
    n = 2 << 20
    tensors = {"a_g1": torch.randn(n // 4, generator=g), "a_g2": torch.randn(n // 4, generator=g),
               "z_s": torch.randn(512, 1024, generator=g)[:, ::2]}
    # The layout balances 4 files (2 writers x 2): the two summed chunks staged first are of
    # 1747628 and 1398104 bytes, and the pool holds exactly those two.
    budget = _grid_lease_bytes(1747628) + _grid_lease_bytes(1398104) + 8192
    _save_and_check(tmp_path, tensors, chunk_bytes=n, staging_budget_bytes=budget)
    at = log.index("strided")  # the case this test is about did happen
    assert log[at - 2:at] == ["defer", "defer"] and log[at + 1] == "wait with 2 deferred", log
    assert "host lease" in log[at + 2:], log  # and it was the host lease path that waited


@pytest.mark.timeout(60)
def test_a_chunk_whose_lease_waited_gets_its_sums_at_once(tmp_path, monkeypatch):
    """A lease that waits releases the writers (and flushes the sums deferred so far); the chunk
    it was for, and every later one, must not be deferred, or its writer sits in grid() until
    the last device chunk (found in review)."""
    import safe_ckpt.write.pipeline as pipeline

    log: list = []
    _grid_on_host(monkeypatch, log)
    stage = pipeline.RankWriter._stage
    monkeypatch.setattr(pipeline.RankWriter, "_stage", lambda self, item: (time.sleep(0.02), stage(self, item))[1])
    g = torch.Generator().manual_seed(12)
    n = 2 << 20
    tensors = {f"t{i}": torch.randn(n // 4, generator=g) for i in range(6)}
    _save_and_check(tmp_path, tensors, chunk_bytes=n, staging_budget_bytes=2 * _grid_lease_bytes(n) + 8192)
    assert any(e.startswith("wait with") for e in log), log  # the pool did run out
    first_flush = log.index("flush")
    assert "defer" in log[:first_flush], log
    assert "defer" not in log[first_flush:], log


@pytest.mark.timeout(60)
def test_a_copy_that_fails_fails_the_save_and_gives_its_lease_back(tmp_path, monkeypatch):
    """The third chunk's copy fails while earlier chunks' sums are deferred: the save fails
    with that error, nothing is committed, no writer is left waiting for sums, every lease
    is back in the process's pool, and the next save is whole."""
    from safe_ckpt.saving import job as save_job
    from safe_ckpt.staging.pool import shared_pool

    _grid_on_host(monkeypatch)
    base, calls = save_job.Stager, []

    class Failing(base):
        def _enqueue_copy(self, chunk, lease, contiguous, runs):
            calls.append(chunk.numel())
            if len(calls) == 3:
                raise RuntimeError("injected copy failure")
            return super()._enqueue_copy(chunk, lease, contiguous, runs)

    monkeypatch.setattr(save_job, "Stager", Failing)
    g = torch.Generator().manual_seed(13)
    n = 2 << 20
    tensors = {f"t{i}": torch.randn(n // 4, generator=g) for i in range(6)}
    budget = 64 << 20
    bad = str(tmp_path / "bad")
    with pytest.raises(safe_ckpt.CheckpointError, match="injected copy failure"):
        safe_ckpt.save({k: _st(k, v) for k, v in tensors.items()}, bad,
                       options=_opts(chunk_bytes=n, staging_budget_bytes=budget, collective_timeout_s=60))
    assert not os.path.exists(os.path.join(bad, ".metadata"))
    assert shared_pool(budget).stats().leased_bytes == 0
    monkeypatch.setattr(save_job, "Stager", base)
    _save_and_check(tmp_path, tensors, chunk_bytes=n, staging_budget_bytes=budget)
