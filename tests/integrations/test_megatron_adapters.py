"""The Megatron adapters on CPU with megatron-core (Megatron-shaped synthetic state, gloo ranks)."""

import argparse

import pytest

from safe_ckpt import compat
from tests.helpers.bodies import megatron as megatron_cases
from tests.helpers.mp import run_world, values


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_training_layout_tracker_last_and_failure_keeps_previous(tmp_path, use_async):
    out = values(run_world(2, megatron_cases.training_layout, (str(tmp_path), use_async)))
    for r in out:
        assert r["tracker_before"] is None and r["tracker"] == "42"
        assert r["mismatches"] == [], r["mismatches"][:5]
        assert r["content_metadata"] == megatron_cases.CONTENT
        assert {"args", "checkpoint_version", "iteration"} <= set(r["common_keys"])
        assert ".metadata" in r["files"] and "metadata.json" in r["files"]
        assert ("common.pt" in r["files"]) != compat.common_state_as_sharded_object()
        err = r["failed_save_error"]
        assert err is not None and err["failing_ranks"] == [1], err
        assert r["tracker_after_failure"] == "42" and not r["iter43_exists"]


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_strategy_through_stock_dist_checkpointing_save(tmp_path, use_async):
    out = values(run_world(2, megatron_cases.strategy_roundtrip, (str(tmp_path), use_async)))
    for r in out:
        assert r["is_torch_dist_strategy"] == "TorchDistSaveShardedStrategy"
        assert r["mismatches"] == [], r["mismatches"][:5]
        assert {".metadata", "metadata.json", "__0_0.distcp", "__1_0.distcp"} <= set(r["files"])
        assert not [f for f in r["files"] if ".safe_ckpt-" in f]


def test_strategy_as_registered_default(tmp_path):
    out = values(run_world(2, megatron_cases.default_strategy, (str(tmp_path),)))
    if compat.megatron_version().release >= (0, 17):
        assert all(not r["installed"] for r in out)
    else:
        assert all(r["installed"] and r["mismatches"] == [] for r in out)


def _args(**kw):
    return argparse.Namespace(**{"use_distributed_optimizer": True, "no_save_optim": False, **kw})


@pytest.mark.parametrize("kind", ["fully_reshardable", "dp_zero_gather_scatter", "fully_sharded_model_space"])
def test_device_moving_optimizer_formats_are_refused_with_a_reason(kind):
    from safe_ckpt.megatron import check_sharding_type

    with pytest.raises(compat_error(), match=kind) as info:
        check_sharding_type(_args(), object(), {"distrib_optim_sharding_type": kind})
    assert "dp_reshardable" in str(info.value)


def test_dp_reshardable_and_no_optimizer_are_accepted():
    from safe_ckpt.megatron import check_sharding_type

    check_sharding_type(_args(), object(), {"distrib_optim_sharding_type": "dp_reshardable"})
    check_sharding_type(_args(no_save_optim=True), object(), {"distrib_optim_sharding_type": "fully_reshardable"})
    check_sharding_type(_args(), None, None)


def compat_error():
    import safe_ckpt

    return safe_ckpt.ValidationError


def _iters(*its):
    return [f"iter_{i:07d}" for i in its]


def test_retention_keeps_the_checkpoint_a_ckpt_step_rollback_loaded(tmp_path):
    """A run saves 100, 200, 300; it diverged, so the next run rolls back with `--ckpt-step 100`
    and keeps one checkpoint. The one it loaded stays for the whole run (not the tracker's 300),
    the diverged 200 and 300 stay too (newer: never counted, never removed), and the log says
    they are newer than the resumed one."""
    root = str(tmp_path)
    first = values(run_world(2, megatron_cases.megatron_run, (root, [100, 200, 300], {})))
    assert first[0]["after"][-1] == _iters(100, 200, 300) and first[0]["tracker"] == "300"
    out = values(run_world(2, megatron_cases.megatron_run, (root, [110, 120], {
        "load": root, "ckpt_step": 100, "safe_ckpt_keep_last": 1})))
    r0 = out[0]
    assert r0["after"] == [_iters(100, 110, 200, 300), _iters(100, 120, 200, 300)], r0["after"]
    assert r0["tracker"] == "120"
    rollback = [w for w in r0["warnings"] if "[200, 300]" in w]
    assert rollback and "which this run resumed from" in rollback[0] and "iteration 100" in rollback[0], r0["warnings"]
