"""Pure plan-stage logic: chunk splitting and validation verdicts (no processes)."""

import itertools

import pytest
import torch

from safe_ckpt.encoding.layout import lay_out_rank
from safe_ckpt.plan import build_global_plan
from safe_ckpt.plan.chunking import balanced_cuts, cut_rows, split_box
from safe_ckpt.plan.records import Box, ObjectRef, RankPlan, ShardRef
from safe_ckpt.plan.validate import validate


def _covers_exactly(sizes, boxes):
    seen = set()
    for b in boxes:
        for p in itertools.product(*(range(o, o + s) for o, s in zip(b.offsets, b.sizes))):
            assert p not in seen
            seen.add(p)
    return seen == set(itertools.product(*(range(s) for s in sizes)))


@pytest.mark.parametrize("sizes,itemsize,max_bytes", [
    ((10, 7), 4, 64), ((3, 4, 5), 2, 16), ((100,), 8, 24), ((2, 50), 4, 40), ((), 4, 4), ((0, 5), 4, 4),
    ((1, 1, 33), 2, 10),
])
def test_split_box_tiles_and_bounds(sizes, itemsize, max_bytes):
    boxes = split_box(sizes, itemsize, max_bytes)
    assert _covers_exactly(sizes, boxes) or 0 in sizes
    for b in boxes:
        assert b.numel * itemsize <= max(max_bytes, itemsize)
        # contiguous in a C-contiguous source: size 1 before some axis, full after it
        assert any(
            all(s == 1 for s in b.sizes[:a]) and b.sizes[a + 1:] == tuple(sizes[a + 1:])
            for a in range(max(1, len(sizes)))
        ) or not sizes


def _shard(key, rank, offsets, sizes, shape, dtype=torch.float32, main=True, local_index=0):
    return ShardRef(key, rank, local_index, dtype, shape, Box(offsets, sizes), main, "pageable", key)


