"""The Megatron drop-in's overlapped save (`--safe-ckpt-overlap-copy` with `--async-save`): which
setups may return right after planning (the rest fall back to the staged return and say why), and
the copies starting at the next step's `optimizer.zero_grad()`, not in the call."""

import logging
from argparse import Namespace
from types import SimpleNamespace

import pytest

from safe_ckpt.megatron import options_from_args
from safe_ckpt.megatron.overlap import install_trigger
from tests.helpers.mp import run_world, values


def _args(**flags):
    base = dict(async_save=True, safe_ckpt_overlap_copy=True, overlap_param_gather=False)
    base.update(flags)
    return Namespace(**base)


def _bucket_group(dispatched=True, handle=None):
    return SimpleNamespace(param_gather_dispatched=dispatched, param_gather_handle=handle)


def test_the_flag_with_async_save_returns_after_planning(caplog):
    caplog.set_level(logging.INFO, logger="safe_ckpt")
    assert options_from_args(_args()).return_after == "planned"
    synced = [SimpleNamespace(bucket_groups=[_bucket_group()], expert_parallel_bucket_groups=[_bucket_group()])]
    assert options_from_args(_args(overlap_param_gather=True), synced).return_after == "planned"
    assert options_from_args(_args(async_save=False)).return_after == "staged"  # a synchronous save
    assert options_from_args(_args(safe_ckpt_overlap_copy=False)).return_after == "staged"
    assert "overlap" not in caplog.text  # nothing was refused: nothing to say


@pytest.mark.parametrize("flags, said", [
    (dict(reuse_grad_buf_for_mxfp8_param_ag=True), "--reuse-grad-buf-for-mxfp8-param-ag"),
    (dict(fp8_param_gather=True), "--fp8-param-gather"),
    (dict(offload_optimizer_states=True), "--offload-optimizer-states"),
    (dict(use_megatron_fsdp=True), "--use-megatron-fsdp"),
    (dict(cuda_graph_impl="local", cuda_graph_scope="full_iteration"), "--cuda-graph-scope full_iteration"),  # 0.15
    (dict(cuda_graph_impl="local", cuda_graph_scope=[SimpleNamespace(name="full_iteration")]),
     "--cuda-graph-scope full_iteration"),  # 0.16-0.18: a list of CudaGraphScope
    (dict(cuda_graph_impl="full_iteration", cuda_graph_scope=[]), "--cuda-graph-impl full_iteration"),  # 0.19+
    (dict(optimizer_cuda_graph=True), "--optimizer-cuda-graph"),
], ids=["mxfp8_reuse", "fp8_param_gather", "offload_optimizer_states", "megatron_fsdp", "graph_0.15",
        "graph_0.16", "graph_0.19", "optimizer_graph"])
def test_ineligible_setups_return_once_staged_and_say_why(caplog, flags, said):
    caplog.set_level(logging.INFO, logger="safe_ckpt")
    assert options_from_args(_args(**flags)).return_after == "staged"
    lines = [r.getMessage() for r in caplog.records if "--safe-ckpt-overlap-copy" in r.getMessage()]
    assert len(lines) == 1 and said in lines[0], lines


def test_an_unsynced_param_gather_bucket_returns_once_staged(caplog):
    caplog.set_level(logging.INFO, logger="safe_ckpt")
    model = [SimpleNamespace(bucket_groups=[_bucket_group(), _bucket_group(dispatched=False)],
                             expert_parallel_bucket_groups=[_bucket_group(handle=object())])]
    assert options_from_args(_args(overlap_param_gather=True), model).return_after == "staged"
    assert "2 param all-gather bucket group(s) are not synced" in caplog.text
    # without --overlap-param-gather the step's own gather is synchronous: the buckets do not matter
    assert options_from_args(_args(), model).return_after == "planned"


def test_the_zero_grad_trigger_is_installed_once_per_optimizer():
    calls = []

    class Opt:
        def zero_grad(self, set_to_none=True):
            calls.append(set_to_none)

    original = Opt.zero_grad
    opt, other = Opt(), Opt()
    assert install_trigger(opt) and not install_trigger(opt) and install_trigger(other)
    opt.zero_grad(False)
    assert calls == [False] and Opt.zero_grad is original and "zero_grad" in vars(opt)  # the instance only


def test_the_copies_start_at_the_next_zero_grad_and_the_checkpoint_is_the_call_state(tmp_path):
    from tests.helpers.bodies import megatron_overlap

    (out,) = values(run_world(1, megatron_overlap.deferred_opening_at_zero_grad, (str(tmp_path),)))
    assert out["returned_before_copies"] and out["windows_after_call"] == 0, out  # deferred: not opened
    assert out["after_call"] == {"open_s": 0.0, "copied_bytes": 0}, out
    assert out["windows_after_zero_grad"] == 1, out  # the step's zero_grad opened it
    assert out["saved"] == 1 and out["tracker"] == "3" and out["zero_grad_calls"] == 1, out
    assert all(out["checkpoint_is_the_call_state"].values()), out
    assert out["live_moved"], out
