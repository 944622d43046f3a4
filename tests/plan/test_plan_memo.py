"""The remembered tensor plan: reused only for equal shards, never past a refusal, and a save
that hits it writes the same checkpoint a fresh plan would."""

import pytest
import torch

from safe_ckpt.plan import build_global_plan
from safe_ckpt.plan.memo import PlanMemo, signature
from safe_ckpt.plan.records import Box, ObjectRef, Problem, RankPlan, ShardRef


def _shard(key, rank, offsets, sizes, shape, local_index=0, residence="pageable", main=True):
    return ShardRef(key, rank, local_index, torch.float32, shape, Box(offsets, sizes), main, residence, key)


def _plans(rows=64, residence="pageable", payload=10):
    """Two ranks, each holding half of two tensors, plus an object whose payload size varies."""
    plans = []
    for rank in range(2):
        shards = [_shard("a", rank, (rank * rows, 0), (rows, 512), (2 * rows, 512), 0, residence),
                  _shard("b", rank, (rank * 1000,), (1000,), (2000,), 1, residence)]
        objects = [ObjectRef(f"o/shard_{rank}", "o", rank, (2,), (rank,), True, payload + rank, "p")]
        plans.append(RankPlan(rank, shards, objects, []))
    return plans


def test_equal_shards_reuse_the_cut_chunks_and_new_objects_are_taken_each_time():
    memo = PlanMemo()
    first = build_global_plan(_plans(), 64 << 10, 2, remember=memo)
    chunks = first.chunks_of(1)
    second = build_global_plan(_plans(payload=99), 64 << 10, 2, remember=memo)
    assert second.chunks_of(1) is chunks  # cut once, not again
    assert second.tensors is first.tensors
    assert [o.payload_bytes for o in second.objects] == [99, 100]  # objects are never remembered
    fresh = build_global_plan(_plans(payload=99), 64 << 10, 2)
    assert second.chunks_of(0) == fresh.chunks_of(0) and second.chunks_of(1) == fresh.chunks_of(1)
    assert second.objects == fresh.objects and second.tensors == fresh.tensors


@pytest.mark.parametrize("change", ["shape", "residence", "chunk_bytes", "files"])
def test_any_difference_is_a_miss_and_plans_afresh(change):
    memo = PlanMemo()
    build_global_plan(_plans(), 64 << 10, 2, remember=memo)
    plans, chunk_bytes, files = _plans(), 64 << 10, 2
    if change == "shape":
        plans = _plans(rows=32)
    elif change == "residence":
        plans = _plans(residence="cuda")
    elif change == "chunk_bytes":
        chunk_bytes = 32 << 10
    else:
        files = 1
    assert memo.get(signature(plans, chunk_bytes, files)) is None
    got = build_global_plan(plans, chunk_bytes, files, remember=memo)
    fresh = build_global_plan(plans, chunk_bytes, files)
    assert got.chunks_of(0) == fresh.chunks_of(0) and got.tensors == fresh.tensors
    assert memo.get(signature(plans, chunk_bytes, files)) is not None  # the new plan is the one remembered


def test_a_refused_plan_is_refused_again_and_never_remembered():
    memo = PlanMemo()
    build_global_plan(_plans(), 64 << 10, 2, remember=memo)
    overlapping = _plans()
    bad = overlapping[1].shards[0]
    overlapping[1].shards[0] = _shard("a", 1, (10, 0), bad.box.sizes, bad.global_shape)  # overlaps rank 0's rows
    problems = build_global_plan(overlapping, 64 << 10, 2, remember=memo)
    assert isinstance(problems, list) and problems
    assert memo.get(signature(overlapping, 64 << 10, 2)) is None
    # Shards equal to the remembered ones, with a local problem: still refused.
    local = _plans()
    local[0].problems.append(Problem(ValueError.__name__, "x", (0,), "broken here"))
    refused = build_global_plan(local, 64 << 10, 2, remember=memo)
    assert isinstance(refused, list) and [p.message for p in refused] == ["broken here"]


def test_saves_of_one_state_plan_from_the_memo_and_load_back_as_saved(tmp_path):
    from tests.helpers.bodies import plan_memo
    from tests.helpers.mp import run_world, values

    for out in values(run_world(2, plan_memo.saves_of_one_state_load_back_as_saved, (str(tmp_path),))):
        assert out["hits"] == [False, True, True]
        assert out["equal"] == {1: True, 12: True, 30: True}
