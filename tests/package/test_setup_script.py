"""scripts/setup.sh says before it downloads torch which build it takes and how to take the CPU
build. Run on a copy of the script whose `.venv` holds a `python` that has no torch and a `pip`
that records its arguments, so nothing is downloaded."""

import os
import shutil
import stat
import subprocess

import pytest

from tests.helpers.paths import REPO as ROOT


def _tree(tmp_path, python_version: str):
    (tmp_path / "scripts").mkdir()
    shutil.copy(os.path.join(ROOT, "scripts", "setup.sh"), tmp_path / "scripts" / "setup.sh")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "calls.log"
    major, minor = python_version.split(".")
    scripts = {
        # `import torch` fails; the version probe prints the version asked for
        "python": f'#!/bin/sh\ncase "$*" in *"import torch"*) exit 1 ;; esac\necho {major}.{minor}\n',
        "pip": f'#!/bin/sh\necho "pip $*" >> "{log}"\necho "pip $*" >&2\n',
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    (bin_dir / "activate").write_text(f'PATH="{bin_dir}:$PATH"\n')
    return log


def _run(tmp_path, **env):
    return subprocess.run(["bash", "scripts/setup.sh"], cwd=tmp_path, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("version,spec", [("3.12", "torch>=2.6"), ("3.11", "torch==2.13.0")])
def test_default_index_is_announced_before_the_download_with_the_cpu_remedy(tmp_path, version, spec):
    log = _tree(tmp_path, version)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX"}
    r = subprocess.run(["bash", "scripts/setup.sh"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    notice = r.stderr.splitlines()[0]
    assert notice.startswith(f"setup: installing {spec} from pip's index. On Linux, PyPI's torch is the CUDA build: "
                             "about 3 GB")
    assert "TORCH_INDEX=cpu bash scripts/setup.sh" in notice and "https://download.pytorch.org/whl/cpu" in notice
    assert r.stderr.index(notice) < r.stderr.index(f"pip install {spec}")
    assert log.read_text().splitlines()[0] == f"pip install {spec}"


def test_torch_index_cpu_takes_the_cpu_build(tmp_path):
    log = _tree(tmp_path, "3.12")
    r = _run(tmp_path, TORCH_INDEX="cpu")
    assert r.returncode == 0, r.stderr
    assert "setup: installing torch>=2.6 from https://download.pytorch.org/whl/cpu" in r.stderr
    assert "CUDA" not in r.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "pip install --index-url https://download.pytorch.org/whl/cpu torch>=2.6"
    assert calls[1] == "pip install -q megatron-core==0.16.1 -e .[test] --config-settings editable_mode=compat"
