"""GPU tests of the copy window (marked `gpu`; skipped without CUDA). Each runs in a spawned rank
on cuda:0. The core tests drive the window, its copier and the gates with real CUDA streams; the
Megatron tests save a real GPTModel through the drop-in's overlap mode (`--safe-ckpt-overlap-copy`
with `--async-save`): bit-exact resume through stock `load_checkpoint`, and the save under the
profiler, in both variants (all on the GPU, and `--optimizer-cpu-offload`)."""

import importlib.util

import pytest

from tests.helpers.mp import run_world, values

pytestmark = pytest.mark.gpu


def _cases():
    from tests.helpers.bodies import gpu_zero_stall as gpu_zero_stall_cases

    return gpu_zero_stall_cases


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "control_without_gate"])
def test_the_gate_orders_the_optimizer_step_after_held_copies_without_blocking_the_host(tmp_path, gated):
    (r,) = values(run_world(1, _cases().gate_orders_the_step_after_held_copies, (str(tmp_path), gated)))
    print(r)
    chunks_pre, chunks_post = r["pre_step_chunks"], r["post_step_chunks"]
    assert r["spin_s"] > 0.05, r  # the copies really were held
    if gated:
        assert r["error"] is None, r["error"]
        assert all(same == n for same, n in chunks_pre.values()), chunks_pre  # every byte pre-step
        assert not r["copies_done_when_step_returned"], r  # the host did not wait for the copies...
        assert r["step_host_s"] < r["spin_s"] / 4, r  # ...it only queued a stream wait
        assert r["stats"]["blocked_gates"] == 0 and r["stats"]["gates"] >= 1, r["stats"]
    else:  # without the gate the copies read post-step bytes: the content sums fail the save
        assert all(same == n for same, n in chunks_post.values()), chunks_post
        assert r["error"] is not None and "differ between the window's opening and its last copy" in r["error"]


def test_uncovered_device_writes_fail_the_save_naming_key_and_rank(tmp_path):
    (r,) = values(run_world(1, _cases().uncovered_device_writes, (str(tmp_path),)))
    for how in ("data_add", "in_place"):
        assert r[how] is not None, (how, r)
        assert "'w'" in r[how] and "rank 0" in r[how] and "'other'" not in r[how], r[how]
    assert "differ between the window's opening" in r["data_add"]
    assert "version counter moved" in r["in_place"]


def test_the_window_makes_no_host_to_device_copy_and_no_nccl(tmp_path):
    (r,) = values(run_world(1, _cases().save_copies_make_no_host_to_device_copy_and_no_nccl, (str(tmp_path),)))
    counts = r["counts"]
    assert counts["DtoH"] > 0 and counts["HtoD"] == 0 and counts["nccl"] == 0, counts
    assert all(same == n for same, n in r["chunks"].values()), r["chunks"]


@pytest.mark.skipif(importlib.util.find_spec("torch_memory_saver") is None, reason="torch_memory_saver not installed")
def test_a_memory_saver_pause_waits_for_held_copies(tmp_path):
    (r,) = values(run_world(1, _cases().memory_saver_pause_waits_for_copies, (str(tmp_path),)))
    assert r["pause_s"] > 0.05, r  # it waited for the held copies
    assert all(same == n for same, n in r["chunks"].values()), r["chunks"]


def _overlap_mode_integrated() -> bool:
    from safe_ckpt.options import SaveOptions

    return "return_after" in SaveOptions.__dataclass_fields__


def _have_megatron_training():
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _have_megatron_training(), reason="needs Megatron-LM's megatron.training on the path")
@pytest.mark.parametrize("variant", ["gpu", "cpu_offload_pinned"])
def test_overlap_save_resumes_bit_exact(tmp_path, variant):
    if not _overlap_mode_integrated():
        pytest.skip("the Megatron drop-in has no overlap mode yet (SaveOptions.return_after)")
    from tests.helpers.bodies import gpu_megatron as g
    from tests.helpers.megatron_evidence import diff_digests

    root = str(tmp_path)
    full = values(run_world(1, g.run, (root + "/full", variant, "full"), backend="nccl", timeout_s=400))
    (saved,) = values(run_world(1, _cases().overlap_save_then_train, (root, variant), backend="nccl", timeout_s=400))
    (resumed,) = values(run_world(1, g.run, (root, variant, "resume"), backend="nccl", timeout_s=400))
    print(variant, "full", full[0]["losses"], "saved", saved["losses"], "resumed", resumed["losses"],
          "call_s", saved["call_s"], "gated steps", saved["gated_steps"], "window", saved["window"])
    # A model this small is copied before its next optimizer step: the gates are exercised above
    assert saved["saved"] == 1, saved
    assert saved["losses"] == full[0]["losses"]  # saving in the background changed nothing in training
    assert resumed["start_iteration"] == g.FIRST
    assert diff_digests(saved["opt_digest"], resumed["opt_digest"]) == [], resumed.get("adam_step_repair")
    assert resumed["losses"] == full[0]["losses"][g.FIRST:], (resumed["losses"], full[0]["losses"])
    window = saved["window"]
    assert window is not None and window["pending_bytes"] == 0 and window["copied_bytes"] + window["captured_bytes"] > 0


