"""The real-slime GPU tests and the slime modes bench run their ranks in spawned processes on a
patched copy of Megatron (scripts/slime_megatron_patch.py). A spawned rank starts with its
parent's `sys.path`, not PYTHONPATH's order: without `patched_megatron_first` the ranks ran the
installed, unpatched Megatron (the DDP buffers with a backup), which is not slime's layout."""

import os

from tests.helpers.mp import run_world, values


def _where(rank, world):
    from tests.helpers.bodies.gpu_slime_shipped import patched_megatron_first

    return {"reported": patched_megatron_first(), "core": __import__("megatron.core").core.__file__}


def test_a_spawned_rank_imports_the_patched_megatron_not_the_installed_one(tmp_path, monkeypatch):
    copy = tmp_path / "patched"
    (copy / "megatron" / "core").mkdir(parents=True)
    (copy / "megatron" / "core" / "__init__.py").write_text("PATCHED = True\n")
    monkeypatch.setenv("SLIME_MEGATRON", str(copy))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(copy), os.environ.get("PYTHONPATH", "")]))
    (out,) = values(run_world(1, _where, (), timeout_s=120))
    assert out["core"].startswith(str(copy)), out
    assert out["reported"] == out["core"]
