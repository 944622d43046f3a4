"""Entry points whose optional dependency is missing fail with a typed error that names what is
missing and the remedy, not a bare ModuleNotFoundError; run in a fresh interpreter whose path holds
this checkout and no Megatron-LM."""

import os
import subprocess
import sys
import textwrap

from tests.helpers.paths import REPO as ROOT


SAVE = textwrap.dedent("""
    import importlib.util
    import safe_ckpt
    import safe_ckpt.megatron
    try:
        safe_ckpt.megatron.save_checkpoint(1, [], None, None)
    except safe_ckpt.MissingDependencyError as exc:
        assert isinstance(exc, ImportError) and isinstance(exc, safe_ckpt.CheckpointError)
        print(exc)
""")


def _run(code: str, pythonpath: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=cwd,
                          env={**os.environ, "PYTHONPATH": pythonpath}, capture_output=True, text=True, timeout=300)


def test_megatron_save_checkpoint_without_megatron_lm_names_the_remedy(tmp_path):
    probe = _run("import importlib.util as u; print(u.find_spec('megatron.training'))", ROOT, tmp_path)
    assert probe.stdout.strip() == "None", "megatron.training is importable here: this test needs it absent"
    r = _run(SAVE, ROOT, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("safe_ckpt.megatron.save_checkpoint needs Megatron-LM's megatron.training, "
                               "which is not installed (megatron-core ")
    assert ("install megatron-core >= 0.19, which ships megatron.training, or put a Megatron-LM checkout on "
            "PYTHONPATH; safe_ckpt.megatron.save_state needs megatron-core only") in r.stdout


def test_megatron_training_missing_its_own_dependency_names_that_module(tmp_path):
    """megatron.training present but one of its imports missing: the error names that module."""
    pkg = tmp_path / "lm" / "megatron" / "training"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "checkpointing.py").write_text("import no_such_megatron_dependency\n")
    r = _run(SAVE, os.pathsep.join([ROOT, str(tmp_path / "lm")]), tmp_path)
    assert r.returncode == 0, r.stderr
    assert "importing Megatron-LM's megatron.training failed: no module named 'no_such_megatron_dependency'" \
        in r.stdout
