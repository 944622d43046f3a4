"""Many small items bound for the pinned pool (the GPU path): those lying back to back in a file
are gathered into one read of one piece, even above `batch_bytes`; they load bit for bit as
stock `dist_checkpointing.load` loads them, and a changed byte in an item inside such a read is
refused naming that item's key."""

import dataclasses
import os

import pytest
import torch

import safe_ckpt
from safe_ckpt.errors import ReadError
from safe_ckpt.loading import plan
from safe_ckpt.loading.index import read_index
from safe_ckpt.loading.source import DirectorySource

PIECE = 64 << 10


def _state(seed: int = 5) -> dict:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(500, 6000, (40,), generator=g).tolist()  # 2-24 KB items, several per piece
    return {f"p{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}


def _sharded(tensors: dict) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}


@pytest.fixture()
def saved(tmp_path):
    state = _state()
    path = str(tmp_path / "ckpt")
    safe_ckpt.save(_sharded(state), path)
    return path, state


def _options(reports: list) -> safe_ckpt.LoadOptions:
    # batch_bytes=0: only the gathering of items bound for the pool puts two items in one read
    return safe_ckpt.LoadOptions(io_threads=2, staging_budget_bytes=1 << 20, piece_bytes=PIECE, batch_bytes=0,
                                 on_read=reports.append)


def _through_pool(monkeypatch) -> None:
    """Host templates travel as GPU ones do: pool pieces, then byte copies."""
    stock = plan.destination
    monkeypatch.setattr(plan, "destination", lambda sh: dataclasses.replace(stock(sh), memory=None))


