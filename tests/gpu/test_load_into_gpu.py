"""GPU tests of the load path (marked gpu; skipped without CUDA): synthetic state resharded into GPU
templates (pinned-pool pieces, host-to-device copies on side streams) equal to stock load's result;
a large item checked by its grid sums on the device once the reads are done; and a real GPTModel +
DistributedOptimizer resumed through `safe_ckpt.megatron.load_checkpoint` training on bit-identical
to a stock resume."""

import importlib.util

import pytest

from tests.helpers.bodies import load as load_cases
from tests.helpers.mp import run_world, values
from tests.gpu.test_device_saves import _resume_world

pytestmark = pytest.mark.gpu


def test_gpu_templates_reshard_like_stock(tmp_path):
    cases = [("safe_tp2_to_1", "reshard", ("safe", 2, 1, "cuda")), ("stock_tp1_to_2", "reshard", ("stock", 1, 2, "cuda")),
             ("safe_same", "reshard", ("safe", 2, 2, "cuda"))]
    out = values(run_world(2, load_cases.suite, (str(tmp_path), cases), timeout_s=400))
    for name, _, (writer, tp, load_tp, _) in cases:
        for rank, r in enumerate(out):
            r = r[name]
            assert r["mismatches"] == [] and r["same_as_stock"] == [], (name, rank, r["mismatches"][:3],
                                                                         r["same_as_stock"][:3])
            assert r["device"] and r["report"]["decoded"] == 0, (name, r["report"])
            if writer == "safe" and tp == load_tp:
                assert r["report"]["verified"] == r["report"]["items"], (name, r["report"])


@pytest.mark.parametrize("driver", [True, False], ids=["driver_copies", "torch_copies"])
def test_items_summed_on_the_device_are_checked_after_the_reads_and_a_changed_byte_is_refused(tmp_path, monkeypatch,
                                                                                              driver):
    """An item bigger than a piece, bound for one GPU tensor, with a grid checksum: its pieces' copies
    land (through the CUDA driver, or through torch with the driver's copies off), its sums are
    enqueued on the device, and they are read back and compared only once every reader thread is
    done (no reader blocks on the device mid-read); bit-exact, counted verified, and a changed
    payload byte fails the load naming that key. Small items gathered into one read land too."""
    import threading

    import torch

    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    import safe_ckpt
    from safe_ckpt import integrity
    from safe_ckpt.errors import ReadError
    from safe_ckpt.loading import split
    from safe_ckpt import cuda_driver
    from tests.loading.test_load_reads_large_items_in_pieces import PIECE, _as_grid, _flip_payload_byte, _state

    state = _state()
    path = str(tmp_path / "ckpt")
    safe_ckpt.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in state.items()}, path)
    _as_grid(path, "a")
    summed, finishing, read_back, readers_alive = [], [], [], []
    stock_sums, stock_finish, stock_from = integrity.grid_sums, split.DeviceChecks.finish, split._Grid.from_summed

    def grid_sums(payload):
        summed.append(payload.device.type)
        return stock_sums(payload)

    def finish(self, checker, compare=True):
        finishing.append(True)
        readers_alive.append(sum(t.name.startswith("safe_ckpt-read") for t in threading.enumerate()))
        try:
            stock_finish(self, checker, compare)
        finally:
            finishing.pop()

    def from_summed(self, data):
        read_back.append(bool(finishing))
        return stock_from(self, data)

    monkeypatch.setattr(integrity, "grid_sums", grid_sums)
    monkeypatch.setattr(split.DeviceChecks, "finish", finish)
    monkeypatch.setattr(split._Grid, "from_summed", from_summed)
    driver_calls = []
    stock_htod = cuda_driver.memcpy_htod_async
    monkeypatch.setattr(cuda_driver, "memcpy_htod_async", lambda *a: driver_calls.append(a[2]) or stock_htod(*a))
    if not driver:
        monkeypatch.setattr(cuda_driver, "htod_copies_available", lambda: False)

    def load(**kw):
        reports = []
        out = {k: torch.full_like(v, 7, device="cuda") for k, v in state.items()}
        safe_ckpt.load({k: ShardedTensor.from_rank_offsets(k, out[k]) for k in state}, path,
                       safe_ckpt.LoadOptions(io_threads=3, staging_budget_bytes=1 << 20, piece_bytes=PIECE,
                                             batch_bytes=16 << 10, on_read=reports.append, **kw))
        torch.cuda.synchronize()
        return out, reports[-1]

    out, report = load()
    assert all(torch.equal(out[k].cpu(), state[k]) for k in state)
    assert report.verified == report.items and report.unverified == 0 and report.decoded == 0, report
    assert summed == ["cuda"] and read_back == [True] and readers_alive[-1] == 0, (summed, read_back, readers_alive)
    assert (sum(driver_calls) == sum(v.numel() * v.element_size() for v in state.values())) == driver, driver_calls
    _flip_payload_byte(path, "a")
    with pytest.raises(ReadError, match=r"key 'a'.*checksum mismatch") as info:
        load()
    assert [f.key for f in info.value.failures] == ["a"], str(info.value)
    out, report = load(verify_checksums=False)
    assert report.verified == 0 and not torch.equal(out["a"].cpu(), state["a"])


