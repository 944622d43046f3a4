"""The copy window's ordering rules on the CPU, with real tensors, a real pool, the real global
optimizer pre-hook and real `torch.optim` steps standing for Megatron's.

Device sources are simulated by `HostStreams` (a worker thread per "device" runs the copies in
order; `hold()` keeps them from landing, as a spin kernel first on a CUDA copy stream would).
A writer thread stands for the pipeline's writers: it takes each staged chunk, reads its bytes
and releases its lease, one item at a time when the test says so. Every wait is on an event and
bounded; the only timed waits are the gate timeout under test (0.2 s) and one 50 ms probe that a
pause has not gone ahead (the bytes written then prove it).
"""

from __future__ import annotations

import importlib.util
import os
import queue
import threading

import pytest
import torch

from safe_ckpt.errors import CheckpointError, SourceModifiedError, WriteError
from safe_ckpt.staging import gates
from safe_ckpt.staging.pool import PinnedPool
from safe_ckpt.staging.source_sums import HostSums
from safe_ckpt.staging.streams import HostStreams
from safe_ckpt.staging.window import SMALL_SOURCE_BYTES, CopyWindow, StagingTimeoutError, WindowSource
from safe_ckpt.staging.window_copier import ChunkJob, WindowCopier, window_order
from tests.helpers.paths import STAND_INS_TMS

WAIT_S = 20.0  # bound on every wait of a test thread: a hang fails instead of blocking the suite
CHUNK = 16 * 1024  # elements (fp32) per chunk: 64 KiB
CHUNK_BYTES = CHUNK * 4


class Writer:
    """Takes staged chunks in order; with ``gated``, item k is written only after `allow(k)`.
    Reports host chunks written from their own memory to the window (``report_host``)."""

    def __init__(self, window: CopyWindow, gated: bool, report_host: bool = False) -> None:
        self.window = window
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.written: dict = {}  # (key, chunk) -> bytes
        self.count = 0
        self._allowed = threading.Semaphore(0)
        self._gated = gated
        self._report_host = report_host
        self.done_one = threading.Semaphore(0)
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def put(self, item, staged) -> None:
        self.items.put((item, staged))

    def allow(self, n: int = 1) -> None:
        for _ in range(n):
            self._allowed.release()

    def close(self) -> None:
        self.items.put(None)

    def _run(self) -> None:
        while True:
            entry = self.items.get()
            if entry is None:
                self.finished.set()
                return
            (key, index, k), staged = entry
            if self._gated:
                assert self._allowed.acquire(timeout=WAIT_S), "the test never allowed this write"
            try:
                self.written[(key, k)] = b"".join(bytes(v) for v in staged.ready())
            finally:
                staged.release()
            if self._report_host and self.window.sources[index].device is None:
                self.window.captured(index, len(self.written[(key, k)]))
            self.count += 1
            self.done_one.release()


def make_window(tensors: dict, *, device_keys=(), chunk=CHUNK, streams=None, rank=0, timeout_s=WAIT_S, name="ck",
                small_bytes=4096):
    """The window over ``tensors`` (``device_keys`` are simulated device sources on device 0) and
    its chunk jobs in key order; sources below ``small_bytes`` are copied at the opening."""
    sources, jobs = [], []
    for index, (key, t) in enumerate(tensors.items()):
        flat = t.detach().view(-1)
        pieces = [flat[a:a + chunk] for a in range(0, flat.numel(), chunk)]
        sources.append(WindowSource(index=index, key=key, tensor=t.detach(), device=0 if key in device_keys else None,
                                    chunks=len(pieces), size_bytes=t.numel() * t.element_size(), version=t._version))
        jobs += [ChunkJob(index, piece, (key, index, k)) for k, piece in enumerate(pieces)]
    streams = streams or HostStreams()
    window = CopyWindow(sources, streams, HostSums(), name=name, rank=rank, timeout_s=timeout_s,
                        small_source_bytes=small_bytes)
    return window, jobs


def start(window, jobs, writer, pool, snapshot_host=True):
    """Open the window in the caller's thread, track it, run the copier on a staging thread."""
    copier = WindowCopier(window, pool, snapshot_host=snapshot_host)
    rest = copier.open(jobs, writer.put)
    gates.track(window)
    errors = []

    def run():
        try:
            copier.run(rest, writer.put)
        except BaseException as exc:  # the window carries it; kept for the test
            errors.append(exc)
        finally:
            writer.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def in_thread(fn) -> tuple[threading.Thread, threading.Event, list]:
    done, errors = threading.Event(), []

    def body():
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, done, errors


def adamw_state(n: int, seed: int, fused: bool = True):
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(n, generator=g))
    w.grad = torch.randn(n, generator=g)
    opt = torch.optim.AdamW([w], lr=0.1, fused=fused) if fused else torch.optim.AdamW([w], lr=0.1, foreach=True)
    opt.step()
    w.grad = torch.randn(n, generator=g)
    return w, opt


