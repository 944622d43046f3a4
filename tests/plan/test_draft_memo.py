"""The remembered shard drafts (`collect.draft_memo`): a later save of the same layout skips the
checks and boxes of its shards, yet a tensor changed in place under the same object (resized,
retyped, moved to another storage) is checked and drafted again, and every source is taken anew."""

import pytest
import torch
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

from safe_ckpt.plan import collect
from safe_ckpt.plan.collect import draft_memo


def _state(tensors: dict) -> dict:
    """A fresh sharded state dict over the same tensor objects, as every Megatron save builds one."""
    sd = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}
    sd["meta"] = ShardedObject("meta", {"step": 1}, (1,), (0,))
    return sd


def _tensors():
    g = torch.Generator().manual_seed(7)
    return {"a": torch.randn(64, 32, generator=g), "b": torch.randn(1000, generator=g)}


def _spec(sd: dict, key: str, like: torch.Tensor) -> None:
    """The shard of ``key`` declared as ``like`` (its dtype and shape) over its current data object."""
    data = sd[key].data
    sd[key] = ShardedTensor.from_rank_offsets(key, like, replica_id=0)
    sd[key].data = data


@pytest.fixture(autouse=True)
def fresh_memo():
    draft_memo.clear()
    yield
    draft_memo.clear()


def test_a_second_collect_of_the_same_layout_reuses_the_boxes_and_takes_each_source_anew():
    tensors = _tensors()
    first = collect(_state(tensors), 0)
    second = collect(_state(tensors), 0)
    assert not first.problems and not second.problems
    for a, b in zip(first.shards, second.shards):
        assert b.box is a.box  # remembered, not boxed again
        assert (b.key, b.dtype, b.global_shape, b.is_main, b.path) == (a.key, a.dtype, a.global_shape, a.is_main, a.path)
        assert b.source is not a.source and b.source.data_ptr() == a.source.data_ptr()


def test_a_tensor_resized_in_place_is_checked_again():
    tensors = _tensors()
    collect(_state(tensors), 0)
    sd = _state(tensors)
    _spec(sd, "b", torch.empty(1000))  # still declared as 1000 elements
    tensors["b"].resize_(500)  # the same object, now 500
    out = collect(sd, 0)
    assert [p.key for p in out.problems] == ["b"] and "is not local_shape (1000,)" in out.problems[0].message


def test_a_tensor_retyped_in_place_is_checked_again():
    tensors = _tensors()
    collect(_state(tensors), 0)
    sd = _state(tensors)
    _spec(sd, "a", torch.empty(64, 32))  # still declared float32
    tensors["a"].data = tensors["a"].data.to(torch.bfloat16)  # the same object, now bf16
    out = collect(sd, 0)
    assert [p.key for p in out.problems] == ["a"] and "differs from the declared dtype" in out.problems[0].message


def test_a_tensor_moved_to_another_storage_is_read_from_the_new_one():
    tensors = _tensors()
    collect(_state(tensors), 0)
    elsewhere = torch.randn(64, 32, generator=torch.Generator().manual_seed(8))
    tensors["a"].set_(elsewhere)  # same object, shape and dtype; other bytes
    out = collect(_state(tensors), 0)
    source = next(d.source for d in out.shards if d.key == "a")
    assert source.data_ptr() == elsewhere.data_ptr() and torch.equal(source, elsewhere)


def test_a_changed_layout_is_boxed_again():
    tensors = _tensors()
    collect(_state(tensors), 0)
    tensors["b"] = torch.randn(1200, generator=torch.Generator().manual_seed(9))  # declared consistently
    out = collect(_state(tensors), 0)
    b = next(d for d in out.shards if d.key == "b")
    assert not out.problems and b.box.sizes == (1200,) and b.global_shape == (1200,)


def test_a_refused_shard_is_not_remembered():
    tensors = _tensors()
    sd = _state(tensors)
    _spec(sd, "b", torch.empty(999))
    assert [p.key for p in collect(sd, 0).problems] == ["b"]
    sd = _state(tensors)
    _spec(sd, "b", torch.empty(999))
    assert [p.key for p in collect(sd, 0).problems] == ["b"]  # refused again, not served from a memo
