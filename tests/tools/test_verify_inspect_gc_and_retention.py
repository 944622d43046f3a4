"""verify / inspect / gc, the replace policy and retention (one process, no torch.distributed)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import safe_ckpt
from safe_ckpt.targets.retention import Retention, to_remove
from safe_ckpt.targets.directory import gc as gc_tool

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
    from safe_ckpt.write import item_writes

    monkeypatch.setattr(item_writes, "FUSED_PIECE_BYTES", 4096)  # several pieces per item, split inside buffers
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
    from safe_ckpt.write.item_writes import pieces

    bufs = [b"ab", bytes(range(10)), b"", b"xyz"]
    groups = list(pieces(bufs, 4))
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
    os.utime(other[2], (1, 1))  # an old one: a fresh one may be a running save's
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


# ------------------------------------------------------------------ grid checksums (device-side sums)

GRID_SPEC = dict(hidden=517, ffn=2068, vocab=4100, layers=2, seq=32, buckets=2, bucket_numel=300_001,
                 pieces_per_rank=3)


def _grid_checksum(prefix: bytes, payload: torch.Tensor, suffix: bytes, algorithm: str | None = None) -> int:
    from safe_ckpt.integrity import GRID_ALGORITHM, GRID_ROW_BYTES, grid_fold, grid_sums

    raw = payload.numpy().tobytes()
    n = len(raw)
    return grid_fold(prefix, n, grid_sums(payload).numpy().tobytes(), raw[n // GRID_ROW_BYTES * GRID_ROW_BYTES:],
                     suffix, algorithm or GRID_ALGORITHM)


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("algorithm", ["grid32+xxh3_64", "grid32+crc32"])
@pytest.mark.parametrize("n", [0, 5, 4096, 4098, 3 * 4096 + 6, (1 << 20) + 2, 5 * (1 << 20) - 1])
def test_grid_checksum_streamed_in_any_pieces_equals_the_one_from_its_parts(n, algorithm):
    """The verifier's numpy form, fed item bytes in arbitrary pieces, agrees with the torch form
    the stager computes (sums wrap modulo 2**32; the data has words of both signs); folded with
    xxh3, or with CRC-32 where the xxhash package is missing."""
    import random

    from safe_ckpt.integrity import GridHasher

    rng = random.Random(n)
    payload = _random_bytes(n, n)
    prefix, suffix = bytes(rng.randrange(256) for _ in range(rng.randrange(300))), b"PK\x05\x06" * rng.randrange(5)
    want = _grid_checksum(prefix, payload, suffix, algorithm)
    item = prefix + payload.numpy().tobytes() + suffix
    for _ in range(4):
        hasher, pos = GridHasher(algorithm, len(prefix), n), 0
        while pos < len(item):
            step = rng.choice([1, 3, 4095, 4096, 4097, 65536, 1 << 20])
            hasher.update(memoryview(item)[pos:pos + step])
            pos += step
        assert hasher.value() == want


def test_grid_checksum_changes_with_small_changes_and_reordered_pages():
    payload = _random_bytes(64 * 4096 + 10, 7)
    base = _grid_checksum(b"pre", payload, b"suf")
    def add(w, at, delta):
        w[at] += delta

    changes = {
        "one byte": lambda p, w: p.__setitem__(12345, p[12345] ^ 1),
        "the sign bit of a word": lambda p, w: w.__setitem__((0, 0), w[0, 0] ^ -2**31),
        "two words, one row, cancelling": lambda p, w: (add(w, (3, 5), 9), add(w, (3, 6), -9)),
        "two words, one column, cancelling": lambda p, w: (add(w, (3, 5), 9), add(w, (8, 5), -9)),
        "three words, cancelling": lambda p, w: (add(w, (1, 1), 4), add(w, (1, 2), -4), add(w, (2, 1), -4)),
        "two pages swapped": lambda p, w: w.__setitem__([4, 9], w[[9, 4]].clone()),
        "two words swapped in a row": lambda p, w: w.__setitem__((5, [1, 2]), w[5, [2, 1]].clone()),
        "two columns swapped": lambda p, w: w.__setitem__((slice(None), [0, 1]), w[:, [1, 0]].clone()),
        "tail byte": lambda p, w: p.__setitem__(len(p) - 1, p[-1] ^ 0x80),
    }
    for name, change in changes.items():
        changed = payload.clone()
        change(changed, changed[:64 * 4096].view(torch.int32).view(64, 1024))
        assert not torch.equal(changed, payload), name
        assert _grid_checksum(b"pre", changed, b"suf") != base, name
    assert _grid_checksum(b"prf", payload, b"suf") != base and _grid_checksum(b"pre", payload, b"sug") != base


def test_device_sums_deferred_while_writers_wait_are_all_issued_and_verify(tmp_path):
    """Sources reported as device memory: the writers wait for the last "copy", so each
    chunk's sums are deferred and issued when the writers start (a 64 MiB pool), or when the
    pool runs out first (4 MiB: only writing frees it, and a writer needs an item's sums to
    finish it, so a missed flush would hang this save; the chunks staged after that get their
    sums at once). Every item verifies."""
    from safe_ckpt.integrity import Manifest
    from safe_ckpt.names import MANIFEST_FILE
    from tests.helpers.bodies import common as cases
    from tests.helpers.mp import run_world, values

    for budget in (64 << 20, 4 << 20):
        ckpt = str(tmp_path / f"ck{budget}")
        out = values(run_world(2, cases.gridded_roundtrip, (1, 1, ckpt, GRID_SPEC, {
            "chunk_bytes": 3 << 19, "staging_budget_bytes": budget, "collective_timeout_s": 120}, True)))
        assert all(r["mismatches"] == [] for r in out), [r["mismatches"][:3] for r in out]
        assert sum(r["deferred_sums"] for r in out) > 0, [r["deferred_sums"] for r in out]
        manifest = Manifest.parse(open(os.path.join(ckpt, MANIFEST_FILE), "rb").read())
        grid = [i for i in manifest.items if i.algorithm.startswith("grid32+")]
        deferred = sum(r["deferred_sums"] for r in out)
        if budget == 64 << 20:  # room for everything: every sum waits for the writers
            assert len(grid) == deferred, (len(grid), deferred)
        else:  # the pool ran out first: the writers started there, and the later sums went with their copies
            assert 0 < deferred < len(grid), (len(grid), deferred)
        report = verify(ckpt, deep=True)
        assert report.ok and report.checksummed_items == report.items_checked, report.findings


def test_device_checksums_are_stored_verified_and_catch_corruption(tmp_path):
    """Grid-checksummed items (large aligned chunks; the host stager stands in for the device)
    load back through stock Megatron and DCP; verify recomputes them from the files on the host
    and names the item whose prefix, rows or tail was changed; hostile rows are reported."""
    from safe_ckpt.integrity import Manifest
    from safe_ckpt.names import MANIFEST_FILE
    from tests.helpers.bodies import common as cases
    from tests.helpers.mp import run_world, values

    ckpt = str(tmp_path / "ck")
    out = values(run_world(2, cases.gridded_roundtrip, (1, 1, ckpt, GRID_SPEC,
                                                        {"chunk_bytes": 3 << 19, "staging_budget_bytes": 64 << 20})))
    assert all(r["mismatches"] == [] for r in out), [r["mismatches"][:3] for r in out]
    manifest = Manifest.parse(open(os.path.join(ckpt, MANIFEST_FILE), "rb").read())
    grid = [i for i in manifest.items if i.algorithm.startswith("grid32+")]
    # Rows of 517 bf16 words start at 2 mod 4 bytes every other row: those chunks, and small
    # ones, are hashed on the host; the others on the "device".
    assert grid and len(grid) < len(manifest.items), (len(grid), len(manifest.items))
    report = verify(ckpt, deep=True)
    assert report.ok and report.checksummed_items == report.items_checked, report.findings

    item = next(i for i in grid if i.payload_length_bytes % 4096)
    spots = {"prefix": 3, "rows": item.payload_offset_bytes + 3 * 4096 + 5,
             "tail": item.payload_offset_bytes + item.payload_length_bytes - 1}
    for name, at in spots.items():
        copy = str(tmp_path / name)
        shutil.copytree(ckpt, copy)
        with open(os.path.join(copy, item.relative_path), "r+b") as f:
            f.seek(item.offset_bytes + at)
            byte = f.read(1)
            f.seek(item.offset_bytes + at)
            f.write(bytes([byte[0] ^ 0x10]))
        errors = _errors(verify(copy))
        assert [e.path for e in errors] == [f"{item.relative_path}@{item.offset_bytes}"], (name, errors)
        assert "checksum mismatch" in errors[0].message, (name, errors)

    doc = json.load(open(os.path.join(ckpt, MANIFEST_FILE)))
    rows = doc["items"][item.relative_path]
    row = next(r for r in rows if r[0] == item.offset_bytes)
    row[4]["payload"] = [item.payload_offset_bytes, item.length_bytes]  # past the item's end
    json.dump(doc, open(os.path.join(ckpt, MANIFEST_FILE), "w"))
    errors = _errors(verify(ckpt))
    assert len(errors) == 1 and "does not lie inside" in errors[0].message, errors
    row[4]["payload"] = [0, 2**65]  # a span no 8-byte length can hold
    row[1] = 2**70
    json.dump(doc, open(os.path.join(ckpt, MANIFEST_FILE), "w"))
    errors = _errors(verify(ckpt))
    assert errors and "unreadable manifest" in errors[0].message, errors
    row[1], row[4]["payload"] = item.length_bytes + 1, [0, 8]  # the manifest disagrees with the index
    json.dump(doc, open(os.path.join(ckpt, MANIFEST_FILE), "w"))
    errors = _errors(verify(ckpt))
    assert len(errors) == 1 and f"manifest says {item.length_bytes + 1} bytes" in errors[0].message, errors
    row[1] = item.length_bytes
    hostile = {"sixth field": lambda r: r.append("sixth"), "a list for the fifth": lambda r: r.__setitem__(4, [1]),
               "no algorithm": lambda r: r[4].pop("algorithm"), "a float span": lambda r: r[4].__setitem__(
                   "payload", [0.5, 8]), "a negative offset": lambda r: r.__setitem__(0, -1)}
    for name, spoil in hostile.items():
        bad = json.loads(json.dumps(doc))
        spoil(next(r for r in bad["items"][item.relative_path] if r[0] == item.offset_bytes))
        json.dump(bad, open(os.path.join(ckpt, MANIFEST_FILE), "w"))
        errors = _errors(verify(ckpt))
        assert len(errors) == 1 and "unreadable manifest" in errors[0].message, (name, errors)
        assert repr(item.relative_path) in errors[0].message, (name, errors)
    doc["version"] = 3
    json.dump(doc, open(os.path.join(ckpt, MANIFEST_FILE), "w"))
    errors = _errors(verify(ckpt))
    assert len(errors) == 1 and "a newer safe_ckpt wrote it" in errors[0].message, errors


def test_device_checksums_off_or_checksums_off_record_no_grid_rows(tmp_path):
    from safe_ckpt.integrity import Manifest
    from safe_ckpt.names import MANIFEST_FILE
    from tests.helpers.bodies import common as cases
    from tests.helpers.mp import run_world, values

    for name, kw in {"off": {"device_checksums": False}, "nosum": {"checksums": False}}.items():
        ckpt = str(tmp_path / name)
        out = values(run_world(1, cases.gridded_roundtrip, (1, 1, ckpt, GRID_SPEC, {"chunk_bytes": 3 << 19,
                                                                                     "staging_budget_bytes": 64 << 20, **kw})))
        assert out[0]["mismatches"] == []
        path = os.path.join(ckpt, MANIFEST_FILE)
        if name == "nosum":
            assert not os.path.exists(path)
        else:
            assert not [i for i in Manifest.parse(open(path, "rb").read()).items if i.algorithm]
            assert verify(ckpt, deep=True).ok
