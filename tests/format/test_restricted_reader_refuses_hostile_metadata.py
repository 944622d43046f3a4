"""Hostile `.metadata` files against the restricted reader: BUILD on an admitted class, a huge memo
index, copy amplification, deep and doubling tuples, malformed chunks and storage entries, and an
oversized file. Each is one refusal naming the file; nothing in the reading process changes. The
ones that crash, hang or rewrite classes under a plain unpickler run in a fresh interpreter."""

import os
import pickle
import struct
import subprocess
import sys

import pytest

from safe_ckpt.encoding import safe_read as safe_load
from tests.tools.test_tools_never_run_checkpoint_code import _cli, _save
from tests.helpers.paths import REPO as ROOT

DCP = b"torch.distributed.checkpoint.metadata"


def _global(module: bytes, name: bytes) -> bytes:
    return b"c" + module + b"\n" + name + b"\n"


def _unicode(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _metadata_with_sdm_key(key_ops: bytes) -> bytes:
    """Metadata(state_dict_metadata={<key>: None}), the key built by ``key_ops``."""
    return b"\x80\x02" + _global(DCP, b"Metadata") + b"}" + key_ops + b"Ns\x85R."


def _fresh(code: str, timeout=120):
    """``code`` in a fresh interpreter with ``read`` = read_metadata printing its refusal."""
    prelude = ("import os, resource, sys\n"
               "from safe_ckpt.encoding import safe_read as safe_load\n"
               "def read(d):\n"
               "    try:\n"
               "        safe_load.read_metadata(d); print('READ')\n"
               "    except safe_load.UnreadableCheckpointError as e:\n"
               "        print('ERROR', e)\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, env=env,
                          timeout=timeout)


def _write(directory, data: bytes) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        f.write(data)
    return str(directory)


def test_build_on_an_admitted_class_is_refused_and_changes_nothing(tmp_path):
    """BUILD with state (None, {name: value}) would setattr on the class object find_class returned."""
    def set_on_class(module, name, attr, value_module, value_name):
        return (_global(module, name) + b"N}" + _unicode(attr) + _global(value_module, value_name)
                + b"s\x86b0")

    data = (b"\x80\x02" + set_on_class(b"pathlib", b"PosixPath", "__truediv__", b"builtins", b"set")
            + set_on_class(DCP, b"MetadataIndex", "__init__", b"builtins", b"frozenset")
            + _global(DCP, b"Metadata") + b"}\x85R.")
    assert len(data) < 250
    directory = _write(tmp_path / "ck", data)
    out = _fresh(f"read({directory!r})\n"
                 "import pathlib\n"
                 "from torch.distributed.checkpoint.metadata import MetadataIndex\n"
                 "print('truediv', pathlib.PosixPath.__truediv__ is set)\n"
                 "print('init', MetadataIndex.__init__ is frozenset)\n")
    assert out.returncode == 0, out.stderr
    assert "ERROR" in out.stdout and "refused: it sets attributes of the class pathlib" in out.stdout, out.stdout
    assert ".metadata" in out.stdout
    assert "truediv False" in out.stdout and "init False" in out.stdout, out.stdout


@pytest.mark.parametrize("state", ["non_record", "private_key", "slot_class"])
def test_build_outside_the_dcp_records_fields_is_refused(tmp_path, state):
    record = _global(DCP, b"MetadataIndex") + b")\x81"  # MetadataIndex.__new__(MetadataIndex)
    ops = {"non_record": _global(b"collections", b"OrderedDict") + b")R}" + _unicode("x") + b"K\x01sb",
           "private_key": record + b"}" + _unicode("__class__") + _global(b"builtins", b"set") + b"sb",
           "slot_class": record + b"N}" + _unicode("__class__") + _global(b"builtins", b"set") + b"s\x86b"}[state]
    directory = _write(tmp_path / "ck", b"\x80\x02" + ops + b".")
    with pytest.raises(safe_load.UnreadableCheckpointError, match="refused: it sets") as err:
        safe_load.read_metadata(directory)
    assert err.value.path.endswith(".metadata")


@pytest.mark.parametrize("index", [0x04000000, 0x7FFFFFF0])
def test_a_huge_memo_index_costs_no_memory(tmp_path, index):
    directory = _write(tmp_path / "ck", b"\x80\x02Nr" + struct.pack("<I", index) + b".")
    out = _fresh("before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
                 f"read({directory!r})\n"
                 "print('grew_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n")
    assert out.returncode == 0, out.stderr
    assert "ERROR" in out.stdout and "holds a NoneType, not a DCP Metadata" in out.stdout, out.stdout
    grew_kib = int(out.stdout.split("grew_kib")[1])
    assert grew_kib < 64 * 1024, out.stdout


@pytest.mark.parametrize("depth", [3000, 300000])
def test_a_deeply_nested_tuple_key_is_one_refusal(tmp_path, depth):
    """Hashing a tuple recurses in C without a check: deep enough, a plain unpickler crashes."""
    directory = _write(tmp_path / "ck", _metadata_with_sdm_key(b")" + b"\x85" * depth))
    out = _fresh(f"read({directory!r})\n")
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.startswith("ERROR") and ".metadata" in out.stdout and "refused" in out.stdout, out.stdout
    assert len(out.stdout) < 500, out.stdout


def test_a_doubling_tuple_key_is_refused_at_once(tmp_path):
    """((t, t), (t, t)) ... sixty times: a few hundred bytes whose hash walks 2**60 leaves."""
    ops = b")q\x00"
    for i in range(60):
        ops += b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86q" + bytes([i + 1])
    directory = _write(tmp_path / "ck", _metadata_with_sdm_key(ops))
    out = _fresh(f"read({directory!r})\n", timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ERROR" in out.stdout and "refused: it holds a tuple" in out.stdout, out.stdout


def test_calls_copying_one_shared_list_over_and_over_are_refused(tmp_path):
    items = b"(" + b"K\x01" * 10000 + b"l" + b"q\x00"  # a list of 10000 ones, memo 0
    copies = (_global(b"builtins", b"frozenset") + b"h\x00\x85R") * 2000
    directory = _write(tmp_path / "ck", b"\x80\x02" + items + b"0(" + copies + b"l.")
    with pytest.raises(safe_load.UnreadableCheckpointError, match="refused: building it copies or hashes more"):
        safe_load.read_metadata(directory)


def test_hashing_one_wide_key_over_and_over_is_refused(tmp_path):
    wide = b"(" + b"K\x01" * 4000 + b"tq\x00"  # a tuple of 4000 ones, memo 0
    sets = b"}" + b"h\x00K\x01s" * 2000  # the same key set 2000 times: 8 million elements hashed
    directory = _write(tmp_path / "ck", b"\x80\x02" + wide + b"0" + sets + b".")
    with pytest.raises(safe_load.UnreadableCheckpointError, match="refused: building it copies or hashes more"):
        safe_load.read_metadata(directory)


def test_a_doubling_chain_of_records_is_refused_at_once(tmp_path):
    """MetadataIndex hashes its fields: fqn=(previous, previous) sixty times walks 2**60 records."""
    record = _global(DCP, b"MetadataIndex") + b")\x81}" + _unicode("fqn")
    ops = record + _unicode("a") + b"sbq\x00"
    for i in range(60):
        ops += b"0" + record + b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86sbq" + bytes([i + 1])
    directory = _write(tmp_path / "ck", _metadata_with_sdm_key(ops))
    out = _fresh(f"read({directory!r})\n", timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ERROR" in out.stdout and "refused: it holds a tuple or record" in out.stdout, out.stdout


@pytest.fixture
def ckpt(tmp_path):
    return _save(str(tmp_path / "ck"))


def _rewrite(ckpt, change):
    meta = safe_load.read_metadata(ckpt)
    change(meta)
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(meta, f)


def _chunk(meta):
    return meta.state_dict_metadata["w"].chunks[0]


def _storage(meta):
    return next(info for index, info in meta.storage_data.items() if index.fqn == "w")


@pytest.mark.parametrize("damage, expected", [
    (lambda m: setattr(m.state_dict_metadata["w"], "chunks", [1]), "entry 'w' chunk 0 is a int"),
    (lambda m: setattr(_chunk(m), "offsets", (-1, 0)), "entry 'w' chunk 0 is offsets (-1, 0)"),
    (lambda m: setattr(_chunk(m), "sizes", (60,)), "entry 'w' chunk 0 is offsets"),
    (lambda m: setattr(_chunk(m), "sizes", (60, "40")), "entry 'w' chunk 0 is offsets"),
    (lambda m: setattr(m.state_dict_metadata["w"], "size", (60, -40)), "entry 'w' has the size (60, -40)"),
    (lambda m: setattr(_storage(m), "offset", -8), "storage entry 'w' -> "),
    (lambda m: setattr(_storage(m), "length", -1), "storage entry 'w' -> "),
    (lambda m: setattr(_storage(m), "length", True), "storage entry 'w' -> "),
    (lambda m: m.state_dict_metadata.update({"x" * 5000: 1}), "malformed: entry 'xxxx"),
])
def test_malformed_chunks_and_storage_entries_are_one_line_refusals(ckpt, damage, expected):
    _rewrite(ckpt, damage)
    with pytest.raises(safe_load.UnreadableCheckpointError, match="malformed") as err:
        safe_load.read_metadata(ckpt)
    assert expected in str(err.value) and len(str(err.value)) < 600, str(err.value)
    for command in ("verify", "inspect"):
        out = _cli(command, ckpt)
        text = out.stdout + out.stderr
        assert out.returncode == 1 and ".metadata" in text and "Traceback" not in text, (command, text)
        assert expected in text, text


def test_an_oversized_metadata_is_refused_unread(ckpt, monkeypatch):
    size = os.path.getsize(os.path.join(ckpt, ".metadata"))
    monkeypatch.setattr(safe_load, "MAX_METADATA_BYTES", size - 1)
    with pytest.raises(safe_load.UnreadableCheckpointError, match=f"refused: {size} bytes, more than") as err:
        safe_load.read_metadata(ckpt)
    assert err.value.path == os.path.join(ckpt, ".metadata")
    out = _cli("verify", ckpt)
    assert out.returncode == 1 and ".metadata: refused" in out.stdout + out.stderr, out
    monkeypatch.setattr(safe_load, "MAX_METADATA_BYTES", size)
    assert safe_load.read_metadata(ckpt).state_dict_metadata
