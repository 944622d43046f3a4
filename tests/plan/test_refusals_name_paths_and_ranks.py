"""What a refused or suspicious save tells its caller: the dict paths involved, and who.

Single process (no torch.distributed) and 2 gloo ranks; each case is a bad input a user
can write, and the test reads the message a user would read.
"""

import logging
import os

import pytest
import torch

import safe_ckpt
from safe_ckpt.plan.records import Box, RankPlan, ShardRef
from safe_ckpt.plan.validate import validate
from safe_ckpt_lab.synthetic import bits_equal
from tests.helpers.mp import describe_exception, run_world, values


def _st(key, data, global_shape=None, offset=None, replica_id=0):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    shape = tuple(data.shape)
    return ShardedTensor(key, data, data.dtype, shape, tuple(global_shape or shape),
                         tuple(offset or (0,) * len(shape)), axis_fragmentations=None, replica_id=replica_id)


def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _opts():
    return safe_ckpt.SaveOptions(chunk_bytes=16 * 1024, io_threads=1, progress_interval_s=0)


def _refusal(state, path) -> str:
    with pytest.raises(safe_ckpt.ValidationError) as info:
        safe_ckpt.save(state, path, options=_opts())
    assert info.value.failing_ranks == [0]
    assert not os.path.exists(path)
    return str(info.value)


# ----------------------------------------------------------------- one process


def test_one_rank_giving_a_key_twice_names_both_paths(tmp_path):
    state = {"a": {"b": _st("x", _rand(1, 2, 4))}, "c": _st("x", _rand(2, 2, 4))}
    msg = _refusal(state, str(tmp_path / "ck"))
    assert "rank 0 gives key 'x' twice: at state['a']['b'] and state['c']" in msg, msg
    assert "disagree" not in msg and "rank(s) [0]" not in msg, msg


def test_one_rank_giving_overlapping_shards_names_both_paths(tmp_path):
    state = {"m": [_st("x", _rand(1, 2, 4), (3, 4), (0, 0)), _st("x", _rand(2, 2, 4), (3, 4), (1, 0))]}
    msg = _refusal(state, str(tmp_path / "ck"))
    assert "rank 0 gives overlapping shards of key 'x'" in msg, msg
    assert "at state['m'][0]" in msg and "at state['m'][1]" in msg, msg


@pytest.mark.parametrize("what", ["dtype", "global shape"])
def test_one_rank_contradicting_itself_is_not_called_a_rank_disagreement(tmp_path, what):
    second = _rand(2, 2, 4).bfloat16() if what == "dtype" else _rand(2, 2, 4)
    shape = (4, 4) if what == "dtype" else (4, 8)
    state = {"a": {"b": _st("x", _rand(1, 2, 4), (4, 4))}, "c": _st("x", second, shape, (2, 0))}
    msg = _refusal(state, str(tmp_path / "ck"))
    first, other = ("torch.float32", "torch.bfloat16") if what == "dtype" else ("(4, 4)", "(4, 8)")
    assert f"rank 0 gives key 'x' with 2 different {what}s: {first} at state['a']['b']; {other} at state['c']" \
        in msg, msg
    assert "ranks disagree" not in msg and "rank(s) [0]" not in msg, msg


def test_locally_refused_shard_names_its_path(tmp_path):
    bad = _st("x", _rand(1, 2, 4))
    bad.data = _rand(1, 3, 4)  # claims 2 rows, holds 3
    msg = _refusal({"opt": {"state": [bad]}}, str(tmp_path / "ck"))
    assert "key 'x'" in msg and "(at state['opt']['state'][0])" in msg, msg


def test_object_given_twice_by_one_rank_names_both_paths(tmp_path):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {"rng": ShardedObject("rng", {"seed": 1}, (1,), (0,)), "also": {"rng": ShardedObject("rng", 2, (1,), (0,))}}
    msg = _refusal(state, str(tmp_path / "ck"))
    assert "rank 0 gives ShardedObject 'rng/shard_0_1' twice as a main replica: at state['rng'] and " \
           "state['also']['rng']" in msg, msg


def _common_warnings(records) -> list[str]:
    return [r.getMessage() for r in records
            if r.name == "safe_ckpt" and r.levelno == logging.WARNING and "common state" in r.getMessage()]


def test_large_plain_tensor_in_common_state_warns_once_naming_its_path(tmp_path, caplog):
    from megatron.core.dist_checkpointing import load_common_state_dict

    big = _rand(3, 1 << 20)  # 4 MiB, outside any ShardedTensor
    small = _rand(4, 64)
    state = {"w": _st("w", _rand(5, 8, 4)), "optimizer": {"param_groups": [{"exp_avg": big}]}, "step": small}
    path = str(tmp_path / "ck")
    with caplog.at_level(logging.WARNING, logger="safe_ckpt"):
        safe_ckpt.save(state, path, options=_opts())
    (warning,) = _common_warnings(caplog.records)
    assert "state['optimizer']['param_groups'][0]['exp_avg'] (4.0 MiB)" in warning, warning
    assert "state['step']" not in warning and "ShardedTensor" in warning, warning
    # Still saved as before (stock Megatron reads it back): the warning changes nothing on disk.
    common = load_common_state_dict(path)
    assert bits_equal(common["optimizer"]["param_groups"][0]["exp_avg"], big)
    assert bits_equal(common["step"], small)


