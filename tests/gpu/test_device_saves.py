"""GPU tests (marked `gpu`; skipped without CUDA). Each runs in spawned ranks on cuda:0."""

import importlib.util
import os

import pytest

from safe_ckpt.names import MANIFEST_FILE

from tests.helpers.mp import run_world, values

pytestmark = pytest.mark.gpu


def _cases():
    from tests.helpers.bodies import gpu as gpu_cases

    return gpu_cases


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("residence", ["cuda", "pinned", "pageable", "mixed"])
def test_roundtrip_per_residence(tmp_path, residence, use_async):
    out = values(run_world(1, _cases().gpu_roundtrip, (str(tmp_path / "ck"), residence, use_async)))
    (r,) = out
    assert r["mismatches"] == [], r["mismatches"][:5]
    expect = {"cuda": {"cuda"}, "pinned": {"cuda", "pinned"}, "pageable": {"cuda", "pageable"},
              "mixed": {"cuda", "pinned", "pageable"}}[residence]
    assert expect <= set(r["residences"]), r["residences"]


def test_roundtrip_two_ranks_mixed_async(tmp_path):
    out = values(run_world(2, _cases().gpu_roundtrip, (str(tmp_path / "ck"), "mixed", True)))
    assert all(r["mismatches"] == [] for r in out), [r["mismatches"][:3] for r in out]


def test_no_host_to_device_copies(tmp_path):
    (counts,) = values(run_world(1, _cases().count_h2d, (str(tmp_path / "ck"),)))
    for mode in ("sync", "async"):
        c = counts[mode]
        assert c["DtoH"] > 0, f"{mode}: the profiler saw no device-to-host copies at all: {c}"
        assert c["HtoD"] == 0, f"{mode}: {c}"
        assert c["nccl"] == 0, f"{mode}: {c}"
    assert counts["refused_error"] and "overlap" in counts["refused_error"]
    assert counts["refused"]["HtoD"] == 0 and counts["refused"]["nccl"] == 0, counts["refused"]


def _gpu_world() -> int:
    """Ranks of the multi-rank GPU tests, one per GPU: 2 unless SAFE_CKPT_GPU_WORLD says more
    (gpu_suite.sh's resume part sets every GPU of the host, e.g. DP=8 on 8 GPUs)."""
    import torch

    return max(1, min(int(os.environ.get("SAFE_CKPT_GPU_WORLD", "2")), torch.cuda.device_count()))


def _resume_world() -> tuple[int, str]:
    """Data-parallel ranks and backend of the real-model resume test. NCCL needs a GPU per rank;
    with SAFE_CKPT_GPU_RESUME_BACKEND=gloo, SAFE_CKPT_GPU_WORLD ranks share the GPUs there are
    (several ranks on one GPU, as on a one-GPU machine; benchmarks/probe_dp_gloo.py checks that
    the data-parallel collectives run over gloo on CUDA tensors first)."""
    backend = os.environ.get("SAFE_CKPT_GPU_RESUME_BACKEND", "nccl")
    if backend == "gloo":
        return max(1, int(os.environ.get("SAFE_CKPT_GPU_WORLD", "2"))), backend
    return _gpu_world(), backend


def test_default_group_nccl(tmp_path):
    world = _gpu_world()
    out = values(run_world(world, _cases().nccl_default_group, (str(tmp_path / "ck"),), backend="nccl"))
    for r in out:
        assert r["backend"] == "nccl"
        assert r["mismatches"] == [], r["mismatches"][:5]
        assert r["counts"]["HtoD"] == 0 and r["counts"]["nccl"] == 0, r["counts"]


def test_unmapped_device_memory_is_refused_on_every_rank(tmp_path):
    out = values(run_world(2, _cases().unmapped_is_refused, (str(tmp_path),)))
    for rank, r in enumerate(out):
        assert r["before"] == "cuda"
        assert r["after"] == ("cuda_unmapped" if rank == 1 else "cuda")
        for policy in ("error", "cpu_backup"):
            err = r[policy]
            assert err is not None and "ResidenceError" in err["mro"], (policy, err)
            assert "'paused'" in err["message"] and "not mapped" in err["message"], err["message"]
            assert err["failing_ranks"] == [1]
            assert not r[f"{policy}_committed"]
        assert r["device_ok"] and r["later_save_ok"]


@pytest.mark.skipif(importlib.util.find_spec("torch_memory_saver") is None, reason="torch_memory_saver not installed")
def test_real_memory_saver_pause_backup_resume(tmp_path):
    out = values(run_world(1, _cases().memory_saver_pause, (str(tmp_path),)))
    (r,) = out
    err = r["paused_error"]
    assert err is not None and "ResidenceError" in err["mro"], err
    assert "offload_backup" in r["backup_residences"], r["backup_residences"]
    assert r["backup_bit_exact"]
    assert "cuda" in r["resumed_residences"] and r["resumed_bit_exact"]


def test_pinned_pool_allocated_once_and_memory_bounded(tmp_path):
    (r,) = values(run_world(1, _cases().pool_reuse, (str(tmp_path),)))
    first, second = r["saves"]
    assert first["device_bytes"] == second["device_bytes"] >= 4 * r["budget"], r
    assert first["pool_allocations"] == 1 and second["pool_allocations"] == 0
    if second["torch_host_allocs"] is not None:
        assert second["torch_host_allocs"] == 0, r
    slack = 96 << 20
    assert first["extra_rss"] <= r["budget"] + slack, r
    assert second["extra_rss"] <= slack, r