@pytest.mark.parametrize("sizes,itemsize,cuts", [
    ((10, 7), 4, [1, 28, 29, 200]), ((1, 1, 33), 2, [3, 30]), ((5,), 8, [8, 16, 39]), ((4, 3), 4, []), ((), 4, [2]),
])
def test_cut_rows_tiles_at_row_boundaries_after_each_cut(sizes, itemsize, cuts):
    pieces = cut_rows(sizes, itemsize, cuts)
    assert _covers_exactly(sizes, pieces) or not sizes
    axis = next((i for i, s in enumerate(sizes) if s > 1), 0)
    row_bytes = itemsize
    for s in sizes[axis + 1:]:
        row_bytes *= s
    starts = [p.offsets[axis] * row_bytes for p in pieces[1:]]
    for c in cuts:  # every cut inside the box has a piece starting at the first row boundary >= it
        if sizes and 0 < -(-c // row_bytes) < sizes[axis]:
            assert -(-c // row_bytes) * row_bytes in starts


def test_balanced_cuts_skip_pieces_below_the_minimum():
    assert balanced_cuts([100, 100], 2, 1) == [[], []]  # the boundary is a shard edge
    assert balanced_cuts([300], 3, 1) == [[100, 200]]
    assert balanced_cuts([95, 105], 2, 10) == [[], []]  # 5 bytes left before the cut: too small
    assert balanced_cuts([10, 290], 3, 1) == [[], [90, 190]]


def _layout_file_bytes(shards, files, chunk_bytes):
    plan = build_global_plan([RankPlan(0, shards, [], [])], chunk_bytes, files)
    layout = lay_out_rank(plan, 0)
    return plan, [f.size_bytes for f in layout.files]


@pytest.mark.parametrize("preset", ["anchor", "many_small"])
def test_layout_balances_file_bytes_and_tiles_every_shard(preset):
    if preset == "anchor":  # the anchor preset's shapes: 8 bf16 weights, 12 fp32 optimizer buckets
        specs = [((18_000, 4096), torch.bfloat16)] * 8 + [((168_000_000,), torch.float32)] * 12
    else:  # qwen-like: many small pieces of uneven sizes
        g = torch.Generator().manual_seed(3)
        specs = [((int(n),), torch.float32) for n in torch.randint(1_000, 3_000_000, (300,), generator=g)]
    shards = [_shard(f"t{i}", 0, (0,) * len(shape), shape, shape, dtype, local_index=i)
              for i, (shape, dtype) in enumerate(specs)]
    plan, sizes = _layout_file_bytes(shards, 8, 256 << 20)
    assert len(sizes) == 8
    assert max(sizes) / (sum(sizes) / len(sizes)) < 1.01, sizes
    for i, s in enumerate(shards):
        boxes = [c.shard_box for c in plan.chunks if c.local_index == i]
        assert sum(b.numel for b in boxes) == s.box.numel
        assert all(b.numel * s.dtype.itemsize <= 256 << 20 for b in boxes)
        assert [b.offsets for b in boxes] == sorted(b.offsets for b in boxes)
    small = [_shard("a", 0, (0,), (1000,), (1000,)), _shard("b", 0, (0,), (10,), (10,), local_index=1)]
    plan, sizes = _layout_file_bytes(small, 8, 1 << 20)  # fewer whole chunks than files: one file each, no cuts
    assert len(sizes) == 2 and len(plan.chunks) == 2


def test_validate_accepts_irregular_tiling_and_non_main_overlap():
    plans = [
        RankPlan(0, [_shard("x", 0, (0,), (3,), (10,)), _shard("x", 0, (3,), (4,), (10,)),
                     _shard("x", 0, (0,), (10,), (10,), main=False)]),
        RankPlan(1, [_shard("x", 1, (7,), (3,), (10,))]),
    ]
    assert validate(plans) == []


def test_validate_names_overlap_pair_and_ranks():
    plans = [RankPlan(0, [_shard("x", 0, (0, 0), (2, 4), (4, 4))]),
             RankPlan(1, [_shard("x", 1, (1, 0), (3, 4), (4, 4))])]
    (p,) = validate(plans)
    assert p.key == "x" and p.ranks == (0, 1) and "overlap" in p.message


def test_validate_zero_dim_duplicate():
    plans = [RankPlan(r, [_shard("s", r, (), (), ())]) for r in range(2)]
    (p,) = validate(plans)
    assert "two main replicas" in p.message


def test_validate_objects_must_tile_their_grid():
    objs = [ObjectRef("o/shard_0_2", "o", 0, (2,), (0,), True, 10, "o")]
    (p,) = validate([RankPlan(0, objects=objs)])
    assert "1 of the 2" in p.message


@pytest.mark.parametrize("seed", range(6))
def test_balanced_chunks_tile_random_shards_within_bounds(seed):
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.int8, torch.float64]
    shards = []
    for i in range(int(torch.randint(1, 30, (1,), generator=g))):
        ndim = int(torch.randint(0, 4, (1,), generator=g))
        shape = tuple(int(s) for s in torch.randint(0, 40, (ndim,), generator=g))
        shards.append(_shard(f"t{i}", 0, (0,) * ndim, shape, shape, dtypes[i % 4], local_index=i))
    chunk_bytes = int(torch.randint(4, 4096, (1,), generator=g))
    files = int(torch.randint(1, 17, (1,), generator=g))
    plan = build_global_plan([RankPlan(0, shards, [], [])], chunk_bytes, files)
    layout = lay_out_rank(plan, 0)
    assert all(0 <= c.file_slot < files for c in plan.chunks)
    for i, s in enumerate(shards):
        boxes = [c.shard_box for c in plan.chunks if c.local_index == i]
        if s.box.numel:
            assert _covers_exactly(s.box.sizes, boxes)
        assert all(b.numel * s.dtype.itemsize <= max(chunk_bytes, s.dtype.itemsize) for b in boxes)
    for f in layout.files:  # items back to back from offset 0
        ends = [0] + [it.offset_bytes + it.length_bytes for it in f.items]
        assert [it.offset_bytes for it in f.items] == ends[:-1] and ends[-1] == f.size_bytes


def test_each_files_last_chunk_bytes_go_in_quarter_chunks():
    """The writers end within one item of each other: the last chunk_bytes of every file are
    in items of at most a quarter chunk; the rest stay whole chunks, and files stay balanced."""
    specs = [((18_000, 4096), torch.bfloat16)] * 8 + [((168_000_000,), torch.float32)] * 12
    shards = [_shard(f"t{i}", 0, (0,) * len(shape), shape, shape, dtype, local_index=i)
              for i, (shape, dtype) in enumerate(specs)]
    chunk = 64 << 20
    plan, sizes = _layout_file_bytes(shards, 32, chunk)
    assert max(sizes) / (sum(sizes) / len(sizes)) < 1.01, sizes
    for f in lay_out_rank(plan, 0).files:
        tail = [it for it in f.items if it.offset_bytes + it.length_bytes > f.size_bytes - chunk]
        assert sum(it.length_bytes for it in tail) >= chunk
        assert all(it.chunk.payload_bytes <= chunk // 4 for it in tail), [it.length_bytes for it in tail]
        assert any(it.chunk.payload_bytes == chunk for it in f.items)
    few, _ = _layout_file_bytes(shards[:1], 2, chunk)  # 141 MiB: files of under four chunks keep whole chunks
    assert max(c.payload_bytes for c in few.chunks) > chunk // 4