def _have_megatron_training():
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _have_megatron_training(), reason="needs Megatron-LM's megatron.training on the path")
@pytest.mark.parametrize("variant", ["gpu", "cpu_offload_pinned"])
def test_real_gpt_resumed_through_safe_load_trains_like_stock_resume(tmp_path, variant):
    from tests.helpers.bodies import gpu_load as gpu_load_cases
    from tests.helpers.bodies import gpu_megatron as g
    from tests.helpers.megatron_evidence import diff_digests

    world, backend = _resume_world()
    root = str(tmp_path)
    full = values(run_world(world, g.run, (root + "/full", variant, "full"), backend=backend, timeout_s=400))
    saved = values(run_world(world, g.run, (root, variant, "save"), backend=backend, timeout_s=400))
    stock = values(run_world(world, g.run, (root, variant, "resume"), backend=backend, timeout_s=400))
    ours = values(run_world(world, gpu_load_cases.resume_through_safe_ckpt, (root, variant, "safe"), backend=backend,
                            timeout_s=400))
    ours_of_stock = values(run_world(world, gpu_load_cases.resume_through_safe_ckpt, (root, variant, "stock"),
                                     backend=backend, timeout_s=400))
    for r_full, r_saved, r_stock, r_ours, r_other in zip(full, saved, stock, ours, ours_of_stock):  # evidence first
        print(variant, f"DP={world} over {backend}", "losses full", r_full["losses"], "stock resume", r_stock["losses"],
              "safe_ckpt resume", r_ours["losses"], "of stock's checkpoint", r_other["losses"],
              "digest diff", diff_digests(r_stock["opt_digest_as_loaded"], r_ours["opt_digest_as_loaded"])[:5])
    for r_full, r_saved, r_stock, r_ours, r_other in zip(full, saved, stock, ours, ours_of_stock):
        assert r_ours["start_iteration"] == r_other["start_iteration"] == r_stock["start_iteration"] == g.FIRST
        assert r_ours["loaded"][1] == g.FIRST
        # the load itself leaves exactly what stock's load leaves, before any repair
        assert diff_digests(r_stock["opt_digest_as_loaded"], r_ours["opt_digest_as_loaded"]) == []
        assert diff_digests(r_stock["opt_digest_as_loaded"], r_other["opt_digest_as_loaded"]) == []
        assert diff_digests(r_saved["opt_digest"], r_ours["opt_digest"]) == []
        # and training goes on bit-identically to a stock resume (and to the uninterrupted run)
        assert r_ours["losses"] == r_stock["losses"] == r_other["losses"], (r_ours["losses"], r_stock["losses"])
        assert r_ours["losses"] == r_full["losses"][g.FIRST:]
