"""A copy window opened with the opener's streams held: the opener's thread only fences and holds,
the staging thread copies the small sources and takes the opening sums, and the hold is released
once they are done, on every path.

On CUDA the hold is a device-side wait on a host word (`staging.stream_hold`); here the copy streams
are `HostStreams` (worker threads standing for devices) with a hold that records when and by whom it
was released, so the orchestration is checked deterministically: every wait is on an event."""

from __future__ import annotations

import threading

import pytest
import torch

from safe_ckpt import saving
from safe_ckpt.errors import CheckpointError
from safe_ckpt.options import SaveOptions
from safe_ckpt.staging import gates
from safe_ckpt.staging import streams as streams_mod
from safe_ckpt.staging.window_copier import WindowCopier
from safe_ckpt.write import window_staging

WAIT_S = 20.0


class RecordedHold:
    def __init__(self, streams: "HeldStreams", devices) -> None:
        self.streams = streams
        self.devices = tuple(devices)
        self.released_by: str | None = None
        self.marks_done_at_release: bool | None = None
        self.released_event = threading.Event()

    def release(self) -> None:
        if self.released_event.is_set():
            return
        self.released_by = threading.current_thread().name
        window = self.streams.window
        self.marks_done_at_release = all(m.done() for m in window.last_marks().values())
        self.released_event.set()


class HeldStreams(streams_mod.HostStreams):
    """HostStreams whose opener's streams can be "held"; records the thread of every copy."""

    def __init__(self) -> None:
        super().__init__()
        self.holds: list[RecordedHold] = []
        self.copy_threads: set[str] = set()
        self.window = None

    def hold_current(self, devices):
        hold = RecordedHold(self, devices)
        self.holds.append(hold)
        return hold

    def copy(self, device, dst, src):
        self.copy_threads.add(threading.current_thread().name)
        super().copy(device, dst, src)


@pytest.fixture
def held_streams(monkeypatch):
    made: list[HeldStreams] = []

    def streams_for(devices, page_locked=True):
        made.append(HeldStreams())
        return made[-1]

    monkeypatch.setattr(window_staging, "streams_for", streams_for)
    inner = window_staging.CopyWindow.__init__

    def init(self, *args, **kwargs):
        inner(self, *args, **kwargs)
        if isinstance(self.streams, HeldStreams):
            self.streams.window = self

    monkeypatch.setattr(window_staging.CopyWindow, "__init__", init)
    return made


def _state(gen):
    from megatron.core.dist_checkpointing import ShardedTensor

    tensors = {f"small{i}": torch.randn(1000 + 37 * i, generator=gen) for i in range(5)}  # under 1 MiB each
    tensors["large"] = torch.randn(1 << 19, generator=gen)  # 2 MiB: copied by the staging thread's run
    return tensors, {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}


def _load(path, tensors):
    """Through stock megatron-core, in a one-rank gloo group of this process."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{path}.store", rank=0, world_size=1)
    try:
        return _stock_load(dist_checkpointing, ShardedTensor, path, tensors)
    finally:
        if owned:
            dist.destroy_process_group()


def _stock_load(dist_checkpointing, ShardedTensor, path, tensors):
    return dist_checkpointing.load({k: ShardedTensor.from_rank_offsets(k, torch.empty_like(t), replica_id=0)
                                    for k, t in tensors.items()}, path)


def test_the_opener_only_fences_and_holds_and_the_staging_thread_releases_after_the_opening(tmp_path, held_streams):
    tensors, sharded = _state(torch.Generator().manual_seed(11))
    expected = {k: t.clone() for k, t in tensors.items()}
    opts = SaveOptions(return_after="planned", collective_timeout_s=WAIT_S, progress_interval_s=0)
    handle = saving.start(sharded, str(tmp_path / "ck"), options=opts, asynchronous=True,
                          copy_start="deferred").in_background()
    opener = threading.current_thread().name
    gates.open_deferred()  # the trigger: returns once fenced and held
    (streams,) = held_streams
    (hold,) = streams.holds
    assert hold.released_event.wait(WAIT_S)
    assert opener not in streams.copy_threads  # no copy was enqueued by the opener's thread
    assert hold.released_by != opener and hold.marks_done_at_release is True
    gates.before_update()  # a gate still waits for what is left
    for t in tensors.values():
        t.add_(1.0)
    handle.wait(WAIT_S)
    loaded = _load(str(tmp_path / "ck"), tensors)
    assert all(torch.equal(loaded[k], expected[k]) for k in tensors)
    stats = handle.window_stats()
    assert stats.opening_held and stats.copied_bytes == sum(t.numel() * 4 for t in tensors.values())


def test_a_failure_in_the_held_opening_releases_the_hold_and_fails_the_save(tmp_path, held_streams, monkeypatch):
    tensors, sharded = _state(torch.Generator().manual_seed(12))

    def broken(self, jobs, put):
        raise RuntimeError("injected: the opening could not stage the small sources")

    monkeypatch.setattr(WindowCopier, "_stage_opening", broken)
    opts = SaveOptions(return_after="planned", collective_timeout_s=WAIT_S, progress_interval_s=0)
    handle = saving.start(sharded, str(tmp_path / "ck"), options=opts, asynchronous=True,
                          copy_start="deferred").in_background()
    gates.open_deferred()
    (hold,) = held_streams[0].holds
    assert hold.released_event.wait(WAIT_S)
    gates.before_update()  # returns: the failed window lets every gate go on
    with pytest.raises(CheckpointError, match="injected"):
        handle.wait(WAIT_S)
    assert not (tmp_path / "ck").exists()


def test_without_a_hold_the_opener_copies_the_small_sources_itself(tmp_path):
    """HostStreams (the CPU path) cannot hold: the opening runs in the opener's thread, as before."""
    assert streams_mod.HostStreams().hold_current([0]) is None
    tensors, sharded = _state(torch.Generator().manual_seed(13))
    seen: set[str] = set()
    inner = streams_mod.HostStreams.copy

    def copy(self, device, dst, src):
        seen.add(threading.current_thread().name)
        inner(self, device, dst, src)

    streams_mod.HostStreams.copy = copy
    try:
        opts = SaveOptions(return_after="planned", collective_timeout_s=WAIT_S, progress_interval_s=0)
        handle = saving.start(sharded, str(tmp_path / "ck"), options=opts, asynchronous=True,
                              copy_start="deferred").in_background()
        gates.open_deferred()
        handle.wait(WAIT_S)
    finally:
        streams_mod.HostStreams.copy = inner
    assert threading.current_thread().name in seen and not handle.window_stats().opening_held
