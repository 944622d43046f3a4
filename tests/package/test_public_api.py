"""The package as a user meets it: `__all__` names the public API and all of it imports;
`safe_ckpt.verify` / `safe_ckpt.inspect` work from Python; `show_progress` puts one clean line
per record on a stream; the wheel carries the license text and `py.typed`."""

import io
import logging
import os
import re
import tomllib

import pytest
import torch

import safe_ckpt

from tests.helpers.paths import REPO as ROOT


def _st(key, data):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return ShardedTensor.from_rank_offsets(key, data)


def _save(path, **options):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(7))  # 64 KiB
    opts = safe_ckpt.SaveOptions(**{"io_threads": 1, "chunk_bytes": 4096, "progress_interval_s": 0, **options})
    return safe_ckpt.save({"w": _st("w", w), "iteration": 42}, str(path), options=opts)


def test_all_names_the_public_api_and_every_name_imports():
    required = {"save", "async_save", "SaveOptions", "SaveResult", "SaveHandle", "verify", "inspect",
                "show_progress", "__version__", "CheckpointError", "ValidationError", "ResidenceError",
                "WriteError", "CommitError", "CoordinationError", "SourceModifiedError", "MissingDependencyError"}
    assert required <= set(safe_ckpt.__all__)
    assert len(set(safe_ckpt.__all__)) == len(safe_ckpt.__all__)
    namespace: dict = {}
    exec("from safe_ckpt import *", namespace)
    assert set(safe_ckpt.__all__) <= set(namespace)
    for name in safe_ckpt.__all__:
        if name[0].isupper() and name.endswith("Error"):
            assert issubclass(getattr(safe_ckpt, name), safe_ckpt.CheckpointError), name
    assert re.fullmatch(r"\d+\.\d+\.\d+", safe_ckpt.__version__)


def test_dir_shows_the_public_surface_not_internal_modules():
    import safe_ckpt.write.pipeline

    shown = set(dir(safe_ckpt))
    assert set(safe_ckpt.__all__) <= shown and {"megatron", "integrations"} <= shown
    assert not shown & {"write", "staging", "plan", "coord", "targets", "saving", "errors", "tools", "loading", "names"}


def test_the_load_function_survives_its_package_being_imported_and_patched():
    """`safe_ckpt.load` is the function; its package is `safe_ckpt.loading`, so importing a module
    of it or patching one by dotted path never rebinds the function's name."""
    import importlib
    from unittest import mock

    load = safe_ckpt.load
    importlib.import_module("safe_ckpt.loading.plan")
    with mock.patch("safe_ckpt.loading.objects.decode") as patched:
        from safe_ckpt.loading import objects

        assert objects.decode is patched
    assert safe_ckpt.load is load and load.__module__ == "safe_ckpt.loading.contract"
    assert safe_ckpt.LoadOptions.__module__ == "safe_ckpt.loading.options"


