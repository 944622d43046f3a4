"""`safe_ckpt.megatron.load_checkpoint` against stock `load_checkpoint` (the megatron.training
stand-in, core_v0.19.0's torch_dist load path) on two gloo ranks: the latest iteration,
`--ckpt-step`, `--no-load-optim`, `--no-load-rng` and `--finetune` resume the model, optimizer,
scheduler, RNGs and counters exactly as stock does; and the load strategy for code that calls
stock `dist_checkpointing.load` itself."""

import os

from tests.helpers.bodies import load_megatron as cases
from tests.helpers.mp import run_world, values


def test_load_checkpoint_resumes_like_stock_under_every_flag(tmp_path):
    out = values(run_world(2, cases.save_and_resume, (str(tmp_path),), timeout_s=400))
    for rank, r in enumerate(out):
        draws, resumes = r["draws"], r["resumes"]
        for name, res in resumes.items():
            assert res["differences"] == [], (name, rank, res["differences"])
            assert res["module_restored"], name
            assert res["loaded"] == (os.path.abspath(str(tmp_path)), cases.CASES[name][1]), (name, res["loaded"])
            assert res["protected"] == [cases.CASES[name][1]], (name, res["protected"])  # retention keeps it
        latest, step = resumes["latest"], resumes["ckpt_step"]
        assert latest["iteration"] == 7 and latest["flops"] == 21 and latest["consumed"] == 700
        assert latest["model"] == [] and latest["optimizer_loaded"] and latest["scheduler"]["num_steps"] == 70
        assert tuple(latest["draws"]) == tuple(draws[7])  # the RNGs continue where the save left them
        assert step["iteration"] == 5 and step["model"] == [] and step["scheduler"]["num_steps"] == 50
        assert tuple(step["draws"]) == tuple(draws[5])
        assert not resumes["no_load_optim"]["optimizer_loaded"] and resumes["no_load_optim"]["reloaded"] == 1
        assert resumes["no_load_optim"]["scheduler"] is None and resumes["no_load_optim"]["model"] == []
        assert tuple(resumes["no_load_rng"]["draws"]) != tuple(draws[7])
        assert resumes["no_load_rng"]["optimizer_loaded"]
        fine = resumes["finetune"]
        assert fine["iteration"] == 0 and not fine["optimizer_loaded"] and fine["model"] == []
        assert tuple(fine["draws"]) != tuple(draws[7])


def test_load_checkpoint_installed_in_megatrons_module_reads_through_safe_ckpt(tmp_path):
    out = values(run_world(2, cases.save_and_install_in_place, (str(tmp_path),), timeout_s=240))
    for r in out:
        assert r["differences"] == [] and r["wrapped_differences"] == [] and r["iteration"] == 7, r
        assert r["loaded"] == (os.path.abspath(str(tmp_path)), 7), r


def test_the_megatron_loader_admits_the_optimizer_classes_cpu_offload_records():
    """With --optimizer-cpu-offload, megatron-core's HybridDeviceOptimizer keeps its optimizer
    classes in its param groups (`defaults`): the Megatron loader admits torch's optimizer classes
    (stock load rebuilds them) and nothing more; a plain safe_ckpt.load still refuses them."""
    import io
    import types

    import pytest
    import torch

    from safe_ckpt.errors import ReadError
    from safe_ckpt.loading import objects
    from safe_ckpt.megatron.loading import load_options_from_args

    buffer = io.BytesIO()
    torch.save({"param_groups": [{"lr": 0.1, "cpu_optimizer_cls": torch.optim.AdamW,
                                  "gpu_optimizer_cls": torch.optim.Adam}]}, buffer)
    options = load_options_from_args(types.SimpleNamespace())
    state = objects.decode(buffer.getvalue(), "optimizer state", options.safe_globals)
    assert state["param_groups"][0]["cpu_optimizer_cls"] is torch.optim.AdamW
    with pytest.raises(ReadError, match="torch.optim.adamw.AdamW"):
        objects.decode(buffer.getvalue(), "optimizer state", ())
    buffer = io.BytesIO()
    torch.save({"evil": torch.nn.Linear}, buffer)
    with pytest.raises(ReadError, match="torch.nn.modules.linear.Linear"):
        objects.decode(buffer.getvalue(), "optimizer state", options.safe_globals)