@pytest.mark.skipif(not _have_megatron_training(), reason="needs Megatron-LM's megatron.training on the path")
@pytest.mark.parametrize("variant", ["gpu", "cpu_offload_pinned"])
def test_overlap_save_makes_no_host_to_device_copy_and_no_nccl(tmp_path, variant):
    if not _overlap_mode_integrated():
        pytest.skip("the Megatron drop-in has no overlap mode yet (SaveOptions.return_after)")
    (r,) = values(run_world(1, _cases().overlap_save_under_the_profiler, (str(tmp_path), variant), backend="nccl",
                            timeout_s=400))
    plain, saved = r["plain"], r["saved"]
    print(variant, "plain", {k: v for k, v in plain.items() if k != "kernel_names"},
          "with the save", {k: v for k, v in saved.items() if k != "kernel_names"}, "window", r["window"])
    assert r["results"] == 1, r
    assert saved["HtoD"] == plain["HtoD"], (plain, saved)  # the step's own batch copies only
    assert saved["nccl"] == plain["nccl"], (plain, saved)  # the step's own collectives only
    assert saved["DtoH"] > plain["DtoH"], (plain, saved)  # the save's copies did run


def test_the_device_sums_of_a_large_source_take_bounded_device_memory_and_are_exact():
    """On the GPU, a 1 GiB source is summed slice by slice: the device memory the measurement takes
    stays within one slice's widened copy (torch widens what it sums; one sum of the whole source
    took twice the source), the sums equal an independent int64 reference on the host (rows sampled, and the
    last partial row), measuring on fresh streams keeps no memory, and a one-byte change is found."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from safe_ckpt.staging import source_sums

    class Inline:
        def call(self, device, fn):
            fn()

    g = torch.Generator().manual_seed(31)
    source = torch.randn((256 << 20) + 5, generator=g).cuda()[3:]  # 1 GiB of fp32, partial last row
    nbytes = source.numel() * 4
    sums = source_sums.DeviceSums(Inline())
    sums.reserve(0, source)
    sums._buffer(0, 0), sums._buffer(0, 1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    sums.measure(0, 0, source)
    end.record()
    torch.cuda.synchronize()
    extra_bytes = torch.cuda.max_memory_allocated() - before
    print(f"sums of {nbytes / 2**30:.2f} GiB: {start.elapsed_time(end):.2f} ms, "
          f"{extra_bytes / 2**20:.1f} MiB extra device memory")
    assert extra_bytes <= source_sums.WIDE_BYTES + (8 << 20), extra_bytes

    got = sums._buffers[(0, 0)].cpu()
    words = source.view(torch.int32)
    whole = words.numel() // 1024
    for row in sorted({0, 1, whole // 2, whole - 1, *range(0, whole, whole // 61)}):
        assert int(got[row]) == int(words[row * 1024:(row + 1) * 1024].cpu().to(torch.int64).sum()), row
    assert int(got[whole]) == int(words[whole * 1024:].cpu().to(torch.int64).sum())

    used = []
    for _ in range(3):  # fresh streams, as each save's window takes
        with torch.cuda.stream(torch.cuda.Stream()):
            again = source_sums.DeviceSums(Inline())
            again.reserve(0, source)
            again.measure(0, 0, source)
        torch.cuda.synchronize()
        del again
        used.append(torch.cuda.memory_allocated())
    assert used[-1] - used[0] < 8 * 2**20, used

    source.view(torch.uint8)[nbytes // 2] ^= 0x01
    sums.measure(0, 1, source)
    assert sums.changed() == [0]
