"""verify / inspect / gc, the replace policy and retention (one process, no torch.distributed)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import safe_ckpt
from safe_ckpt.retention import Retention, to_remove
from safe_ckpt.tools import gc as gc_tool

from safe_ckpt.tools.verify import verify


def _state(seed=0):
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    g = torch.Generator().manual_seed(seed)
    return {"w": ShardedTensor.from_rank_offsets("w", torch.randn(300, 100, generator=g)),
            "b": ShardedTensor.from_rank_offsets("b", torch.randn(77, generator=g).to(torch.bfloat16)),
            "o": ShardedObject("o", {"seed": seed}, (1,), (0,)), "iteration": seed}


def _save(path, seed=0, **kw):
    opts = safe_ckpt.SaveOptions(**{"chunk_bytes": 32 * 1024, "io_threads": 2, "progress_interval_s": 0, **kw})
    return safe_ckpt.save(_state(seed), path, options=opts)


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "ck")
    _save(path)
    return path


def _errors(report):
    return [f for f in report.findings if f.severity == "error"]


def test_verify_passes_a_good_checkpoint_deeply(ckpt):
    report = verify(ckpt, deep=True)
    assert report.ok, report.findings
    assert report.items_checked == report.checksummed_items >= 6 and not report.findings


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_checksums_in_the_writers_equal_checksums_beside_them(tmp_path, threads, monkeypatch):
    from safe_ckpt import pipeline

    monkeypatch.setattr(pipeline, "FUSED_PIECE_BYTES", 4096)  # several pieces per item, split inside buffers
    paths = {}
    for n in (None, threads):
        paths[n] = str(tmp_path / f"ck{n}")
        _save(paths[n], seed=3, checksum_threads=n)
    manifests = {n: json.load(open(os.path.join(p, "safe_ckpt_manifest.json"))) for n, p in paths.items()}
    # The same items; checksum values differ per save (torch's archives carry a serialization id),
    # so each is checked against the bytes on disk by a deep verify.
    rows = {n: {f: [r[:2] + r[3:] for r in rs] for f, rs in m["items"].items()} for n, m in manifests.items()}
    assert rows[None] == rows[threads] and sum(len(r) for r in rows[threads].values()) >= 6
    for path in paths.values():
        report = verify(path, deep=True)
        assert report.ok and report.checksummed_items == report.items_checked, report.findings


def test_pieces_regroup_buffers_in_order_within_the_limit():
    from safe_ckpt.pipeline import _pieces

    bufs = [b"ab", bytes(range(10)), b"", b"xyz"]
    groups = list(_pieces(bufs, 4))
    assert all(sum(len(b) for b in g) <= 4 for g in groups)
    assert b"".join(bytes(b) for g in groups for b in g) == b"".join(bufs)
    assert [sum(len(b) for b in g) for g in groups] == [4, 4, 4, 3]


def test_verify_catches_a_flipped_byte(ckpt):
    path = os.path.join(ckpt, "__0_1.distcp")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(data)
    (err,) = _errors(verify(ckpt))
    assert err.path.startswith("__0_1.distcp@") and "checksum mismatch" in err.message


def test_verify_catches_a_truncated_file(ckpt):
    path = os.path.join(ckpt, "__0_0.distcp")
    os.truncate(path, os.path.getsize(path) - 100)
    errors = _errors(verify(ckpt))
    assert any("truncated" in e.message for e in errors) and any("cut short" in e.message for e in errors)


def test_verify_catches_a_missing_and_reports_an_extra_file(ckpt):
    os.remove(os.path.join(ckpt, "__0_0.distcp"))
    open(os.path.join(ckpt, "stray.bin"), "wb").write(b"x")
    report = verify(ckpt)
    (err,) = _errors(report)
    assert err.path == "__0_0.distcp" and err.message.startswith("missing file (")
    assert any(f.path == "stray.bin" and f.severity == "warning" for f in report.findings)


def test_verify_without_manifest_checks_structure(tmp_path):
    path = str(tmp_path / "ck")
    _save(path, checksums=False)
    assert not os.path.exists(os.path.join(path, "safe_ckpt_manifest.json"))
    report = verify(path)
    assert report.ok and report.checksummed_items == 0
    # damage the payload size recorded in the central directory of the last item of a file
    fpath = os.path.join(path, "__0_0.distcp")
    data = bytearray(open(fpath, "rb").read())
    cd = data.rfind(b"archive/data/0") - 46
    data[cd + 24] ^= 0x10
    open(fpath, "wb").write(data)
    assert any("payload bytes" in e.message for e in _errors(verify(path)))


def test_cli_verify_and_inspect(ckpt):
    ok = subprocess.run([sys.executable, "-m", "safe_ckpt", "verify", ckpt, "--json"], capture_output=True, text=True)
    assert ok.returncode == 0 and json.loads(ok.stdout)["ok"]
    out = subprocess.run([sys.executable, "-m", "safe_ckpt", "inspect", ckpt, "--json"], capture_output=True, text=True)
    info = json.loads(out.stdout)
    assert info["tensors"]["w"] == {"shape": [300, 100], "dtype": "float32", "chunks": 4,
                                    "stored_bytes": info["tensors"]["w"]["stored_bytes"]}
    assert info["tensors"]["b"]["dtype"] == "bfloat16" and info["iteration"] == 0
    assert sum(info["bytes_per_rank"].values()) == sum(f["bytes"] for n, f in info["files"].items()
                                                        if n.endswith(".distcp"))
    text = subprocess.run([sys.executable, "-m", "safe_ckpt", "inspect", ckpt], capture_output=True,
                          text=True).stdout
    assert "float32" in text and "(300, 100)" in text


def test_resave_replaces_atomically_and_foreign_data_is_refused(tmp_path):
    path = str(tmp_path / "ck")
    _save(path, seed=1)
    _save(path, seed=2)  # re-saving the same iteration directory
    import torch.distributed.checkpoint as dcp

    out = {"w": torch.empty(300, 100)}
    dcp.load(out, checkpoint_id=path, no_dist=True)
    assert torch.equal(out["w"], _state(2)["w"].data)
    with pytest.raises(safe_ckpt.CommitError, match="never"):
        _save(path, replace="never")
    foreign = str(tmp_path / "foreign")
    os.makedirs(foreign)
    open(os.path.join(foreign, "notes.txt"), "w").write("mine")
    with pytest.raises(safe_ckpt.CommitError, match="foreign"):
        _save(foreign)
    assert open(os.path.join(foreign, "notes.txt")).read() == "mine"
    _save(foreign, replace="any")
    assert verify(foreign).ok


def test_leftovers_are_cleared_by_the_next_save_and_by_gc(tmp_path):
    path = str(tmp_path / "ck")
    dead = [str(tmp_path / ".ck.safe_ckpt-staging-dead1"), str(tmp_path / ".ck.safe_ckpt-replaced-dead2")]
    for d in dead:
        os.makedirs(d)
    _save(path)
    assert not any(os.path.exists(d) for d in dead)
    other = [str(tmp_path / ".iter_0000001.safe_ckpt-staging-x"), str(tmp_path / "sub" / ".a.safe_ckpt-deleting-y"),
             str(tmp_path / "latest_checkpointed_iteration.txt.safe_ckpt-staging-z")]
    os.makedirs(other[0])
    os.makedirs(other[1])
    open(other[2], "w").close()
    assert set(gc_tool.collect(str(tmp_path), dry_run=True)) == set(other)
    assert all(os.path.exists(p) for p in other)
    assert set(gc_tool.collect(str(tmp_path))) == set(other)
    assert not any(os.path.exists(p) for p in other) and os.path.isdir(path)


def test_retention_policy():
    found = list(range(1, 11))
    assert to_remove(found, 10, Retention(keep_last=2)) == list(range(1, 9))
    assert to_remove(found, 10, Retention(keep_last=2, keep_every=4)) == [1, 2, 3, 5, 6, 7]
    assert to_remove(found, 7, Retention(keep_every=5)) == [1, 2, 3, 4, 6]  # newer ones untouched
    assert to_remove(found, 10, Retention()) == []


def test_save_state_applies_retention_after_the_tracker(tmp_path):
    from safe_ckpt.megatron import save_state

    root = str(tmp_path)
    for it in range(1, 8):
        save_state(_state(it), root, os.path.join(root, f"iter_{it:07d}"), str(it),
                   options=safe_ckpt.SaveOptions(chunk_bytes=32 * 1024, io_threads=1, progress_interval_s=0),
                   retention=Retention(keep_last=2, keep_every=3))
        assert open(os.path.join(root, "latest_checkpointed_iteration.txt")).read() == str(it)
    left = sorted(n for n in os.listdir(root) if n.startswith("iter_"))
    assert left == ["iter_0000003", "iter_0000006", "iter_0000007"]
    assert not [n for n in os.listdir(root) if ".safe_ckpt-" in n]
    shutil.rmtree(root)
