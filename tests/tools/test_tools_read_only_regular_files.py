"""verify, inspect and copy open only regular files of the checkpoint and read only what it declares:
a FIFO, a socket or a device in place of a file, or a symlink leading out of the directory, is refused
with a message naming the file (never waited on, never read without end); a symlink inside the
directory is followed; bytes past the last item, and items the index makes overlap, are not read.

Every case that hangs a reader that opens whatever it finds runs the command in a fresh interpreter
with a timeout, so a regression fails the test instead of hanging the suite."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys

import pytest

from safe_ckpt.encoding import safe_read as safe_load
from tests.tools.test_tools_never_run_checkpoint_code import _cli, _save
from tests.helpers.paths import REPO as ROOT

DATA = "__0_0.distcp"


def _run(*argv, timeout_s: float = 90):
    """``python -m safe_ckpt *argv``: it must finish within ``timeout_s``."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        return subprocess.run([sys.executable, "-m", "safe_ckpt", *argv], capture_output=True, text=True, env=env,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"safe-ckpt {' '.join(argv)} did not finish within {timeout_s} s: it waits on or reads without "
                    f"end a file that is not a regular file of the checkpoint")


@pytest.fixture
def ckpt(tmp_path):
    return _save(str(tmp_path / "ck"))


def _replace_with_fifo(ckpt: str, name: str) -> str:
    path = os.path.join(ckpt, name)
    os.unlink(path)
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("names", [(DATA, "safe_ckpt_manifest.json", "common.pt"), (".metadata",)],
                         ids=["data_manifest_common", "index"])
def test_a_fifo_in_place_of_a_file_is_refused_not_waited_on(ckpt, names):
    for name in names:
        _replace_with_fifo(ckpt, name)
    out = _run("verify", "--deep", ckpt)
    assert out.returncode == 1, (out.stdout, out.stderr)
    for name in names:
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith(f"ERROR   {name}")), None)
        assert line is not None and "a FIFO (named pipe), not a regular file" in line, out.stdout
    assert "Traceback" not in out.stderr


def test_inspect_and_copy_do_not_wait_on_a_fifo(ckpt, tmp_path):
    _replace_with_fifo(ckpt, DATA)
    out = _cli("inspect", "--json", ckpt)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["files"][DATA]["not_read"] == "a FIFO (named pipe)"
    assert "not read: a FIFO" in _cli("inspect", ckpt).stdout
    out = _run("copy", ckpt, str(tmp_path / "copied"))
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert DATA in out.stderr and "a FIFO (named pipe), not a regular file" in out.stderr, out.stderr
    assert not os.path.exists(tmp_path / "copied" / ".metadata")


def _declare_length(ckpt: str, name: str, length: int) -> None:
    """Rewrite the index so that the first item of ``name`` declares ``length`` bytes."""
    meta = safe_load.read_metadata(ckpt)
    index = min((i for i, info in meta.storage_data.items() if info.relative_path == name),
                key=lambda i: meta.storage_data[i].offset)
    meta.storage_data[index].length = length
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    os.unlink(os.path.join(ckpt, "safe_ckpt_manifest.json"))  # its index checksum would be the first error


def test_a_symlink_to_dev_zero_declaring_a_terabyte_is_refused(ckpt):
    _declare_length(ckpt, DATA, 1 << 40)
    os.unlink(os.path.join(ckpt, DATA))
    os.symlink("/dev/zero", os.path.join(ckpt, DATA))
    out = _run("verify", "--deep", "--json", ckpt)
    assert out.returncode == 1, (out.stdout, out.stderr)
    report = json.loads(out.stdout)
    assert any(f["severity"] == "error" and f["path"] == DATA and f["message"].startswith(
        "refused: a symlink to /dev/zero, outside the checkpoint directory; not read") for f in report["findings"]), \
        report["findings"]
    assert report["bytes"] < 1 << 20


def test_a_symlink_leading_out_of_the_checkpoint_is_refused_and_one_inside_followed(ckpt, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.rename(os.path.join(ckpt, DATA), outside / DATA)
    os.symlink(outside / DATA, os.path.join(ckpt, DATA))
    out = _cli("verify", ckpt)
    assert out.returncode == 1, out.stdout
    assert f"ERROR   {DATA}: refused: a symlink to {outside / DATA}, outside the checkpoint directory" in out.stdout
    out = _cli("copy", ckpt, str(tmp_path / "copied"))
    assert out.returncode == 1 and "outside the checkpoint directory" in out.stderr, out.stderr
    assert "outside the checkpoint directory" in json.loads(_cli("inspect", "--json", ckpt).stdout)["files"][DATA][
        "not_read"]

    os.unlink(os.path.join(ckpt, DATA))  # the same bytes inside the directory, reached through a symlink
    os.makedirs(os.path.join(ckpt, "data"))
    os.rename(outside / DATA, os.path.join(ckpt, "data", DATA))
    os.symlink(os.path.join("data", DATA), os.path.join(ckpt, DATA))
    out = _cli("verify", "--deep", ckpt)
    assert out.returncode == 0 and "OK:" in out.stdout, out.stdout
    assert _cli("copy", ckpt, str(tmp_path / "copied2")).returncode == 0
    assert _cli("verify", str(tmp_path / "copied2")).returncode == 0


def test_a_socket_in_place_of_a_data_file_is_refused(ckpt):
    path = os.path.join(ckpt, DATA)
    os.unlink(path)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(path)
        out = _run("verify", ckpt)
    assert out.returncode == 1 and f"ERROR   {DATA}: refused: a socket, not a regular file" in out.stdout, out.stdout


def test_verify_reads_only_what_the_index_declares_each_byte_once(ckpt):
    with open(os.path.join(ckpt, DATA), "ab") as f:  # bytes past the last item
        f.write(os.urandom(4096))
    report = json.loads(_cli("verify", "--json", ckpt).stdout)
    declared = sum(info.length for info in safe_load.read_metadata(ckpt).storage_data.values())
    assert report["bytes"] == declared
    assert any(f["path"] == DATA and "4096 bytes after the last item" in f["message"] for f in report["findings"])

    # an index whose every item claims the whole data file: each would read it all again
    meta = safe_load.read_metadata(ckpt)
    size = os.path.getsize(os.path.join(ckpt, DATA))
    for info in meta.storage_data.values():
        info.relative_path, info.offset, info.length = DATA, 0, size
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    report = json.loads(_cli("verify", "--json", ckpt).stdout)
    assert not report["ok"] and report["bytes"] <= size, report["bytes"]
    overlaps = [f for f in report["findings"] if "overlaps the item before it" in f["message"]]
    assert len(overlaps) == len(meta.storage_data) - 1


def test_a_manifest_naming_a_file_outside_is_refused(ckpt):
    path = os.path.join(ckpt, "safe_ckpt_manifest.json")
    with open(path) as f:
        doc = json.load(f)
    doc["whole_files"]["../../../../../../dev/zero"] = 0
    with open(path, "w") as f:
        json.dump(doc, f)
    out = _run("verify", ckpt)
    assert out.returncode == 1 and "points outside the checkpoint directory" in out.stdout, out.stdout
