"""Every fact a shard's draft is made of, changed alone between two saves over the same tensor
objects, gives the draft of the changed shard, never the remembered one (`collect.draft_memo`):
key, declared dtype, global shape and offset, prepended axes, replica (the main-replica flag) and
the shard's path in the state dict."""

import pytest
import torch
from megatron.core.dist_checkpointing import ShardedTensor

from safe_ckpt.plan import collect
from safe_ckpt.plan.collect import draft_memo


@pytest.fixture(autouse=True)
def fresh_memo():
    draft_memo.clear()
    yield
    draft_memo.clear()


def _tensor():
    return torch.randn(64, 32, generator=torch.Generator().manual_seed(11))


def _shard(t, key="w", replica_id=0, rank_offsets=(), prepend_axis_num=0):
    return ShardedTensor.from_rank_offsets(key, t, *rank_offsets, replica_id=replica_id,
                                           prepend_axis_num=prepend_axis_num)


def _draft(sd: dict):
    out = collect(sd, 0)
    assert not out.problems, out.problems
    (d,) = out.shards
    return d


CHANGES = {
    "key": (lambda t: _shard(t, key="w2"), lambda d: d.key == "w2"),
    "replica": (lambda t: _shard(t, replica_id=1), lambda d: d.is_main is False),
    "global shape": (lambda t: _shard(t, rank_offsets=((1, 0, 3),)), lambda d: d.global_shape == (64, 96)),
    "prepended axes": (lambda t: _shard(t, prepend_axis_num=1), lambda d: d.box.sizes == (1, 64, 32)),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_fact_gives_a_new_draft(change):
    t = _tensor()
    first = _draft({"w": _shard(t)})
    assert (first.key, first.is_main, first.box.offsets, first.global_shape, first.box.sizes) == \
        ("w", True, (0, 0), (64, 32), (64, 32))
    build, holds = CHANGES[change]
    again = _draft({"w": build(t)})
    assert holds(again), (change, again)


def test_a_changed_global_offset_alone_gives_a_new_box():
    t = _tensor()
    first = _draft({"w": _shard(t, rank_offsets=((0, 0, 2),))})
    again = _draft({"w": _shard(t, rank_offsets=((0, 1, 2),))})  # the same global shape, the other half
    assert first.global_shape == again.global_shape == (128, 32)
    assert again.box.offsets == (64, 0), again.box


def test_prepended_axes_changed_alone_are_refused_again():
    t = _tensor()
    _draft({"w": _shard(t)})
    sd = {"w": _shard(t)}
    sd["w"].prepend_axis_num = 1  # global shape and offset still of rank 2
    problems = collect(sd, 0).problems
    assert [p.key for p in problems] == ["w"] and "rank mismatch" in problems[0].message, problems


def test_a_changed_declared_dtype_is_refused_again():
    t = _tensor()
    _draft({"w": _shard(t)})
    sd = {"w": _shard(t)}
    sd["w"].dtype = torch.bfloat16  # declared differently from the data
    assert [p.key for p in collect(sd, 0).problems] == ["w"]


def test_a_shard_moved_to_another_path_names_its_new_path():
    t = _tensor()
    _draft({"w": _shard(t)})
    d = _draft({"moved": _shard(t)})
    assert d.path == "state['moved']", d.path


def test_a_narrowed_shard_is_remembered_too():
    t = _tensor()

    def narrowed():
        (part,) = _shard(t).narrow(0, 0, 32)
        return {"w": part}

    first, again = _draft(narrowed()), _draft(narrowed())
    assert again.box is first.box
