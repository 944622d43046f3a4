"""The restricted `.metadata` reader is bounded: every opcode that copies or hashes is charged to one
budget sized from the file, so a crafted file is refused (an `UnreadableCheckpointError` naming it)
within seconds and a bounded amount of memory, whatever opcodes it uses; and real indexes (this
library's, stock Megatron's, stock DCP's, large ones) still read, as plain pickle reads them.

The two reported attacks run through the CLI's entry point in a fresh interpreter that measures its
own peak memory and CPU time; the others in this process under a CPU-time bound; a seeded fuzzer over
pickle opcodes runs in a fresh interpreter (a crash of the interpreter counts as a failure)."""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import time

import pytest

from safe_ckpt.encoding import safe_read as safe_load
from tests.helpers import large_metadata
from tests.helpers.mp import run_world, values
from tests.tools.test_tools_never_run_checkpoint_code import _save
from tests.helpers.paths import REPO as ROOT

DCP = b"torch.distributed.checkpoint.metadata"
_P = 2 ** 61 - 1  # ints this far apart share a hash
_BUDGET_PER_BYTE = 8  # safe_read.budget.BUDGET_PER_BYTE: real indexes must stay well inside it


def _global(module: bytes, name: bytes) -> bytes:
    return b"c" + module + b"\n" + name + b"\n"


def _put(i: int) -> bytes:
    return b"r" + struct.pack("<I", i)


def _get(i: int) -> bytes:
    return b"j" + struct.pack("<I", i)


def _ints(n: int) -> bytes:
    """A list of n ints (pushed one opcode each: 2 bytes an element)."""
    return b"(" + b"J" + struct.pack("<i", 1000) + b"K\x01" * (n - 1) + b"l"


def _metadata(index_ops: bytes) -> bytes:
    """Metadata(<value built by index_ops>)."""
    return b"\x80\x02" + _global(DCP, b"Metadata") + index_ops + b"\x85R."


