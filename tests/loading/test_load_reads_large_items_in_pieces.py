"""An item bigger than a piece is read by every reader thread as piece-sized ranges: bit-exact into
host tensors and through the pool (the GPU path), its checksum checked as one item (sequential
xxh3 / CRC-32 fed in order, and the grid form assembled from per-piece sums), a changed byte
refused, and a piece that fails stops the threads waiting on it."""

import dataclasses
import json
import os

import pytest
import torch

import safe_ckpt
from safe_ckpt import integrity
from safe_ckpt.errors import ReadError
from safe_ckpt.loading import container, plan, split
from safe_ckpt.loading.index import read_index
from safe_ckpt.loading.source import DirectorySource
from safe_ckpt.names import MANIFEST_FILE

PIECE = 64 << 10


def _state(seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(300_001, generator=g), "b": torch.randn(1000, 77, generator=g).to(torch.bfloat16),
            "c": torch.randn(5, generator=g)}


@pytest.fixture()
def saved(tmp_path):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    state = _state()
    path = str(tmp_path / "ckpt")
    safe_ckpt.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in state.items()}, path)
    return path, state


def _load(path: str, state: dict, pool: bool = False, threads: int | None = None,
          staging_budget_bytes: int = 1 << 20, **kw):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    reports = []
    out = {k: torch.full_like(v, 7) for k, v in state.items()}
    stock = plan.destination
    if pool:  # host templates travel as GPU ones do: pool pieces, then byte copies
        plan.destination = lambda sh: dataclasses.replace(stock(sh), memory=None)
    try:
        safe_ckpt.load({k: ShardedTensor.from_rank_offsets(k, out[k]) for k in state}, path,
                       safe_ckpt.LoadOptions(io_threads=threads or 3, staging_budget_bytes=staging_budget_bytes,
                                             piece_bytes=PIECE,
                                             batch_bytes=16 << 10, on_read=reports.append, **kw))
    finally:
        plan.destination = stock
    return out, reports[-1]


def _item(path: str, key: str):
    chunk = read_index(DirectorySource(path)).tensors[key].chunks[0]
    return chunk, container.frame(torch.float32, chunk.sizes)


def _as_grid(path: str, key: str) -> None:
    """Rewrite the manifest row of ``key``'s first item as the grid checksum a GPU save records."""
    chunk, f = _item(path, key)
    with open(os.path.join(path, chunk.item.relative_path), "rb") as fh:
        fh.seek(chunk.item.offset_bytes)
        raw = fh.read(chunk.item.length_bytes)
    n = f.payload_bytes
    payload = torch.frombuffer(bytearray(raw[f.prefix_bytes:f.prefix_bytes + n]), dtype=torch.uint8)
    rows_end = f.prefix_bytes + n // integrity.GRID_ROW_BYTES * integrity.GRID_ROW_BYTES
    value = integrity.grid_fold(raw[:f.prefix_bytes], n, integrity.grid_sums(payload).numpy().tobytes(),
                                raw[rows_end:f.prefix_bytes + n], raw[f.prefix_bytes + n:])
    manifest_path = os.path.join(path, MANIFEST_FILE)
    with open(manifest_path) as fh:
        manifest = json.load(fh)
    rows = [r for r in manifest["items"][chunk.item.relative_path] if r[0] == chunk.item.offset_bytes]
    assert len(rows) == 1
    rows[0][2:] = [value, rows[0][3], {"algorithm": integrity.GRID_ALGORITHM, "payload": [f.prefix_bytes, n]}]
    with open(manifest_path, "w") as fh:
        json.dump(manifest, fh)


def _flip_payload_byte(path: str, key: str) -> None:
    chunk, f = _item(path, key)
    with open(os.path.join(path, chunk.item.relative_path), "r+b") as fh:
        at = chunk.item.offset_bytes + f.prefix_bytes + f.payload_bytes // 2
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 1]))


def test_large_items_become_piece_tasks_first_round_robin(saved):
    path, state = saved
    source = DirectorySource(path)
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    requests = [ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in state.items()]
    index = read_index(source)
    read_plan, problems = plan.build(requests, index, source, rank=0, batch_bytes=16 << 10, piece_bytes=PIECE,
                                     checksums=True)
    assert not problems
    tasks = split.tasks(read_plan.batches, source, piece_bytes=PIECE, threads=3, algorithm=index.checksum_algorithm)
    pieces = [t for t in tasks if isinstance(t, split.PieceTask)]
    big = [b for b in read_plan.batches if b.items[0].item.length_bytes > PIECE]
    assert len(big) >= 3 and len(pieces) > len(big)
    assert tasks[:len(pieces)] == pieces  # the pieces go first
    assert len({id(t.item) for t in pieces[:len(big)]}) == len(big)  # one of each item before any second
    for item in {id(t.item): t.item for t in pieces}.values():
        mine = [t for t in pieces if t.item is item]
        assert [t.index for t in mine] == list(range(len(mine)))
        assert mine[0].start == 0 and mine[-1].end == item.read.frame.payload_bytes
        assert all(a.end == b.start for a, b in zip(mine, mine[1:]))
    assert split.tasks(read_plan.batches, source, piece_bytes=PIECE, threads=1, algorithm="") == list(read_plan.batches)