def chunks_of(t: torch.Tensor, chunk=CHUNK) -> list[bytes]:
    flat = t.detach().reshape(-1)
    return [flat[a:a + chunk].numpy().tobytes() for a in range(0, flat.numel(), chunk)]


def expect_written(writer: Writer, key: str, t: torch.Tensor) -> None:
    for k, data in enumerate(chunks_of(t)):
        assert writer.written[(key, k)] == data, f"{key} chunk {k} is not the pre-step value"


@pytest.fixture(autouse=True)
def _no_window_left_open():
    yield
    assert gates.open_windows() == (), "a test left a window tracked"


# ---------------------------------------------------------------------------------------------------
def test_a_host_optimizer_step_waits_until_its_sources_are_written(tmp_path):
    """Host-resident optimizer state written from its own memory (today's async save): the fused
    CPU AdamW step (what --optimizer-cpu-offload runs) waits in its pre-hook until every byte of
    its sources is written, so the checkpoint holds the pre-step values and nothing is torn."""
    w, opt = adamw_state(4 * CHUNK, seed=1)
    m = opt.state[w]["exp_avg"]
    pre = {"w": w.detach().clone(), "m": m.clone()}
    window, jobs = make_window({"w": w, "m": m}, name=str(tmp_path / "ck"))
    writer = Writer(window, gated=True, report_host=True)
    stager, _ = start(window, jobs, writer, PinnedPool(1 << 20, pinned=False), snapshot_host=False)
    writer.allow(1)  # the first item is written, the rest are held
    assert writer.done_one.acquire(timeout=WAIT_S)

    stepper, stepped, errors = in_thread(opt.step)
    assert window.gate_blocked.wait(WAIT_S), "the optimizer step did not wait for the save"
    assert not stepped.is_set()
    assert torch.equal(w.detach(), pre["w"]) and torch.equal(m, pre["m"])  # nothing changed yet

    writer.allow(7)
    assert stepped.wait(WAIT_S) and not errors, errors
    stager.join(WAIT_S)
    window.settle()
    assert writer.finished.wait(WAIT_S)
    expect_written(writer, "w", pre["w"])
    expect_written(writer, "m", pre["m"])
    assert not torch.equal(w.detach(), pre["w"])  # and the step did run, after the writes
    assert window.stats().blocked_gates == 1


def test_an_optimizer_step_before_the_copies_are_issued_waits_for_them(tmp_path):
    """Window mode: sources copied into a pool of one chunk, the writer holding the first item,
    so the copies cannot all be issued: the step's pre-hook blocks until they are, then the
    step runs after the last copy (HostStreams' current stream is the host)."""
    w, opt = adamw_state(4 * CHUNK, seed=2)
    m = opt.state[w]["exp_avg"]
    pre = {"w": w.detach().clone(), "m": m.clone()}
    window, jobs = make_window({"w": w, "m": m}, device_keys=("w",), name=str(tmp_path / "ck"))
    writer = Writer(window, gated=True)
    stager, _ = start(window, jobs, writer, PinnedPool(CHUNK_BYTES, pinned=False))

    stepper, stepped, errors = in_thread(opt.step)
    assert window.gate_blocked.wait(WAIT_S)
    assert not stepped.is_set() and not window.all_in()
    assert torch.equal(w.detach(), pre["w"]) and torch.equal(m, pre["m"])

    writer.allow(8)
    assert stepped.wait(WAIT_S) and not errors, errors
    stager.join(WAIT_S)
    window.settle()
    assert writer.finished.wait(WAIT_S)
    expect_written(writer, "w", pre["w"])
    expect_written(writer, "m", pre["m"])


class QueuedStreams(HostStreams):
    """HostStreams whose caller's stream queues a wait instead of blocking, as a CUDA current
    stream does (`wait_event` returns at once): shows what the gate itself blocks on."""

    ordering_blocks_host = False

    def __init__(self, fail_order: BaseException | None = None) -> None:
        super().__init__()
        self.ordered_after: list = []
        self.fail_order = fail_order

    def order_current_after(self, mark) -> None:
        if self.fail_order is not None:
            raise self.fail_order
        self.ordered_after.append(mark)


def test_once_every_copy_is_issued_the_gate_does_not_block_the_host(tmp_path):
    streams = QueuedStreams()
    w, _ = adamw_state(4 * CHUNK, seed=3)
    unrelated, unrelated_opt = adamw_state(64, seed=4)  # any torch optimizer's step passes the gate
    window, jobs = make_window({"w": w}, device_keys=("w",), streams=streams, name=str(tmp_path / "ck"))
    writer = Writer(window, gated=False)
    held = streams.hold(0)  # no copy lands until the test says so
    stager, _ = start(window, jobs, writer, PinnedPool(1 << 20, pinned=False))
    stager.join(WAIT_S)
    assert window.all_in()
    last = window.last_marks()[0]
    assert not last.done()

    unrelated_opt.step()
    assert not window.gate_blocked.is_set(), "the gate blocked the host although every copy was issued"
    assert streams.ordered_after[-1] is last  # the current stream was ordered after the last copy
    assert window.stats().gates == 1 and window.stats().blocked_gates == 0

    held.set()
    window.settle()
    assert writer.finished.wait(WAIT_S)
    expect_written(writer, "w", w)