def _have_megatron_training():
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _have_megatron_training(), reason="needs Megatron-LM's megatron.training on the path")
@pytest.mark.parametrize("variant", ["gpu", "cpu_offload_pinned", "cpu_offload_pageable_grads"])
def test_real_gpt_distributed_optimizer_resume_is_bit_exact(tmp_path, variant):
    from tests.helpers.bodies import gpu_megatron as g
    from tests.helpers.megatron_evidence import diff_digests

    world, backend = _resume_world()
    root = str(tmp_path)
    full = values(run_world(world, g.run, (root + "/full", variant, "full"), backend=backend, timeout_s=400))
    saved = values(run_world(world, g.run, (root, variant, "save"), backend=backend, timeout_s=400))
    resumed = values(run_world(world, g.run, (root, variant, "resume"), backend=backend, timeout_s=400))
    resumed_stock = values(run_world(world, g.run, (root, variant, "resume_stock"), backend=backend, timeout_s=400))
    for r_full, r_saved, r_resumed, r_stock in zip(full, saved, resumed, resumed_stock):  # evidence first
        print(variant, f"DP={world} over {backend}", "losses full", r_full["losses"], "resumed", r_resumed["losses"], "from stock",
              r_stock["losses"], "step repair", r_resumed.get("adam_step_repair"), "save memcpy",
              r_saved.get("save_memcpy"), "digest diff", diff_digests(r_saved["opt_digest"], r_resumed["opt_digest"])[:5],
              "content", {k: v for k, v in saved[0].get("content", {}).items() if k != "traceback"})
    cmp = saved[0]["compare"]
    assert saved[0]["tracker"] == str(g.FIRST)
    assert cmp["metadata_equal"], cmp
    assert cmp["common_equal"], cmp
    # the same files, plus safe_ckpt's integrity manifest (stock loaders ignore it; checksums=False drops it)
    assert [f for f in cmp["files_ours"] if f != MANIFEST_FILE] == cmp["files_stock"], cmp
    assert MANIFEST_FILE in cmp["files_ours"], cmp
    # every stored tensor and object is byte-identical to stock Megatron's save of the same state,
    # except the common state's args.save, which the test points at another directory for the stock save
    content = saved[0]["content"]
    differ = [f for f in content["differ"] or ["<unreadable>"] if not (
        f.startswith("common_state") and content["common_differ"] == ["args"]
        and content["common_args_differ"] == ["save"])]
    assert differ == [] and content["tensors"] > 0 and content["objects"] > 0, content
    for r_full, r_saved, r_resumed, r_stock in zip(full, saved, resumed, resumed_stock):
        counts = r_saved["save_memcpy"]
        assert counts["HtoD"] == 0 and counts["nccl"] == 0 and counts["DtoH"] > 0, counts
        assert r_saved["losses"] == r_full["losses"][:g.FIRST]
        assert r_resumed["start_iteration"] == r_stock["start_iteration"] == g.FIRST
        # the optimizer resumes with exactly the state that was saved (main params, moments, step, lr)
        assert diff_digests(r_saved["opt_digest"], r_resumed["opt_digest"]) == [], r_resumed["adam_step_repair"]
        assert diff_digests(r_saved["opt_digest"], r_stock["opt_digest"]) == []
        # safe_ckpt's checkpoint resumes exactly like stock Megatron's own checkpoint
        assert r_resumed["losses"] == r_stock["losses"], (r_resumed["losses"], r_stock["losses"])
        assert r_resumed["losses"] == r_full["losses"][g.FIRST:], (r_resumed["losses"], r_full["losses"])


def test_device_checksums(tmp_path):
    (r,) = values(run_world(1, _cases().device_checksums, (str(tmp_path / "ck"),)))
    for mode in _cases().MODES_DEVICE_CHECKSUMS:
        m = r[mode]
        assert m["mismatches"] == [], (mode, m["mismatches"][:5])
        assert m["verify_ok"] and m["checksummed"] == m["items"], (mode, m["findings"])
        assert m["counts"]["HtoD"] == 0 and m["counts"]["nccl"] == 0, (mode, m["counts"])
        grid = sum(n for a, n in m["algorithms"].items() if a.startswith("grid32+"))
        host = sum(n for a, n in m["algorithms"].items() if not a.startswith("grid32+"))
        if mode == "off":
            assert grid == 0, m["algorithms"]
        else:  # large aligned chunks summed on the device; unaligned and small ones hashed on the host
            assert grid > 0 and host > 0, (mode, m["algorithms"])
    assert [p for p, _ in r["corrupt_findings"]] == [r["corrupt_item"]], r["corrupt_findings"]
    assert "checksum mismatch" in r["corrupt_findings"][0][1]


def test_bench_device_copy_is_exact(tmp_path):
    (r,) = values(run_world(1, _cases().bench_device_copy, (str(tmp_path),)))
    assert r["first"] and r["second"] and r["tensors"] == 3, r
    assert r["write_s"] > 0 and r["copy_s"] > 0
