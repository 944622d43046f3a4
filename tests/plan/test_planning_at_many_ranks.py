"""Planning at many ranks: a rank cuts only its own chunks to start writing, and the exchanged
rank plans survive their compact pickling exactly."""

import pickle

import pytest
import torch

from safe_ckpt.encoding.layout import lay_out, lay_out_rank
from safe_ckpt.plan import build_global_plan
from safe_ckpt.plan.records import Box, ObjectRef, Problem, RankPlan, ShardRef

MiB = 1 << 20


def _plans(world=4, shards=30):
    """Rank r holds row blocks of every key; sizes vary so chunks and file slots differ per rank."""
    g = torch.Generator().manual_seed(7)
    plans = []
    rows = [int(n) for n in torch.randint(1, 400, (shards,), generator=g)]
    for r in range(world):
        out = []
        for i, n in enumerate(rows):
            out.append(ShardRef(f"layer{i}.w", r, i, torch.float32 if i % 3 else torch.bfloat16, (n * world, 1024),
                                Box((n * r, 0), (n, 1024)), True, "pageable", f"state.layer{i}.w"))
        objects = [ObjectRef(f"opt/shard_{r}_{world}", "opt", r, (world,), (r,), True, 50 + r, "opt")]
        plans.append(RankPlan(r, out, objects, []))
    return plans


def _eager_reference(plans, chunk_bytes, files):
    """Every rank's chunks, asked for in rank order up front (what planning did before)."""
    plan = build_global_plan(plans, chunk_bytes, files)
    return [plan.chunks_of(r) for r in range(len(plans))]


def test_planning_cuts_only_the_ranks_own_chunks_and_the_rest_match_on_demand():
    plans = _plans()
    plan = build_global_plan(plans, MiB // 2, 4)
    cut = []
    chunker = plan.chunker
    object.__setattr__(plan, "chunker", lambda r: cut.append(r) or chunker(r))
    mine = lay_out_rank(plan, 2)
    assert cut == [2]
    reference = _eager_reference(plans, MiB // 2, 4)
    assert plan.chunks_of(2) == reference[2] and mine.items[-1].chunk == reference[2][-1]
    assert plan.chunks == [c for chunks in reference for c in chunks]
    assert sorted(cut) == [0, 1, 2, 3]  # each rank once, rank 2 not again
    assert {c.rank for c in reference[1]} == {1} and len({c.file_slot for c in reference[1]}) == 4
    assert [layout.file_bytes for layout in lay_out(plan)] == [
        layout.file_bytes for layout in lay_out(build_global_plan(plans, MiB // 2, 4))]


def test_a_rank_plan_pickles_compactly_and_loads_back_equal():
    plan = _plans(world=3)[1]
    plan = RankPlan(plan.rank, plan.shards, plan.objects, [Problem("ValidationError", "k", (1,), "why")])
    loaded = pickle.loads(pickle.dumps(plan))
    assert loaded == plan
    assert [hash(s.box) for s in loaded.shards] == [hash(s.box) for s in plan.shards]
    assert type(loaded.shards[0]) is ShardRef and type(loaded.shards[0].box) is Box
    # rows of values: no field names per shard, as pickling the ShardRef objects themselves has
    assert len(pickle.dumps(plan)) < 0.8 * len(pickle.dumps(plan.shards))
    with pytest.raises(ValueError, match="rank 1 sent 2 paths for 30 shards"):
        plan.with_paths(["a", "b"])