def test_a_pool_smaller_than_the_state_streams_and_the_gate_waits_only_for_what_is_left(tmp_path):
    """8 chunks through a pool of 2: the step waits while copies are still to be issued and goes
    on as soon as the last one is, with the last two chunks still in the pool, unwritten."""
    w, opt = adamw_state(8 * CHUNK, seed=5)
    pre = w.detach().clone()
    window, jobs = make_window({"w": w}, device_keys=("w",), name=str(tmp_path / "ck"))
    writer = Writer(window, gated=True)
    staged = [threading.Event() for _ in jobs]

    def put(item, chunk):
        writer.put(item, chunk)
        staged[item[2]].set()

    copier = WindowCopier(window, PinnedPool(2 * CHUNK_BYTES, pinned=False))
    rest = copier.open(jobs, put)
    gates.track(window)
    stager, _, stage_errors = in_thread(lambda: copier.run(rest, put))
    assert staged[1].wait(WAIT_S) and not staged[2].is_set()  # the pool is full

    stepper, stepped, errors = in_thread(opt.step)
    assert window.gate_blocked.wait(WAIT_S)
    for k in range(6):
        writer.allow(1)
        assert writer.done_one.acquire(timeout=WAIT_S)
        assert staged[k + 2].wait(WAIT_S)  # the freed chunk let the next copy go
        if k + 2 < 7:
            assert not stepped.is_set() and not window.all_in()
    assert stepped.wait(WAIT_S) and not errors, errors
    assert writer.count == 6  # the step did not wait for the last two chunks' writes
    writer.allow(2)
    stager.join(WAIT_S)
    assert not stage_errors, stage_errors
    writer.close()
    window.settle()
    assert writer.finished.wait(WAIT_S)
    expect_written(writer, "w", pre)


@pytest.mark.parametrize("how", ["data_copy", "in_place"])
def test_an_uncovered_write_before_the_last_copy_fails_the_save(tmp_path, how):
    """A write no gate ordered, made before the source's last copy: through `.data` (no version
    counter moves: the content sums see it) or in place (its version counter moved)."""
    g = torch.Generator().manual_seed(6)
    w, other = torch.randn(4 * CHUNK, generator=g), torch.randn(2 * CHUNK, generator=g)
    streams = HostStreams()
    name = str(tmp_path / "ck")
    window, jobs = make_window({"other": other, "w": w}, device_keys=("w", "other"), streams=streams, rank=3,
                               name=name)
    writer = Writer(window, gated=False)
    copier = WindowCopier(window, PinnedPool(1 << 20, pinned=False))
    rest = copier.open(jobs, writer.put)
    gates.track(window)
    held = streams.hold(0)
    if how == "data_copy":
        w.data.copy_(torch.randn(4 * CHUNK, generator=g))  # outside every hook, before the copies run
        copier.run(rest, writer.put)
    else:
        w.add_(1.0)
        with pytest.raises(SourceModifiedError):
            copier.run(rest, writer.put)
    writer.close()
    held.set()
    with pytest.raises(SourceModifiedError) as caught:
        window.settle()
    message = str(caught.value)
    assert "'w'" in message and "rank 3" in message and name in message, message
    assert "'other'" not in message
    assert writer.finished.wait(WAIT_S)


def test_writes_after_the_gate_or_after_the_window_do_not_fail_the_save(tmp_path):
    w, opt = adamw_state(4 * CHUNK, seed=7, fused=False)  # foreach AdamW: moves version counters
    pre = w.detach().clone()
    window, jobs = make_window({"w": w}, device_keys=("w",), name=str(tmp_path / "ck"))
    writer = Writer(window, gated=False)
    stager, _ = start(window, jobs, writer, PinnedPool(1 << 20, pinned=False))
    stager.join(WAIT_S)
    opt.step()  # gated: the host waits for the copies (HostStreams), then the step writes
    window.settle()
    w.detach().add_(1.0)  # after the window: none of the save's business
    opt.step()
    assert writer.finished.wait(WAIT_S)
    expect_written(writer, "w", pre)


def test_the_hook_is_registered_once_a_no_op_without_a_window_and_survives_many_windows(tmp_path):
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    w, opt = adamw_state(2 * CHUNK, seed=8)
    gates.install_optimizer_hook()
    hooks = len(_global_optimizer_pre_hooks)
    calls = gates.hook_calls()
    opt.step()
    assert gates.hook_calls() == calls  # no window: the hook returned at once
    for round_ in range(12):
        w.grad = torch.randn_like(w)
        pre = w.detach().clone()
        window, jobs = make_window({"w": w}, device_keys=("w",), name=str(tmp_path / f"ck{round_}"))
        writer = Writer(window, gated=False)
        stager, _ = start(window, jobs, writer, PinnedPool(1 << 20, pinned=False))
        opt.step()
        stager.join(WAIT_S)
        window.settle()
        assert writer.finished.wait(WAIT_S)
        expect_written(writer, "w", pre)
        assert gates.open_windows() == ()
    assert gates.hook_calls() == calls + 12
    assert len(_global_optimizer_pre_hooks) == hooks  # never removed, never added twice
    opt.step()
    assert gates.hook_calls() == calls + 12