@pytest.fixture()
def one_rank(tmp_path):
    """A one-rank gloo world: stock load needs a process group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_items_bound_for_the_pool_share_reads_and_load_as_stock_does(saved, one_rank, monkeypatch):
    from megatron.core import dist_checkpointing

    path, state = saved
    stock_out = {k: torch.full_like(v, 7) for k, v in state.items()}
    dist_checkpointing.load(_sharded(stock_out), path)
    _through_pool(monkeypatch)
    reports, out = [], {k: torch.full_like(v, 7) for k, v in state.items()}
    captured = []
    build = plan.build
    monkeypatch.setattr(plan, "build", lambda *a, **kw: captured.append(build(*a, **kw)) or captured[-1])
    safe_ckpt.load(_sharded(out), path, _options(reports))
    read_plan = captured[-1][0]
    assert max(len(b.items) for b in read_plan.batches) > 1, [len(b.items) for b in read_plan.batches]
    assert all(b.length_bytes <= PIECE for b in read_plan.batches if len(b.items) > 1)
    assert len(read_plan.batches) < len(state) // 2
    for k in state:
        assert torch.equal(out[k].view(torch.uint8), stock_out[k].view(torch.uint8)), k
        assert torch.equal(out[k], state[k]), k
    assert reports[-1].items == len(state) and reports[-1].verified == len(state)


def test_a_changed_byte_inside_a_gathered_read_is_refused_naming_its_key(saved, monkeypatch):
    path, state = saved
    _through_pool(monkeypatch)
    captured = []
    build = plan.build
    monkeypatch.setattr(plan, "build", lambda *a, **kw: captured.append(build(*a, **kw)) or captured[-1])
    safe_ckpt.load(_sharded({k: torch.empty_like(v) for k, v in state.items()}), path, _options([]))
    batch = max(captured[-1][0].batches, key=lambda b: len(b.items))
    victim = batch.items[len(batch.items) // 2]  # neither the first nor the last item of its read
    assert 0 < len(batch.items) // 2 < len(batch.items) - 1 or len(batch.items) == 2
    item = read_index(DirectorySource(path)).tensors[victim.fqn].chunks[0].item
    full = os.path.join(path, item.relative_path)
    with open(full, "r+b") as f:
        at = item.offset_bytes + item.length_bytes // 2  # inside the payload
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(ReadError) as info:
        safe_ckpt.load(_sharded({k: torch.empty_like(v) for k, v in state.items()}), path, _options([]))
    message = str(info.value)
    assert "checksum mismatch" in message and repr(victim.fqn) in message, message


def test_a_changed_byte_inside_a_gathered_read_is_reported_under_its_own_key(saved, monkeypatch):
    """The failure's key (what the error's summary line and `failures` name) is the corrupt item's,
    not the key of the first item its read gathered."""
    path, state = saved
    _through_pool(monkeypatch)
    captured = []
    build = plan.build
    monkeypatch.setattr(plan, "build", lambda *a, **kw: captured.append(build(*a, **kw)) or captured[-1])
    safe_ckpt.load(_sharded({k: torch.empty_like(v) for k, v in state.items()}), path, _options([]))
    batch = max(captured[-1][0].batches, key=lambda b: len(b.items))
    assert len(batch.items) > 1
    victim = batch.items[-1]  # not the first item of its read
    item = read_index(DirectorySource(path)).tensors[victim.fqn].chunks[0].item
    with open(os.path.join(path, item.relative_path), "r+b") as f:
        at = item.offset_bytes + item.length_bytes // 2
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(ReadError) as info:
        safe_ckpt.load(_sharded({k: torch.empty_like(v) for k, v in state.items()}), path, _options([]))
    assert [f.key for f in info.value.failures] == [victim.fqn], (str(info.value), batch.items[0].fqn)
    assert f"key {victim.fqn!r}:" in str(info.value).splitlines()[1], str(info.value)


def test_a_load_shorter_than_the_progress_interval_logs_no_progress_line(saved, monkeypatch):
    """Progress lines come once per interval of a long read, not as each reader thread ends: the
    readers here start only once the caller waits for them, so each one ends inside that wait."""
    import sys
    import threading

    from safe_ckpt.loading import execute

    path, state = saved
    lines = []
    stock_loop = execute.Reader._loop
    main = threading.main_thread().ident

    def in_join() -> bool:
        frame = sys._current_frames().get(main)
        while frame is not None:
            if frame.f_code.co_name == "join" and frame.f_code.co_filename == threading.__file__:
                return True
            frame = frame.f_back
        return False

    def loop_once_the_caller_waits(self):
        pause = threading.Event()
        for _ in range(60000):  # bounded: at most about a minute
            if in_join():
                break
            pause.wait(0.001)
        stock_loop(self)

    monkeypatch.setattr(execute.Reader, "_loop", loop_once_the_caller_waits)
    monkeypatch.setattr(execute.Reader, "_progress", lambda self, t0: lines.append(t0))
    templates = _sharded({k: torch.empty_like(v) for k, v in state.items()})
    out = safe_ckpt.load(templates, path, safe_ckpt.LoadOptions(io_threads=4, progress_interval_s=600.0))
    assert lines == [], lines
    for k, v in state.items():
        assert torch.equal(out[k], v), k


def test_a_read_held_up_for_many_intervals_logs_one_progress_line_not_one_per_missed_interval(saved, monkeypatch):
    """The reader's clock jumps 50 intervals while its threads are held (a stopped process, a
    starved interpreter): one progress line follows, not a burst of 50 as the schedule catches up."""
    import threading
    import time
    import types

    from safe_ckpt.loading import execute

    path, state = saved
    interval, calls, lines = 0.01, [], []
    go = threading.Event()
    stock_loop = execute.Reader._loop

    def held_loop(self):
        assert go.wait(60), "the test never let the readers go"
        stock_loop(self)

    def clock():
        if threading.current_thread() is threading.main_thread():
            calls.append(None)
            if len(calls) == 12:  # a few turns of the progress loop after the jump: the readers go and end
                go.set()
                for t in threading.enumerate():
                    if t.name.startswith("safe_ckpt-read-"):
                        t.join(60)
            return 1000.0 if len(calls) == 1 else 1000.0 + 50.5 * interval
        return time.perf_counter()

    monkeypatch.setattr(execute.Reader, "_loop", held_loop)
    monkeypatch.setattr(execute.Reader, "_progress", lambda self, t0: lines.append(len(calls)))
    monkeypatch.setattr(execute, "time", types.SimpleNamespace(perf_counter=clock))
    templates = _sharded({k: torch.empty_like(v) for k, v in state.items()})
    out = safe_ckpt.load(templates, path, safe_ckpt.LoadOptions(io_threads=2, progress_interval_s=interval))
    assert len(calls) >= 12, calls
    assert len(lines) == 1, lines
    for k, v in state.items():
        assert torch.equal(out[k], v), k


@pytest.mark.parametrize("algorithm", ["xxh3_64", "crc32", "grid32+xxh3_64", "grid32+crc32"])
def test_an_item_hashed_in_one_call_gets_the_checksum_its_pieces_give(algorithm):
    """The gathered read hashes each item with one call; the value is the one a hasher fed in pieces
    (as the save and `verify` compute it) gives, for every algorithm a manifest row may name."""
    from safe_ckpt import integrity

    g = torch.Generator().manual_seed(11)
    data = torch.randint(0, 256, (3 * integrity.GRID_ROW_BYTES + 777,), dtype=torch.uint8, generator=g).numpy()
    row = integrity.ItemChecksum("__0_0.distcp", 0, data.nbytes, 0, "k", algorithm, 64, data.nbytes - 100)
    hasher = integrity.item_hasher(row, "crc32")
    for start in range(0, data.nbytes, 1000):
        hasher.update(memoryview(data)[start:start + 1000])
    whole = integrity.item_checksum(row, "crc32", memoryview(data))
    assert whole == hasher.value()
    changed = data.copy()
    changed[data.nbytes // 2] ^= 4
    assert integrity.item_checksum(row, "crc32", memoryview(changed)) != whole