@pytest.mark.parametrize("pool", [False, True], ids=["host", "pool"])
@pytest.mark.parametrize("grid", [False, True], ids=["xxh3", "grid"])
def test_pieces_load_bit_exact_and_every_checksum_is_checked(saved, pool, grid):
    path, state = saved
    if grid:
        _as_grid(path, "a")
    out, report = _load(path, state, pool)
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert report.verified == report.items and report.unverified == 0 and report.decoded == 0, report
    assert report.read_s > 0 and report.hash_s > 0 and report.wait_s >= 0, report  # where the threads' time went
    assert (report.copy_s > 0) == pool, report  # issuing copies out of pieces: only the pool path has them
    _flip_payload_byte(path, "a")
    with pytest.raises(ReadError, match=r"key 'a'.*checksum mismatch"):
        _load(path, state, pool)
    out, report = _load(path, state, pool, verify_checksums=False)
    assert report.verified == 0 and not torch.equal(out["a"], state["a"])
    assert report.read_s > 0, report


@pytest.mark.timeout(60)
def test_a_failing_piece_stops_the_threads_waiting_for_it(saved, monkeypatch):
    path, state = saved
    chunk, f = _item(path, "a")
    first_payload = chunk.item.offset_bytes + f.prefix_bytes
    stock = DirectorySource.readv

    def readv(self, name, offset_bytes, buffers):
        if name == chunk.item.relative_path and offset_bytes == first_payload:
            raise ReadError(f"{name}: injected failure at {offset_bytes}")
        return stock(self, name, offset_bytes, buffers)

    monkeypatch.setattr(DirectorySource, "readv", readv)
    with pytest.raises(ReadError, match="injected failure"):
        _load(path, state)


@pytest.mark.parametrize("n", [4096 * 5, 4096 * 7 + 1234])
def test_grid_from_pieces_in_any_order_and_from_the_whole_payload_equals_the_streamed_one(n):
    import threading

    g = torch.Generator().manual_seed(n)
    payload = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    prefix, suffix = b"head-bytes", b"tail-bytes!"
    streamed = integrity.GridHasher(integrity.GRID_ALGORITHM, len(prefix), n)
    for part in (prefix, payload.numpy().tobytes(), suffix):
        streamed.update(part)
    fold = integrity.GRID_ALGORITHM[len(integrity.GRID_PREFIX):]
    pieces, lock = split._Grid(fold, n), threading.Lock()
    for start in reversed(range(0, n, 8192)):  # pieces of two rows, last first
        pieces.add(start, payload[start:start + 8192].numpy(), lock)
    whole = split._Grid(fold, n)
    whole.from_summed(whole.summed(payload).numpy())
    assert pieces.value(prefix, suffix) == whole.value(prefix, suffix) == streamed.value()
    changed = payload.clone()
    changed[n // 3] ^= 1
    other = split._Grid(fold, n)
    other.from_summed(other.summed(changed).numpy())
    assert other.value(prefix, suffix) != streamed.value()


@pytest.mark.parametrize("dtype,sizes", [(torch.float32, (300,)), (torch.bfloat16, (7, 33))])
def test_the_archive_tail_shortcut_gives_the_full_checks_verdict_for_every_changed_byte(dtype, sizes):
    from safe_ckpt.encoding import torchzip

    f, c = container.frame(dtype, sizes), torchzip.tensor_container(dtype, sizes)  # a fresh serialization id
    tail = bytearray(c.suffix_template)
    for at in c.crc_offsets:  # a writer that fills the payload's CRC
        tail[at:at + 4] = b"\x12\x34\x56\x78"
    assert container.payload_is_framed(f, c.prefix, tail) and container._suffix_is_framed(f, tail)
    verdicts = set()
    for i in range(len(tail)):
        bad = bytearray(tail)
        bad[i] ^= 0xFF
        full = container._suffix_is_framed(f, bad)
        assert container.payload_is_framed(f, c.prefix, bad) == full, i
        verdicts.add(full)
    assert verdicts == {True, False}  # some bytes are never read (ids, CRCs), the rest are
    assert not container.payload_is_framed(f, c.prefix, tail[:-1])


@pytest.mark.timeout(90)
def test_pieces_finish_when_another_user_holds_part_of_the_pool(saved, monkeypatch):
    """A thread blocked waiting for pool memory must not hold a piece whose hash another thread
    waits for. Half the pool is held elsewhere (a save's staging, another load), so only one of the
    two threads gets pieces; the first piece's read waits until the other thread is blocked in the
    pool, the order in which a thread holding a task there would stall the load until its timeout."""
    import threading

    from safe_ckpt.staging import pool as pool_mod

    path, state = saved
    budget = 4 * PIECE  # two threads x two pieces each
    shared = pool_mod.shared_pool(budget)
    other = shared.lease(2 * PIECE)
    blocked, callers, stock_lease = threading.Event(), set(), type(shared).lease

    def lease(self, *a, **kw):
        callers.add(threading.get_ident())
        if len(callers) == 2:
            blocked.set()
        return stock_lease(self, *a, **kw)

    chunk, f = _item(path, "a")
    first_payload = chunk.item.offset_bytes + f.prefix_bytes
    stock_readv = DirectorySource.readv

    def readv(self, name, offset_bytes, buffers):
        if name == chunk.item.relative_path and offset_bytes == first_payload:
            assert blocked.wait(30), "the second reader thread never asked the pool for memory"
        return stock_readv(self, name, offset_bytes, buffers)

    monkeypatch.setattr(type(shared), "lease", lease)
    monkeypatch.setattr(DirectorySource, "readv", readv)
    try:
        out, report = _load(path, state, pool=True, threads=2, staging_budget_bytes=budget, collective_timeout_s=20)
    finally:
        other.release()
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert report.verified == report.items
