"""One contract for every sink (POSIX, TensorStore `file`, TensorStore `memory`), and saves
through the TensorStore `file` driver loaded by stock Megatron and DCP."""

import os

import pytest

import safe_ckpt
from safe_ckpt.errors import WriteError
from safe_ckpt.sinks.posix import PosixSink

ts = pytest.importorskip("tensorstore")

from safe_ckpt.sinks.tensorstore import TensorStoreSink, open_location  # noqa: E402
from tests.helpers.bodies import common as cases  # noqa: E402
from tests.helpers.mp import run_world, values  # noqa: E402

_memory_ids = iter(range(1_000_000))


def _posix(tmp_path):
    return PosixSink(str(tmp_path), fsync=True)


def _ts_file(tmp_path):
    return TensorStoreSink(open_location("file://" + str(tmp_path)))


def _ts_memory(tmp_path):
    return TensorStoreSink(open_location(f"memory://contract{next(_memory_ids)}"))


SINKS = {"posix": _posix, "tensorstore-file": _ts_file, "tensorstore-memory": _ts_memory}


@pytest.fixture(params=list(SINKS))
def sink(request, tmp_path):
    return SINKS[request.param](tmp_path)


def _payload(n, seed):
    import random

    return bytes(random.Random(seed).getrandbits(8) for _ in range(n))


def test_whole_value_round_trip(sink):
    prefix, payload, suffix = _payload(64, 1), _payload(200_000, 2), _payload(99, 3)
    f = sink.open("__0_0.distcp", len(prefix) + len(payload) + len(suffix))
    f.write_at(0, [prefix, memoryview(payload), suffix])
    f.sync()
    f.close()
    assert sink.read("__0_0.distcp") == prefix + payload + suffix


def test_small_files_list_and_delete(sink):
    sink.write_file(".metadata", b"index")
    sink.write_file("metadata.json", b"{}")
    sink.sync_root()
    assert {".metadata", "metadata.json"} <= set(sink.list())
    sink.delete("metadata.json")
    assert "metadata.json" not in sink.list() and sink.read(".metadata") == b"index"


def test_missing_value_is_an_error(sink):
    with pytest.raises((FileNotFoundError, OSError)):
        sink.read("nothing-here")


def test_positional_writes_where_supported(sink):
    if getattr(sink, "one_item_per_file", False):
        f = sink.open("x", 10)
        f.write_at(0, [b"abcde"])
        with pytest.raises(WriteError, match="written whole"):
            f.write_at(5, [b"fghij"])  # a kvstore value cannot be patched: the layout avoids it
        return
    f = sink.open("x", 10)
    f.write_at(5, [b"fghij"])
    f.write_at(0, [b"abcde"])
    f.sync()
    f.close()
    assert sink.read("x") == b"abcdefghij"


@pytest.mark.parametrize("world", [1, 2])
def test_save_through_tensorstore_file_loads_with_stock_megatron_and_dcp(tmp_path, world):
    url = "file://" + str(tmp_path / "iter_0000007")
    out = values(run_world(world, cases.roundtrip, (world, 1, url)))
    for r in out:
        assert r["mismatches"] == [], r["mismatches"][:5]
    assert any(f.endswith(".distcp") and "-" in f for f in out[0]["files"])


def test_copy_local_to_kvstore_and_back(tmp_path):
    from safe_ckpt.tools.copy import copy
    from safe_ckpt.tools.verify import verify
    from tests.tools.test_verify_inspect_gc_and_retention import _save

    src = str(tmp_path / "src")
    _save(src, seed=4)
    copy(src, "memory://bucket/ck")  # stands for a bucket; same process
    back = str(tmp_path / "back")
    from safe_ckpt.errors import PathUsageError

    with pytest.raises(PathUsageError, match="no such checkpoint"):  # a prefix with no key: a usage error
        copy("memory://bucket/nothing", back)
    copy("memory://bucket/ck", back)
    assert verify(back, deep=True).ok
    assert sorted(os.listdir(back)) == sorted(os.listdir(src))


def test_kvstore_spec_form_and_cli_copy(tmp_path):
    """The spec form (as for gcs / s3, here with the `file` driver) and `safe-ckpt copy` on the command line."""
    import subprocess
    import sys

    import torch
    import torch.distributed.checkpoint as dcp

    from tests.tools.test_verify_inspect_gc_and_retention import _state

    spec = {"driver": "file", "path": str(tmp_path / "bucket") + "/"}
    opts = safe_ckpt.SaveOptions(chunk_bytes=32 * 1024, io_threads=2, progress_interval_s=0, kvstore_spec=spec)
    safe_ckpt.save(_state(9), "ckpts/iter_0000009", options=opts)
    saved = tmp_path / "bucket" / "ckpts" / "iter_0000009"
    assert {".metadata", "metadata.json", "safe_ckpt_manifest.json"} <= set(os.listdir(saved))
    local = str(tmp_path / "local")
    proc = subprocess.run([sys.executable, "-m", "safe_ckpt", "copy", "ckpts/iter_0000009", local,
                           "--src-spec", __import__("json").dumps(spec)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = {"w": torch.empty(300, 100)}
    dcp.load(out, checkpoint_id=local, no_dist=True)
    assert torch.equal(out["w"], _state(9)["w"].data)


@pytest.mark.parametrize("checksum_threads", [None, 0, 1])
def test_kvstore_items_larger_than_a_hash_piece_in_every_checksum_mode(tmp_path, checksum_threads):
    """Hashing in the writers goes piece by piece; a kvstore value must still be one write."""
    import torch
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from safe_ckpt.tools.copy import copy
    from safe_ckpt.tools.verify import verify

    g = torch.Generator().manual_seed(12)
    w = torch.randn(1024, 1536, generator=g)  # 6 MiB: three 2 MiB pieces
    opts = safe_ckpt.SaveOptions(io_threads=2, progress_interval_s=0, checksum_threads=checksum_threads)
    url = f"memory://bucket/big{checksum_threads}"
    safe_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", w)}, url, options=opts)
    local = str(tmp_path / "local")
    copy(url, local)
    assert verify(local, deep=True).ok
    out = {"w": torch.empty_like(w)}
    dcp.load(out, checkpoint_id=local, no_dist=True)
    assert torch.equal(out["w"].view(torch.int32), w.view(torch.int32))