def test_view_of_a_large_storage_counts_what_is_pickled_and_small_tensors_stay_quiet(tmp_path, caplog):
    view = _rand(6, 1 << 20)[:16]  # 64 bytes of elements, but torch.save writes the 4 MiB storage
    with caplog.at_level(logging.WARNING, logger="safe_ckpt"):
        safe_ckpt.save({"w": _st("w", _rand(5, 8, 4)), "extra": (view,)}, str(tmp_path / "a"), options=_opts())
    (warning,) = _common_warnings(caplog.records)
    assert "state['extra'][0] (4.0 MiB)" in warning, warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="safe_ckpt"):
        safe_ckpt.save({"w": _st("w", _rand(5, 8, 4)), "extra": _rand(7, 1 << 18)}, str(tmp_path / "b"),
                       options=_opts())  # exactly 1 MiB: not above the threshold
    assert _common_warnings(caplog.records) == []


def test_many_ranks_are_listed_as_runs():
    shards = [ShardRef("x", r, 0, torch.float32 if r != 5 else torch.bfloat16, (8, 4), Box((r, 0), (1, 4)), True,
                       "pageable", "state['layers'][0]['w']") for r in range(8)]
    (p,) = validate([RankPlan(r, [s]) for r, s in enumerate(shards)])
    assert p.message == ("ranks disagree on dtype: torch.float32 at state['layers'][0]['w'] on ranks 0-4, 6, 7; "
                         "torch.bfloat16 at state['layers'][0]['w'] on rank 5"), p.message


# ----------------------------------------------------------------- 2 gloo ranks


CASES = ["dtype_disagree", "same_shard_on_both", "twice_on_rank_1"]


def _case_state(case, rank):
    rows = _rand(10 + rank, 2, 4)
    if case == "dtype_disagree":
        data = rows.bfloat16() if rank == 1 else rows
        return {"layers": [{"w": _st("x", data, (4, 4), (2 * rank, 0))}]}
    if case == "same_shard_on_both":  # both ranks claim rows 0-1 as the main replica
        return {"emb": _st("x", rows, (2, 4), (0, 0))}
    if case == "twice_on_rank_1":  # rank 1 passes its rows under two paths
        own = {"w": _st("x", rows, (4, 4), (2 * rank, 0))}
        return {**own, "copy": {"w": _st("x", rows, (4, 4), (2, 0))}} if rank == 1 else own
    raise ValueError(case)


def messages_of_two_ranks(rank, world, root) -> dict:
    out = {}
    for case in CASES:
        try:
            safe_ckpt.save(_case_state(case, rank), os.path.join(root, case), options=_opts())
            out[case] = None
        except BaseException as exc:
            out[case] = describe_exception(exc)
        torch.distributed.barrier()
    return out


@pytest.fixture(scope="module")
def two_rank_errors(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("messages2"))
    per_rank = values(run_world(2, messages_of_two_ranks, (root,)))
    for case in CASES:  # every rank raises the same error
        assert per_rank[0][case] is not None and per_rank[0][case]["message"] == per_rank[1][case]["message"], case
    return {case: per_rank[0][case] for case in CASES}


def test_two_ranks_disagreeing_name_the_path_on_each(two_rank_errors):
    err = two_rank_errors["dtype_disagree"]
    assert err["failing_ranks"] == [0, 1]
    assert ("ranks disagree on dtype: torch.float32 at state['layers'][0]['w'] on rank 0; "
            "torch.bfloat16 at state['layers'][0]['w'] on rank 1") in err["message"], err["message"]


def test_two_ranks_claiming_one_shard_name_the_path_on_each(two_rank_errors):
    err = two_rank_errors["same_shard_on_both"]
    assert err["failing_ranks"] == [0, 1]
    assert ("two main replicas of one shard (offsets (0, 0) sizes (2, 4)): rank 0 at state['emb'] and "
            "rank 1 at state['emb']") in err["message"], err["message"]
    assert "replica_id that is 0 (the main replica) on one of them only" in err["message"], err["message"]


def test_one_of_two_ranks_giving_a_key_twice_is_blamed_alone(two_rank_errors):
    err = two_rank_errors["twice_on_rank_1"]
    assert err["failing_ranks"] == [1], err["message"]
    assert "rank 1 gives key 'x' twice: at state['w'] and state['copy']['w']" in err["message"], err["message"]
