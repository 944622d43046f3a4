"""The supported megatron-core floor: older releases are refused by name, at import and at save time."""

import os
import subprocess
import sys

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

import safe_ckpt
from safe_ckpt import compat

from tests.helpers.paths import REPO as ROOT


def _fake_megatron_metadata(tmp_path, version: str) -> str:
    """A directory whose package metadata says megatron-core ``version`` is installed."""
    info = tmp_path / f"megatron_core-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: megatron-core\nVersion: {version}\n")
    return str(tmp_path)


def test_importing_with_megatron_core_0_14_fails_naming_both_versions(tmp_path):
    fake = _fake_megatron_metadata(tmp_path, "0.14.0")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([fake, ROOT])}
    proc = subprocess.run([sys.executable, "-c", "import safe_ckpt"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: safe_ckpt needs megatron-core >= 0.15, but megatron-core 0.14.0 is "
                           "installed"), proc.stderr[-2000:]
    assert "flattened_range" in last and "pip install 'megatron-core>=0.15'" in last


@pytest.fixture
def installed_megatron(monkeypatch):
    """Pretend another megatron-core release is installed (the metadata lookup only)."""
    def pretend(version: str) -> None:
        monkeypatch.setattr(compat, "_installed_megatron_version", lambda: Version(version))
        compat.megatron_version.cache_clear()

    yield pretend
    monkeypatch.undo()
    compat.megatron_version.cache_clear()


def test_saving_with_megatron_core_0_13_is_refused_naming_both_versions(tmp_path, installed_megatron):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    data = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    state = {"w": ShardedTensor("w", data, data.dtype, (4, 4), (4, 4), (0, 0), axis_fragmentations=None)}
    installed_megatron("0.13.1")
    with pytest.raises(safe_ckpt.CheckpointError) as info:
        safe_ckpt.save(state, str(tmp_path / "ck"), options=safe_ckpt.SaveOptions(progress_interval_s=0))
    msg = str(info.value)
    assert "megatron-core >= 0.15, but megatron-core 0.13.1 is installed" in msg, msg
    assert not os.path.exists(tmp_path / "ck")


@pytest.mark.parametrize("version,supported", [
    ("0.13.1", False), ("0.14.0", False), ("0.15.0rc0", True), ("0.15.3", True), ("0.16.1", True), ("0.19.2", True),
    ("1.0.0", True),
])
def test_floor_counts_pre_releases_of_the_floor_as_supported(version, supported):
    assert (compat.unsupported_megatron_reason(Version(version)) is None) == supported


def test_pyproject_asks_for_the_same_floor_that_compat_enforces():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = [Requirement(d) for d in tomllib.load(f)["project"]["dependencies"]]
    (mcore,) = [d for d in deps if d.name == "megatron-core"]
    assert str(mcore.specifier) == f">={compat.MEGATRON_CORE_FLOOR}"