def test_a_failed_window_releases_every_waiter_at_once(tmp_path):
    """A writer's error while an optimizer step, an explicit gate and a pause wait: all three go
    on, the save reports the writer's error, nothing deadlocks."""
    w, opt = adamw_state(4 * CHUNK, seed=9)
    window, jobs = make_window({"w": w}, device_keys=("w",), name=str(tmp_path / "ck"))
    writer = Writer(window, gated=True)
    stager, stage_errors = start(window, jobs, writer, PinnedPool(CHUNK_BYTES, pinned=False))
    waiters = [in_thread(opt.step), in_thread(lambda: gates.before_update("a user's own update")),
               in_thread(lambda: gates.before_unmap("a pause"))]
    assert window.gate_blocked.wait(WAIT_S)
    window.fail(WriteError("injected: disk full"))
    for thread, done, errors in waiters:
        assert done.wait(WAIT_S), "a waiter was not released"
        assert not errors, errors
    stager.join(WAIT_S)
    assert stage_errors and isinstance(stage_errors[0], CheckpointError)  # the copier stopped
    writer.allow(8)
    with pytest.raises(WriteError, match="disk full"):
        window.settle()
    assert writer.finished.wait(WAIT_S)
    opt.step()  # later steps meet no window


def test_a_gate_that_waits_too_long_abandons_the_save_and_training_goes_on(tmp_path):
    w, opt = adamw_state(4 * CHUNK, seed=10)
    name = str(tmp_path / "ck")
    window, jobs = make_window({"w": w}, device_keys=("w",), timeout_s=0.2, rank=1, name=name)
    writer = Writer(window, gated=True)  # never allowed: the pool of one chunk stays full
    stager, _ = start(window, jobs, writer, PinnedPool(CHUNK_BYTES, pinned=False))
    opt.step()  # returns after the bounded wait
    assert isinstance(window.error, StagingTimeoutError)
    message = str(window.error)
    assert "rank 1" in message and name in message and "staging_budget_bytes" in message, message
    assert "waited 0.2 s" in message, message
    stager.join(WAIT_S)
    writer.allow(8)
    with pytest.raises(StagingTimeoutError):
        window.settle()
    assert writer.finished.wait(WAIT_S)


def test_a_gate_that_cannot_order_the_stream_raises_naming_the_save(tmp_path):
    streams = QueuedStreams()
    w, _ = adamw_state(2 * CHUNK, seed=11)
    name = str(tmp_path / "ck")
    window, jobs = make_window({"w": w}, device_keys=("w",), streams=streams, name=name)
    writer = Writer(window, gated=False)
    stager, _ = start(window, jobs, writer, PinnedPool(1 << 20, pinned=False))
    stager.join(WAIT_S)
    streams.fail_order = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(CheckpointError, match="illegal memory access") as caught:
        gates.before_update()
    assert name in str(caught.value)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        window.settle()
    assert writer.finished.wait(WAIT_S)


def test_nested_optimizer_steps_gate_once_and_inner_steps_do_not_fail_the_save(tmp_path):
    """Shaped like Megatron's HybridDeviceOptimizer: the outer step's pre-hook gates everything;
    the inner steps (foreach AdamW, which moves version counters) then write, and the inner
    pre-hooks must not take those writes for writes before the copy."""

    class Hybrid(torch.optim.Optimizer):
        def __init__(self, params):
            params = list(params)
            super().__init__(params, defaults={})
            self.inner = [torch.optim.AdamW([p], lr=0.1, foreach=True) for p in params]

        def step(self, closure=None):
            for o in self.inner:
                o.step()

    g = torch.Generator().manual_seed(12)
    ps = [torch.nn.Parameter(torch.randn(2 * CHUNK, generator=g)) for _ in range(2)]
    for p in ps:
        p.grad = torch.randn(2 * CHUNK, generator=g)
    opt = Hybrid(ps)
    pre = [p.detach().clone() for p in ps]
    window, jobs = make_window({"p0": ps[0], "p1": ps[1]}, device_keys=("p0", "p1"), name=str(tmp_path / "ck"))
    writer = Writer(window, gated=True)
    stager, _ = start(window, jobs, writer, PinnedPool(CHUNK_BYTES, pinned=False))
    stepper, stepped, errors = in_thread(opt.step)
    assert window.gate_blocked.wait(WAIT_S)
    writer.allow(4)
    assert stepped.wait(WAIT_S) and not errors, errors
    stager.join(WAIT_S)
    window.settle()  # no SourceModifiedError
    assert writer.finished.wait(WAIT_S)
    expect_written(writer, "p0", pre[0])
    expect_written(writer, "p1", pre[1])
    assert window.stats().gates == 3  # the outer and both inner pre-hooks