def _write(directory, data: bytes) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        f.write(data)
    with open(os.path.join(directory, "metadata.json"), "w") as f:
        f.write('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    return str(directory)


_MEASURED_CLI = """
import resource, sys, time
from safe_ckpt import cli
from safe_ckpt.tools import verify, inspect  # noqa: F401  (their imports before the baseline)
import torch.distributed.checkpoint.metadata  # noqa: F401
before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.process_time()
rc = cli.main(sys.argv[1:])
print("MEASURED", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kib, time.process_time() - t0)
sys.exit(rc)
"""


def _cli_measured(*argv, timeout_s: float = 240):
    """`safe_ckpt.cli:main` in a fresh interpreter: (result, peak memory growth MiB, CPU seconds)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        out = subprocess.run([sys.executable, "-c", _MEASURED_CLI, *argv], capture_output=True, text=True, env=env,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{argv} still running after {timeout_s} s: the reader is not bounded")
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("MEASURED")), None)
    assert line is not None, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    _, grew_kib, cpu_s = line.split()
    return out, int(grew_kib) / 1024, float(cpu_s)


def test_copies_of_a_big_size_by_obj_are_refused_within_bounded_memory(tmp_path):
    """300 OBJ opcodes each instantiating torch.Size over one shared list of 10**6 ints: 7 bytes a
    copy of 8 MB (uncharged before: 2.3 GiB peak from a 1.9 MiB file)."""
    copies = b"(" + (b"(" + _get(1) + _get(0) + b"o") * 300 + b"l"
    data = (b"\x80\x02" + _ints(10 ** 6) + _put(0) + b"0" + _global(b"torch", b"Size") + _put(1) + b"0" + copies
            + b".")
    assert len(data) < 2 << 20
    directory = _write(tmp_path / "ck", data)
    out, grew_mib, cpu_s = _cli_measured("verify", directory)
    assert grew_mib < 300, f"peak memory grew {grew_mib:.0f} MiB reading a {len(data)}-byte file"
    assert cpu_s < 30, cpu_s
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert ".metadata" in out.stdout and "refused: building it copies or hashes more elements" in out.stdout, out.stdout
    assert "Traceback" not in out.stderr


def test_a_big_size_used_as_a_key_again_and_again_is_refused_at_once(tmp_path):
    """One torch.Size of 10**6 elements set as a dict key 10**5 times: each insert hashes all of it
    (10**11 element hashes, hours, before)."""
    key = _global(b"torch", b"Size") + _ints(10 ** 6) + b"\x85R" + _put(0) + b"0"
    data = _metadata(b"}" + key + b"(" + (_get(0) + b"N") * 100_000 + b"u")
    directory = _write(tmp_path / "ck", data)
    out, grew_mib, cpu_s = _cli_measured("inspect", directory, timeout_s=120)
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert ".metadata" in out.stderr + out.stdout and "exceeded at a dict key" in out.stderr + out.stdout, out
    assert cpu_s < 30 and grew_mib < 300, (cpu_s, grew_mib)


def _records_sharing_one_state(n_fields: int, n_records: int) -> bytes:
    state = b"}(" + b"".join(b"X" + struct.pack("<I", len(f"f{i}")) + f"f{i}".encode() + b"N"
                             for i in range(n_fields)) + b"u" + _put(0)
    record = _global(DCP, b"ChunkStorageMetadata") + _put(1) + b"0"
    return b"\x80\x02" + state + b"0" + record + b"(" + (_get(1) + b")\x81" + _get(0) + b"b") * n_records + b"l."


def _colliding_ints(n: int, then: bytes = b"") -> bytes:
    """n LONG1 ints, all with one hash, each followed by ``then``."""
    out = []
    for i in range(1, n + 1):
        raw = (i * _P).to_bytes((i * _P).bit_length() // 8 + 2, "little", signed=True)
        out.append(b"\x8a" + bytes([len(raw)]) + raw + then)
    return b"".join(out)


AMPLIFIERS = {
    # dict keys whose hashes collide: each insert compares against every earlier one
    "colliding_int_keys": lambda: _metadata(b"}(" + _colliding_ints(120_000, then=b"N") + b"u"),
    # the same, as set elements built by a call of set()
    "colliding_set_elements": lambda: b"\x80\x02" + _global(b"builtins", b"set") + b"(" + _colliding_ints(120_000)
    + b"l\x85R.",
    # BUILD of one shared state dict of 10**5 fields into 10**5 records
    "shared_build_state": lambda: _records_sharing_one_state(100_000, 100_000),
    # text PUT at indices that share a hash: the memo itself fills quadratically
    "colliding_memo_indices": lambda: b"\x80\x02N" + b"".join(b"p" + str(i * _P).encode() + b"\n"
                                                               for i in range(1, 90_000)) + b".",
    # frozenset over one shared list, over and over
    "frozenset_copies": lambda: b"\x80\x02" + _ints(10 ** 6) + _put(0) + b"0(" + (
        _global(b"builtins", b"frozenset") + _get(0) + b"\x85R") * 300 + b"l.",
    # a Path of a long string, over and over (each one splits the string into parts)
    "path_copies": lambda: b"\x80\x02X" + struct.pack("<I", 10 ** 6) + b"a/" * (5 * 10 ** 5) + _put(0) + b"0("
    + (_global(b"pathlib", b"PurePosixPath") + _get(0) + b"\x85R") * 10_000 + b"l.",
    # OrderedDict over pairs whose key is one big tuple
    "ordereddict_pairs": lambda: b"\x80\x02(" + b"K\x01" * 500_000 + b"t" + _put(0) + b"0(" + (
        _global(b"collections", b"OrderedDict") + b"(" + (_get(0) + b"N\x86") * 1000 + b"l\x85R") * 20 + b"l.",
    # a call whose arguments are one long string unpacked into a tuple of characters
    "star_args_of_a_string": lambda: b"\x80\x02X" + struct.pack("<I", 10 ** 6) + b"a" * 10 ** 6 + _put(0) + b"0("
    + (_global(b"torch", b"Size") + _get(0) + b"R") * 10_000 + b"l.",
    # the index check after unpickling: 10**4 tensors sharing one list of 40000 chunks
    "shared_chunk_list": lambda: _shared_chunks(),
    # an int written in a million digits (quadratic to parse where Python's digit limit is lifted)
    "huge_text_int": lambda: b"I" + b"9" * 10 ** 6 + b"\n.",
}


def _shared_chunks() -> bytes:
    import torch
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                       TensorStorageMetadata)

    chunks = [ChunkStorageMetadata(torch.Size([i]), torch.Size([1])) for i in range(40_000)]
    shared = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([40_000]), chunks)
    return pickle.dumps(Metadata({f"t{i}": shared for i in range(10_000)}, storage_data={}))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(AMPLIFIERS))
def test_every_amplifying_opcode_is_charged(case):
    data = AMPLIFIERS[case]()
    assert len(data) < 3 << 20
    t0 = time.process_time()
    with pytest.raises(safe_load.UnreadableCheckpointError, match="refused") as err:
        safe_load.metadata_from_bytes(data, "/ck/.metadata")
    cpu_s = time.process_time() - t0
    assert err.value.path == "/ck/.metadata"
    assert cpu_s < 15, f"{case}: refused only after {cpu_s:.1f} s of CPU"


def _seed_files(tmp_path) -> list[str]:
    """Real indexes to mutate: this library's and stock DCP's."""
    import torch
    import torch.distributed.checkpoint as dcp

    ours = _save(str(tmp_path / "ours"))
    stock = str(tmp_path / "stock")
    g = torch.Generator().manual_seed(4)
    dcp.save({"a": torch.randn(3, 4, generator=g), "h": torch.randn(2, generator=g).half(), "obj": {"x": 1},
              "cl": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last)},
             checkpoint_id=stock, no_dist=True)
    return [os.path.join(ours, ".metadata"), os.path.join(stock, ".metadata")]


def _fuzz(tmp_path, seed: int, count: int, max_bytes: int, budget_base: int, timeout_s: float) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, "-m", "tests.helpers.pickle_fuzz", str(seed), str(count), str(max_bytes), str(budget_base),
            *_seed_files(tmp_path)]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        last = (exc.stdout or b"").decode(errors="replace").splitlines()[-1:] if exc.stdout else []
        pytest.fail(f"the fuzzer did not finish within {timeout_s} s; last input: {last}")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0 and rows and "peak_rss_growth_mib" in rows[-1], \
        f"the interpreter died (rc {out.returncode}) after input {rows[-1] if rows else None}: {out.stderr[-3000:]}"
    return rows


def _check_fuzz(rows: list[dict], peak_mib: float) -> None:
    summary, rows = rows[-1], rows[:-1]
    crashes = [r for r in rows if r["outcome"].startswith("crash")]
    assert not crashes, f"{len(crashes)} inputs escaped with another error type, e.g. {crashes[0]}"
    # the CPU time of each input is linear in its budget and size: nothing runs past what is charged
    slow = [r for r in rows if r["cpu_s"] > 0.2 + 300e-9 * r["budget"] + 20e-6 * r["bytes"]]
    assert not slow, f"{len(slow)} inputs took longer than their budget allows, e.g. {slow[0]}"
    assert all(r["units"] <= r["budget"] or r["outcome"] == "refused" for r in rows)
    assert summary["peak_rss_growth_mib"] < peak_mib, summary
    outcomes = {r["outcome"] for r in rows}
    assert outcomes >= {"read", "refused"}, outcomes  # the mutations keep some files readable


def test_fuzzed_pickles_are_read_or_refused_within_the_budget(tmp_path):
    """A few thousand generated and mutated pickles, with a smaller fixed part of the budget so that
    the ones that spend all of it stay quick (what is checked is that the work follows the charge)."""
    t0 = time.monotonic()
    rows = _fuzz(tmp_path, seed=20261207, count=2500, max_bytes=8192, budget_base=1 << 18, timeout_s=300)
    _check_fuzz(rows, peak_mib=200)
    assert len(rows) == 2501
    print(f"fuzzed 2500 inputs in {time.monotonic() - t0:.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fuzzed_pickles_at_full_budget_and_size(tmp_path, seed):
    from safe_ckpt.encoding.safe_read import budget as metadata_budget

    rows = _fuzz(tmp_path, seed=seed, count=20000, max_bytes=1 << 18, budget_base=metadata_budget.BUDGET_BASE,
                 timeout_s=3000)
    _check_fuzz(rows, peak_mib=600)


def _read_like_pickle(path: str) -> float:
    """Read ``path`` with the restricted reader, compare with plain pickle; units used per byte."""
    from safe_ckpt.encoding.safe_read import budget as metadata_budget, unpickler as metadata_unpickler

    with open(path, "rb") as f:
        data = f.read()
    budget = metadata_budget.WorkBudget(path, len(data))
    meta = metadata_unpickler.MetadataUnpickler(data, path, budget).load()
    safe_load._check_shape(meta, path, budget)
    plain = pickle.loads(data)
    assert meta.state_dict_metadata == plain.state_dict_metadata and meta.storage_data == plain.storage_data
    assert meta.planner_data == plain.planner_data and vars(meta).keys() == vars(plain).keys()
    assert safe_load.read_metadata(os.path.dirname(path)).storage_data == plain.storage_data
    return budget.used / len(data)


def test_the_qwen3_4b_dp8_index_at_8_ranks_reads_well_within_the_budget(tmp_path):
    """The index this library writes for 8 ranks of 1217 shards (9848 items, 1.5 MB)."""
    directory = tmp_path / "planned"
    directory.mkdir()
    (directory / ".metadata").write_bytes(large_metadata.planned_index(8))
    assert _read_like_pickle(str(directory / ".metadata")) < _BUDGET_PER_BYTE / 4


@pytest.mark.parametrize("writer", ["stock_megatron", "stock_dcp",
                                    pytest.param("safe_ckpt", marks=pytest.mark.slow)])  # default: the planned index
def test_large_indexes_written_at_two_ranks_read_and_verify(tmp_path, writer):
    """1217 shards a rank at 2 gloo ranks, saved by stock Megatron (torch_dist), stock DCP (DTensor
    shards) and this library: read as plain pickle reads them, within a quarter of the budget."""
    path = str(tmp_path / writer)
    values(run_world(2, getattr(large_metadata, f"save_{writer}"), (path, 100_000), timeout_s=600))
    assert _read_like_pickle(os.path.join(path, ".metadata")) < _BUDGET_PER_BYTE / 4
    from tests.tools.test_tools_never_run_checkpoint_code import _cli

    out = _cli("inspect", "--json", path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr
    assert sum(t["chunks"] for t in json.loads(out.stdout)["tensors"].values()) >= 2 * 1200
    if writer != "stock_dcp":  # a DCP checkpoint has no metadata.json: not a torch_dist one to verify
        out = _cli("verify", path)
        assert out.returncode == 0 and "OK:" in out.stdout, out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("writer", ["stock_megatron", "stock_dcp", "safe_ckpt"])
def test_large_indexes_written_at_eight_ranks_read(tmp_path, writer):
    path = str(tmp_path / writer)
    values(run_world(8, getattr(large_metadata, f"save_{writer}"), (path, 100_000), timeout_s=3000))
    assert _read_like_pickle(os.path.join(path, ".metadata")) < _BUDGET_PER_BYTE / 4