def test_verify_and_inspect_from_python(tmp_path):
    from safe_ckpt.targets.directory import publish as commit
    from safe_ckpt.targets.directory import root as dir_root

    ckpt = tmp_path / "iter_0000042"
    _save(ckpt)
    dir_root.write_tracker(str(tmp_path), 42)

    report = safe_ckpt.verify(str(ckpt))
    assert isinstance(report, safe_ckpt.VerifyReport)
    assert report.ok and report.items_checked >= 16 and report.checksummed_items == report.items_checked
    root = safe_ckpt.verify(tmp_path, deep=True)  # a save root (and a PathLike): the tracker is followed
    assert root.ok and root.directory == str(ckpt) and root.deep_loaded_items >= 16

    info = safe_ckpt.inspect(str(tmp_path))
    assert info["followed_tracker"] == "42" and info["iteration"] == 42
    assert info["tensors"]["w"]["shape"] == [64, 256] and info["tensors"]["w"]["dtype"] == "float32"
    assert safe_ckpt.inspect(str(ckpt))["followed_tracker"] is None

    data = sorted(f for f in os.listdir(ckpt) if f.endswith(".distcp"))[0]
    with open(ckpt / data, "r+b") as f:
        f.seek(os.path.getsize(ckpt / data) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    flipped = safe_ckpt.verify(str(ckpt))
    assert not flipped.ok and any(f.severity == "error" and data in f.path for f in flipped.findings)

    with pytest.raises(ValueError, match="no such checkpoint directory"):
        safe_ckpt.verify(str(tmp_path / "nope"))


@pytest.fixture
def progress_logger():
    """`show_progress` changes the "safe_ckpt" logger; put it back afterwards."""
    logger = logging.getLogger("safe_ckpt")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    yield logger
    for h in list(logger.handlers):
        if h not in handlers:
            logger.removeHandler(h)
    logger.setLevel(level)
    logger.propagate = propagate


def test_show_progress_prints_each_line_once_with_one_prefix(tmp_path, progress_logger):
    root_stream = io.StringIO()
    root_handler = logging.StreamHandler(root_stream)  # what logging.basicConfig() would attach
    logging.getLogger().addHandler(root_handler)
    try:
        stream = io.StringIO()
        first = safe_ckpt.show_progress(stream)
        assert safe_ckpt.show_progress() is first  # idempotent: one handler, still on the stream given first
        assert sum(h is first for h in progress_logger.handlers) == 1
        result = _save(tmp_path / "ck", progress_interval_s=1e-9)
    finally:
        logging.getLogger().removeHandler(root_handler)
    lines = stream.getvalue().splitlines()
    wrote = [line for line in lines if " wrote " in line]
    saved = [line for line in lines if " saved " in line]
    assert wrote and len(saved) == 1
    for line in lines:
        assert re.match(r"\d\d:\d\d:\d\d safe_ckpt: ", line), line
        assert line.count("safe_ckpt:") == 1, line
    size = r"(\d+ B|[0-9.]+ [KMGT]iB)"
    assert re.fullmatch(rf"\d\d:\d\d:\d\d safe_ckpt: rank 0 wrote {size} of {size} \(\d+%\) at {size}/s, "
                        r"ETA ([0-9.]+|inf) s", wrote[0]), wrote[0]
    assert saved[0].split(" safe_ckpt: ")[1].startswith(f"saved {result.checkpoint_dir}: ")
    assert root_stream.getvalue() == "", "each line once: the root logger's handlers do not repeat it"


def test_show_progress_names_levels_other_than_info(progress_logger):
    stream = io.StringIO()
    safe_ckpt.show_progress(stream)
    logging.getLogger("safe_ckpt.retention").warning("could not remove %s", "iter_0000001")
    assert re.fullmatch(r"\d\d:\d\d:\d\d safe_ckpt WARNING: could not remove iter_0000001\n", stream.getvalue())


def test_library_records_carry_no_prefix_of_their_own(tmp_path, caplog):
    """The logger's name says "safe_ckpt"; `basicConfig(level=INFO)` must not print it twice."""
    with caplog.at_level(logging.DEBUG, logger="safe_ckpt"):
        _save(tmp_path / "ck", progress_interval_s=1e-9)
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("safe_ckpt")]
    assert messages and not [m for m in messages if m.startswith("safe_ckpt")]


def test_pyproject_declares_the_license_and_py_typed():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["safe_ckpt"]
    assert project["project"]["license"] == "Apache-2.0" and project["project"]["license-files"] == ["LICENSE"]
    assert os.path.isfile(os.path.join(ROOT, "safe_ckpt", "py.typed"))
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert text.startswith("\n                                 Apache License\n                           Version 2.0")
    assert "END OF TERMS AND CONDITIONS" in text
    assert project["project"]["version"] == safe_ckpt.__version__


def test_built_wheel_carries_the_license_and_py_typed(tmp_path):
    """Build the wheel from a copy of the sources (pip, no build isolation: offline, seconds)."""
    import shutil
    import subprocess
    import sys
    import zipfile

    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip("pyproject's license-files needs setuptools >= 77")
    src = tmp_path / "src"
    for package in ("safe_ckpt", "safe_ckpt_lab"):
        shutil.copytree(os.path.join(ROOT, package), src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, timeout=300, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("safe_ckpt-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "safe_ckpt/py.typed" in names
    # both top-level packages: the library, and the lab `safe-ckpt demo` / `bench` run
    assert {"safe_ckpt/__init__.py", "safe_ckpt/cli/lab.py", "safe_ckpt_lab/__init__.py",
            "safe_ckpt_lab/bench/main.py"} <= set(names)
    licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert licenses and "Apache License" in zipfile.ZipFile(wheel).read(licenses[0]).decode()
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata and "Requires-Python: >=3.11" in metadata