def test_small_sources_are_copied_first_in_the_callers_thread():
    g = torch.Generator().manual_seed(13)
    big = torch.randn(SMALL_SOURCE_BYTES // 4 + CHUNK, generator=g)
    bias = torch.randn(64, generator=g)  # an expert bias: rewritten before the optimizer step
    window, jobs = make_window({"big": big, "bias": bias}, device_keys=("big", "bias"), small_bytes=SMALL_SOURCE_BYTES)
    small, rest = window_order(jobs, window)
    assert [j.item[0] for j in small] == ["bias"] and {j.item[0] for j in rest} == {"big"}
    writer = Writer(window, gated=False)
    copier = WindowCopier(window, PinnedPool(4 << 20, pinned=False))
    left = copier.open(jobs, writer.put)
    gates.track(window)
    assert writer.done_one.acquire(timeout=WAIT_S) and list(writer.written) == [("bias", 0)]
    assert left == rest
    pre = bias.clone()
    with torch.no_grad():
        bias.add_(1.0)  # like finalize_model_grads' expert-bias update: after the opening, before the gate
    copier.run(left, writer.put)
    gates.before_update("the optimizer step")
    writer.close()
    window.settle()  # released at the opening: its later write is not a write under the window
    assert writer.finished.wait(WAIT_S)
    assert writer.written[("bias", 0)] == pre.numpy().tobytes()


def _stand_in_memory_saver():
    path = os.path.join(STAND_INS_TMS, "torch_memory_saver", "__init__.py")
    spec = importlib.util.spec_from_file_location("safe_ckpt_test_tms_stand_in", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TorchMemorySaver()


def test_a_memory_saver_pause_waits_for_the_copies_of_the_memory_it_releases(tmp_path):
    """torch_memory_saver's pause releases memory without a backup (here: overwrites it, as the
    stand-in does): guarded, it waits until every copy has landed, so the checkpoint holds the
    bytes from before the pause."""
    saver = _stand_in_memory_saver()
    assert gates.guard_memory_saver(saver) and not gates.guard_memory_saver(saver)
    g = torch.Generator().manual_seed(14)
    with saver.region(tag="train", enable_cpu_backup=False):
        w = torch.randn(4 * CHUNK, generator=g)
    pre = w.clone()
    streams = HostStreams()
    window, jobs = make_window({"w": w}, device_keys=("w",), streams=streams, name=str(tmp_path / "ck"))
    writer = Writer(window, gated=False)
    copier = WindowCopier(window, PinnedPool(1 << 20, pinned=False))
    rest = copier.open(jobs, writer.put)
    gates.track(window)
    held = streams.hold(0)
    copier.run(rest, writer.put)
    writer.close()
    pauser, paused, errors = in_thread(lambda: saver.pause("train"))
    assert not paused.wait(0.05) and saver.calls == []  # held behind the copies (bounded probe)
    held.set()
    assert paused.wait(WAIT_S) and not errors, errors
    assert saver.calls == [("pause", "train")]
    assert torch.isnan(w).all()  # the stand-in released the bytes
    window.settle()
    assert writer.finished.wait(WAIT_S)
    expect_written(writer, "w", pre)


class _InlineStreams:
    """Runs "copy-stream" work at once, as `CudaStreams.call` does minus the stream."""

    def call(self, device, fn):
        fn()


def test_the_device_sums_see_a_one_byte_change_anywhere_whatever_the_size_and_alignment():
    """`DeviceSums`' arithmetic (row sums of the widest words the address allows, plus the last
    partial row), run on CPU tensors: every slot changed by one byte is found, no other is."""
    from safe_ckpt.staging.source_sums import DeviceSums

    g = torch.Generator().manual_seed(15)
    raw = torch.randint(0, 256, (3 * 4096 + 11,), dtype=torch.uint8, generator=g)
    tensors = [
        torch.randn(5003, generator=g),  # fp32: 4 whole rows and a partial one
        torch.randn(4097, generator=g).to(torch.bfloat16),  # an odd number of 2-byte words
        raw[1:],  # misaligned: one-byte words
        torch.randn(2048, generator=g),  # exactly two rows
        torch.randn(3, generator=g),  # a partial row only
    ]
    changes = {0: 5003 * 4 - 1, 1: 100, 2: 3 * 4096 + 5, 4: 0}  # slot -> byte to flip
    sums = DeviceSums(_InlineStreams())
    for slot, t in enumerate(tensors):
        sums.reserve(slot, t)
    for slot, t in enumerate(tensors):
        sums.measure(slot, 0, t)
    for slot, at in changes.items():
        tensors[slot].view(-1).view(torch.uint8)[at] ^= 0x10
    for slot, t in enumerate(tensors):
        sums.measure(slot, 1, t)
    assert sums.changed() == sorted(changes)


def _measured(tensors, change, monkeypatch=None):
    from safe_ckpt.staging.source_sums import DeviceSums

    sums = DeviceSums(_InlineStreams())
    for slot, t in enumerate(tensors):
        sums.reserve(slot, t)
    for slot, t in enumerate(tensors):
        sums.measure(slot, 0, t)
    change()
    for slot, t in enumerate(tensors):
        sums.measure(slot, 1, t)
    return sums, sums.changed()


def test_the_device_sums_of_a_large_source_are_summed_in_bounded_slices_equal_to_one_sum(monkeypatch):
    """A source larger than a slice is summed slice by slice (torch widens what it sums: the
    device memory a measurement takes stays bounded): the sums equal the exact int64 row sums of the
    whole source, and a one-byte change in any slice is found."""
    from safe_ckpt.staging import source_sums

    monkeypatch.setattr(source_sums, "WIDE_BYTES", 3 * source_sums.ROW_BYTES * 2)  # 3 rows of int32 words
    g = torch.Generator().manual_seed(27)
    tensors = [torch.randn(10 * 1024 + 9, generator=g), torch.randn(7 * 2048, generator=g).to(torch.bfloat16)]
    summed = []
    real_sum = torch.sum

    def counting(t, *args, **kwargs):
        summed.append(t.numel() * t.element_size())
        return real_sum(t, *args, **kwargs)

    monkeypatch.setattr(torch, "sum", counting)
    def change():
        tensors[0].view(torch.uint8)[8 * 4096 + 3] ^= 0x5A  # in the third slice

    sums, changed = _measured(tensors, change)
    assert changed == [0]
    assert max(summed) <= 3 * source_sums.ROW_BYTES and len(summed) >= 2 * (4 + 3)
    for slot, t in enumerate(tensors):  # phase 1 (after the change) equals the exact row sums
        device, first, rows = sums._slots[slot]
        words = t.reshape(-1).view(torch.int32).to(torch.int64)
        whole = words.numel() // 1024
        expect = words[:whole * 1024].view(whole, 1024).sum(dim=1)
        assert torch.equal(sums._buffers[(None, 1)][first:first + whole], expect), slot


def test_a_deferred_window_opens_at_its_trigger_or_at_the_latest_at_the_next_gate(tmp_path):
    """The copies of a save may start at the next step (Megatron synchronizes the device right after
    the save call): the step's trigger opens the window in the training thread; without a trigger,
    the next optimizer step's gate opens it first, so no write can come before the copies."""
    for trigger in (True, False):
        w, opt = adamw_state(4 * CHUNK, seed=16)
        pre = w.detach().clone()
        window, jobs = make_window({"w": w}, device_keys=("w",), name=str(tmp_path / f"ck{trigger}"))
        writer = Writer(window, gated=False)
        copier = WindowCopier(window, PinnedPool(1 << 20, pinned=False))
        opened_in = []

        def opener():
            opened_in.append(threading.current_thread().name)
            rest = copier.open(jobs, writer.put)
            gates.track(window)
            copier.run(rest, writer.put)
            writer.close()

        gates.defer(opener)
        assert not window.is_open
        if trigger:
            gates.open_deferred()
            assert window.is_open
        opt.step()  # without the trigger, the gate opens the window first
        window.settle()
        assert opened_in == [threading.current_thread().name]  # the training thread, once
        assert writer.finished.wait(WAIT_S)
        expect_written(writer, "w", pre)


class _PauseAfterLastCapture(type(threading.Condition())):
    """The window's lock; the capturing thread pauses right after leaving it once every chunk is in
    (a preemption there), until the test lets it go."""

    def __init__(self, window) -> None:
        super().__init__()
        self.window, self.left_lock, self.go = window, threading.Event(), threading.Event()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if threading.current_thread().name == "capturer" and self.window._incomplete == 0 \
                and not self.left_lock.is_set():
            self.left_lock.set()
            assert self.go.wait(WAIT_S)
        return out


def test_a_step_the_gate_let_go_after_the_last_capture_does_not_fail_the_save(tmp_path):
    """Once the last chunk of a host source is captured the gate lets the step go; the step's write
    is after the capture, so the save stays valid even if the capturing thread is preempted then."""
    w = torch.randn(2 * CHUNK, generator=torch.Generator().manual_seed(30))
    window, _ = make_window({"w": w}, name=str(tmp_path / "ck"))
    window._cond = _PauseAfterLastCapture(window)
    window.open()
    window.order_opening()
    gates.track(window)
    window.captured(0, CHUNK_BYTES)
    capturer = threading.Thread(target=window.captured, args=(0, CHUNK_BYTES), name="capturer", daemon=True)
    capturer.start()
    assert window._cond.left_lock.wait(WAIT_S)
    gates.before_update("the step")  # every byte is in: the gate lets the step go
    w.add_(1.0)
    window._cond.go.set()
    capturer.join(WAIT_S)
    window.settle()
    assert window.error is None


def test_an_in_place_write_to_a_non_contiguous_source_while_its_copies_run_fails_the_save(tmp_path):
    """No content sums cover a non-contiguous source: an in-place write after its copies were
    issued but before they landed, with no gate between, is seen by its version counter once they
    land. After a gate the same write is the step's own and the save stands."""
    for gated in (False, True):
        base = torch.randn(8, 2 * CHUNK, generator=torch.Generator().manual_seed(31))
        t = base[:, :CHUNK]  # rows of one chunk each, every other chunk skipped: not contiguous
        streams = QueuedStreams()
        source = WindowSource(index=0, key="t", tensor=t, device=0, chunks=8, size_bytes=t.numel() * 4,
                              version=t._version)
        window = CopyWindow([source], streams, HostSums(), name=str(tmp_path / f"ck{gated}"), rank=0,
                            timeout_s=WAIT_S, small_source_bytes=4096)
        jobs = [ChunkJob(0, t[k], ("t", 0, k)) for k in range(8)]
        writer = Writer(window, gated=False)
        held = streams.hold(0)  # no copy lands until the write was made
        stager, _ = start(window, jobs, writer, PinnedPool(1 << 20, pinned=False))
        stager.join(WAIT_S)
        assert window.all_in()
        if gated:  # the step's write is queued after the last copy (the current stream waits for it)
            gates.before_update("the step")
            assert streams.ordered_after[-1] is window.last_marks()[0]
        t.add_(1.0)
        held.set()
        if gated:
            window.settle()
            assert writer.finished.wait(WAIT_S) and window.error is None
        else:
            with pytest.raises(SourceModifiedError, match="'t' on rank 0"):
                window.settle()


class _SignalledStreams(HostStreams):
    """HostStreams that tell the test when a gate starts waiting for a mark on the host, once
    armed: the window's opening orders the caller after its own marks too, and must not count."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.ordering = threading.Event()
        self.landed_when_ordered: list[bool] = []

    def order_current_after(self, mark) -> None:
        if self.armed:
            self.landed_when_ordered.append(mark.done())
            self.ordering.set()
        super().order_current_after(mark)


def test_a_gate_waiting_on_the_host_for_copies_to_land_counts_in_the_window_stats(tmp_path):
    """Without CUDA the caller's "current stream" is the host: a gate met once every copy is issued
    but before they landed blocks the host, and the window's stats say so."""
    w, opt = adamw_state(4 * CHUNK, seed=32)
    streams = _SignalledStreams()
    window, jobs = make_window({"w": w}, device_keys=("w",), streams=streams, name=str(tmp_path / "ck"))
    writer = Writer(window, gated=False)
    copier = WindowCopier(window, PinnedPool(1 << 20, pinned=False))
    rest = copier.open(jobs, writer.put)
    gates.track(window)
    streams.armed = True  # from here on only the step's gate orders the host after a mark
    held = streams.hold(0)  # after the opening: no copy of the rest lands until the test says so
    stager, _, stage_errors = in_thread(lambda: copier.run(rest, writer.put))
    stager.join(WAIT_S)
    writer.close()
    assert window.all_in() and not stage_errors, stage_errors
    stepper, stepped, errors = in_thread(opt.step)
    assert streams.ordering.wait(WAIT_S) and not stepped.is_set()
    assert streams.landed_when_ordered == [False]  # the gate met the held copies, not landed ones
    held.set()
    assert stepped.wait(WAIT_S) and not errors, errors
    window.settle()
    assert writer.finished.wait(WAIT_S)
    stats = window.stats()
    assert stats.gates == 1 and stats.blocked_gates == 1 and stats.gate_wait_s > 0, stats


class _CountingPool(PinnedPool):
    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes, pinned=False)
        self.leases = 0

    def lease(self, nbytes, timeout_s=None, cancel=None, on_wait=None):
        lease = super().lease(nbytes, timeout_s, cancel, on_wait)
        self.leases += 1
        return lease


def _small_and_big(seed: int, small: int = 40):
    g = torch.Generator().manual_seed(seed)
    tensors = {f"norm{i}": torch.randn(64 + 7 * i, generator=g) for i in range(small)}
    tensors["big"] = torch.randn(3 * CHUNK, generator=g)
    return tensors


def test_the_small_device_sources_share_one_lease_and_need_no_sums_once_copied_at_the_opening(tmp_path):
    tensors = _small_and_big(21)
    pre = {k: t.clone() for k, t in tensors.items()}
    window, jobs = make_window(tensors, device_keys=tuple(tensors), small_bytes=CHUNK_BYTES)
    sums = window.sums
    writer = Writer(window, gated=False)
    pool = _CountingPool(4 << 20)
    copier = WindowCopier(window, pool)
    rest = copier.open(jobs, writer.put)
    gates.track(window)
    assert pool.leases == 1  # the 40 small sources, one lease; the big one's chunks come later
    assert {window.sources[j.source].key for j in rest} == {"big"}
    assert len(window._slots) == 1 and window.sources[next(iter(window._slots))].key == "big"
    for i in range(40):  # a write no gate orders, after the opening: their copies came first
        tensors[f"norm{i}"].data.add_(1.0)
    copier.run(rest, writer.put)
    gates.before_update("the optimizer step")
    writer.close()
    window.settle()
    assert writer.finished.wait(WAIT_S)
    for key, t in pre.items():
        expect_written(writer, key, t)
    assert pool.stats().leased_bytes == 0  # every part released gives the shared lease back
    assert sums is not None


def test_small_sources_whose_shared_lease_is_not_free_at_once_are_copied_later_and_summed(tmp_path):
    """A pool too small for every small source at once: each is staged on its own, those that do
    not fit come after the opening with sums, and a `.data` write to one before its copy fails the save."""
    tensors = _small_and_big(22, small=6)
    for i in range(6):
        tensors[f"norm{i}"] = torch.randn(3000, generator=torch.Generator().manual_seed(30 + i))  # 12 KB: 3 pages each
    streams = HostStreams()
    window, jobs = make_window(tensors, device_keys=tuple(tensors), small_bytes=CHUNK_BYTES, streams=streams,
                               name=str(tmp_path / "ck"))
    writer = Writer(window, gated=True)
    pool = _CountingPool(17 * 4096)  # five small sources (3 pages each) fit, not six; a big chunk is 16 pages
    copier = WindowCopier(window, pool)
    rest = copier.open(jobs, writer.put)
    gates.track(window)
    later = [window.sources[j.source].key for j in rest if window.sources[j.source].key != "big"]
    assert later == ["norm5"], later
    held = streams.hold(0)
    tensors["norm5"].data.copy_(torch.randn(3000))  # before its copy, outside every hook

    def run():
        copier.run(rest, writer.put)

    thread, done, errors = in_thread(run)
    writer.allow(100)
    held.set()
    assert done.wait(WAIT_S) and not errors, errors
    writer.close()
    with pytest.raises(SourceModifiedError) as caught:
        window.settle()
    assert "'norm5'" in str(caught.value)
    assert writer.finished.wait(WAIT_S)


def test_a_shared_lease_goes_back_only_once_every_part_is_released_a_second_release_being_a_no_op():
    from safe_ckpt.staging.pool import reserved_bytes, split

    pool = PinnedPool(64 << 10, pinned=False)
    sizes = [100, 5000, 64]
    lease = pool.lease(sum(reserved_bytes(n) for n in sizes))
    parts = split(lease, sizes)
    parts[0].release()
    parts[0].release()  # a second release of the same part must not stand for another part's
    parts[1].release()
    assert pool.stats().leased_bytes > 0  # the third part still holds the lease
    parts[2].release()
    assert pool.stats().leased_bytes == 0


def test_small_sources_staged_after_a_busy_opening_are_counted_once_by_the_device_sums_rule():
    """A pool that holds every chunk at once only without device sums, busy at the opening (another
    lease held): the small sources go to the staging thread, and the rule that turns the sums off
    must count them once, or the big chunk's sums overflow the pool and its lease waits for writes."""
    from safe_ckpt.integrity import grid_bytes
    from safe_ckpt.staging.pool import reserved_bytes
    from safe_ckpt.staging.stager import GRID_MIN_PAYLOAD_BYTES

    g = torch.Generator().manual_seed(41)
    big = GRID_MIN_PAYLOAD_BYTES // 4
    tensors = {f"norm{i}": torch.randn(16 * 1024, generator=g) for i in range(4)}  # 64 KiB each
    tensors["big"] = torch.randn(big, generator=g)
    window, jobs = make_window(tensors, device_keys=tuple(tensors), chunk=big, small_bytes=1 << 20)
    plain = sum(reserved_bytes(t.numel() * 4) for t in tensors.values())
    assert grid_bytes(GRID_MIN_PAYLOAD_BYTES) + 4096 <= plain - reserved_bytes(GRID_MIN_PAYLOAD_BYTES)
    pool = PinnedPool(plain, pinned=False)
    waited = threading.Event()
    first = threading.Event()

    def on_wait():
        waited.set()
        first.set()

    copier = WindowCopier(window, pool, grid=True, on_wait=on_wait)
    writer = Writer(window, gated=True)  # nothing is written, so nothing is freed, until allowed
    other = pool.lease(plain)  # another save's chunk, still being written at the opening
    rest = copier.open(jobs, writer.put)
    assert len(rest) == len(jobs)  # every small source waits for the staging thread
    other.release()

    def run():
        try:
            copier.run(rest, writer.put)
        finally:
            first.set()

    thread, done, errors = in_thread(run)
    assert first.wait(WAIT_S)
    no_wait = not waited.is_set()
    writer.allow(100)
    assert done.wait(WAIT_S) and not errors, errors
    writer.close()
    window.settle()
    assert writer.finished.wait(WAIT_S)
    for key, t in tensors.items():
        assert writer.written[(key, 0)] == t.numpy().tobytes(), key
    assert no_wait, "a lease waited for writes: the sums were kept although only they overflow the pool"
