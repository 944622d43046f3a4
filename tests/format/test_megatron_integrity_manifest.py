"""Megatron's `integrity.json` (`--verify-integrity`, megatron-core >= 0.18), written from the bytes as
they are written: byte for byte what Megatron's own save writes, on every write path, and accepted by
stock `load(..., verify_integrity=True)` (refused after one flipped byte) where the installed
megatron-core has it. On older megatron-core the manifest is compared with SHA-256 over the files;
`COMPAT_TESTS=tests/format/test_megatron_integrity_manifest.py scripts/compat.sh 3.12:2.13.0:0.19.2` runs the stock half."""

import json

import pytest

from safe_ckpt import SaveOptions, compat
from tests.helpers.bodies import megatron as megatron_cases
from tests.helpers.mp import run_world, values

STOCK = compat.stock_integrity_manifest()


def _check_manifest(r0):
    assert r0["written"] == r0["expected"], (r0["written"][:400], r0["expected"][:400])
    listed = set(json.loads(r0["written"])["files"])
    assert listed == set(r0["files"]) - {"integrity.json"}  # every file but itself, the safe_ckpt manifest too
    if r0.get("stock") is not None:
        assert r0["written"] == r0["stock"]


def test_integrity_json_is_megatrons_on_every_write_path(tmp_path):
    results = values(run_world(2, megatron_cases.integrity_saves, (str(tmp_path),)))
    assert set(results[0]) == set(megatron_cases.integrity_modes())
    for mode in results[0]:
        out = [r[mode] for r in results]
        _check_manifest(out[0])
        assert "integrity.json" in out[0]["files"] and any(n.endswith(".distcp") for n in out[0]["files"])
        if not STOCK:
            continue
        for r in out:
            assert r["load"] == {"mismatches": []}, (mode, r["load"])
            err = r["load_after_flip"].get("error")
            assert err is not None and "CheckpointingException" in err["mro"], (mode, r["load_after_flip"])
            assert out[0]["flipped"] in err["message"] and "hash mismatch" in err["message"]


def test_the_strategy_covers_what_megatrons_save_writes_around_it(tmp_path):
    out = values(run_world(2, megatron_cases.integrity_strategy, (str(tmp_path),)))
    _check_manifest(out[0])
    assert {"metadata.json", ".metadata"} <= set(json.loads(out[0]["written"])["files"])


def test_megatron_verify_integrity_flag_writes_it(tmp_path):
    out = values(run_world(2, megatron_cases.integrity_training, (str(tmp_path),)))
    assert "integrity.json" in out[0][7]["files"] and "integrity.json" not in out[0][8]["files"]
    _check_manifest(out[0][7])


def test_bytes_out_of_file_order_fail_the_save_instead_of_a_wrong_manifest():
    from safe_ckpt.encoding.integrity_manifest import FileDigests
    from safe_ckpt.errors import CheckpointError

    digests = FileDigests({"a": 8})
    digests.update("a", 0, [b"abcd"])
    with pytest.raises(CheckpointError, match="offset 6"):
        digests.update("a", 6, [b"gh"])
    with pytest.raises(CheckpointError, match="hashed short"):
        digests.digests()


def test_the_option_defaults_off():
    assert SaveOptions().integrity_manifest is False


class _FileHandle:
    def __init__(self, size):
        self.data = bytearray(size)

    def write_at(self, offset, buffers):
        for buf in buffers:
            view = memoryview(buf).cast("B")
            self.data[offset:offset + len(view)] = view
            offset += len(view)


@pytest.mark.parametrize("hasher", [False, True], ids=["in-writer", "checksum-threads"])
def test_device_summed_items_are_hashed_for_the_manifest_in_file_order(hasher):
    """The GPU path (a payload summed on the device, written unhashed) on the host: its bytes
    still feed the file's SHA-256, items one after another as the writers write them."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from safe_ckpt.encoding.integrity_manifest import FileDigests
    from safe_ckpt.encoding.layout import PlacedItem
    from safe_ckpt.write.item_writes import ItemWrites

    rng = np.random.default_rng(7)
    parts = [(rng.bytes(64), rng.bytes(3 << 20), rng.bytes(22)) for _ in range(3)]
    size = sum(len(p) + len(x) + len(s) for p, x, s in parts)
    handle, digests = _FileHandle(size), FileDigests({"__0_0.distcp": size})
    writes = ItemWrites(checksums=True, digests=digests)
    pool = ThreadPoolExecutor(2) if hasher else None
    writes.hasher = pool
    offset = 0
    for k, (prefix, payload, suffix) in enumerate(parts):
        item = PlacedItem(f"t{k}", "__0_0.distcp", offset, len(prefix) + len(payload) + len(suffix))
        sums = memoryview(np.zeros(len(payload) // 4096 + 1024, dtype=np.uint32)).cast("B")
        writes.write_gridded(handle, item, prefix, memoryview(payload), sums, suffix)
        offset += item.length_bytes
    if pool is not None:
        pool.shutdown()
    assert digests.digests() == {"__0_0.distcp": hashlib.sha256(bytes(handle.data)).hexdigest()}
