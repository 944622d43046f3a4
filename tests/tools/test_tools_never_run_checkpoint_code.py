"""verify and inspect never run code from a checkpoint: crafted `.metadata` and common state
are refused with a clear error and a non-zero exit, garbage is an error, legitimate
checkpoints (this library's, stock DCP's, stock Megatron's) still read."""

import contextlib
import io
import os
import pickle
import random
import subprocess
import sys

import pytest
import torch

import safe_ckpt
from safe_ckpt.encoding import safe_read as safe_load

from tests.helpers.paths import REPO as ROOT


def _state(seed=0):
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    g = torch.Generator().manual_seed(seed)
    return {"w": ShardedTensor.from_rank_offsets("w", torch.randn(60, 40, generator=g)),
            "b": ShardedTensor.from_rank_offsets("b", torch.randn(17, generator=g).to(torch.bfloat16)),
            "o": ShardedObject("o", {"seed": seed}, (1,), (0,)), "iteration": seed}


def _save(path, seed=0):
    safe_ckpt.save(_state(seed), path, options=safe_ckpt.SaveOptions(chunk_bytes=4096, io_threads=1,
                                                                       progress_interval_s=0))
    return path


class _Call:
    """Pickles as a call of ``fn(*args)``: what a crafted file runs under plain pickle.load."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payloads(marker):
    return {
        "os.system": _Call(os.system, f"touch {marker}"),
        "builtins.exec": _Call(exec, f"open({marker!r}, 'w').write('ran')"),
        "subprocess.call": _Call(subprocess.call, ["touch", marker]),
    }


def _cli_process(*argv):
    """The command in a fresh interpreter, as a user runs it."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "safe_ckpt", *argv], capture_output=True, text=True, env=env,
                          timeout=300)


def _cli(*argv):
    """The command through `cli.main` in this process (the same code, without a new interpreter's start-up)."""
    from safe_ckpt import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(argv))
    return subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())


def _craft_metadata(ckpt, payload):
    """Replace `.metadata` by the checkpoint's real index carrying ``payload`` in a field."""
    meta = safe_load.read_metadata(ckpt)
    meta.planner_data = {"w": ("w",), "hook": payload}
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(meta, f)


@pytest.fixture
def ckpt(tmp_path):
    return _save(str(tmp_path / "ck"))


@pytest.mark.parametrize("kind", ["os.system", "builtins.exec", "subprocess.call"])
def test_crafted_metadata_is_refused_and_never_run(tmp_path, kind):
    ckpt = _save(str(tmp_path / "ck"))
    marker = str(tmp_path / "ran")
    _craft_metadata(ckpt, _payloads(marker)[kind])
    # the file is hostile: a plain pickle.load (what DCP's reader does) runs it
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        pickle.load(f)
    assert os.path.exists(marker)
    os.unlink(marker)

    global_name = {"os.system": "posix.system", "builtins.exec": "builtins.exec",
                   "subprocess.call": "subprocess.call"}[kind]
    for command in (["verify"], ["verify", "--deep"], ["inspect"], ["inspect", "--json"]):
        out = _cli(*command, ckpt)
        assert out.returncode == 1, (command, out.stdout, out.stderr)
        assert f"refused: it references the global {global_name}" in out.stdout + out.stderr, (command, out)
        assert ".metadata" in out.stdout + out.stderr and "Traceback" not in out.stderr
        assert not os.path.exists(marker), f"{command} ran code from the checkpoint"
    if kind == "subprocess.call":  # once end to end in a fresh interpreter
        out = _cli_process("verify", ckpt)
        assert out.returncode == 1 and "subprocess.call" in out.stdout and "Traceback" not in out.stderr, out
        assert not os.path.exists(marker)
    with pytest.raises(safe_load.UnreadableCheckpointError) as err:
        safe_load.read_metadata(ckpt)
    assert err.value.refused_global == global_name and not os.path.exists(marker)


def test_crafted_common_state_is_refused_and_never_run(ckpt, tmp_path):
    marker = str(tmp_path / "ran")
    common = os.path.join(ckpt, "common.pt")
    torch.save({"iteration": 7, "args": _payloads(marker)["os.system"]}, common)
    torch.load(common, weights_only=False)  # hostile under a trusting load
    assert os.path.exists(marker)
    os.unlink(marker)
    for command in (["verify"], ["inspect"]):
        out = _cli(*command, ckpt)
        assert out.returncode == 1, (command, out.stdout, out.stderr)
        assert "common.pt" in out.stdout + out.stderr and "posix.system" in out.stdout + out.stderr, out
        assert "Traceback" not in out.stderr and not os.path.exists(marker)


def test_a_restricted_metadata_reader_refuses_each_forbidden_global(ckpt):
    """Globals a pickle could reach code through, each alone at the top of the file."""
    for fn, args, name in [(getattr, ("os", "system"), "builtins.getattr"), (eval, ("1",), "builtins.eval"),
                           (__import__, ("os",), "builtins.__import__"),
                           (torch.load, ("x",), "torch.serialization.load")]:
        with open(os.path.join(ckpt, ".metadata"), "wb") as f:
            pickle.dump(_Call(fn, *args), f)
        with pytest.raises(safe_load.UnreadableCheckpointError, match="refused") as err:
            safe_load.read_metadata(ckpt)
        assert err.value.refused_global == name


@pytest.mark.parametrize("damage", ["random", "truncated", "empty", "not_metadata"])
def test_garbage_metadata_is_a_clear_error(ckpt, damage):
    path = os.path.join(ckpt, ".metadata")
    data = open(path, "rb").read()
    new = {"random": random.Random(5).randbytes(len(data)), "truncated": data[: len(data) // 2], "empty": b"",
           "not_metadata": pickle.dumps({"state_dict_metadata": {}})}[damage]
    open(path, "wb").write(new)
    for command in ("verify", "inspect"):
        out = _cli(command, ckpt)
        assert out.returncode == 1, (command, out.stdout, out.stderr)
        text = out.stdout + out.stderr
        assert ".metadata" in text and "Traceback" not in text, text
        expected = "holds a dict, not a DCP Metadata" if damage == "not_metadata" else "is not a DCP metadata file"
        assert expected in text, text


def test_legit_metadata_of_this_library_and_stock_dcp_and_megatron_read(tmp_path, ckpt):
    import torch.distributed.checkpoint as dcp

    stock = str(tmp_path / "stock")
    g = torch.Generator().manual_seed(3)
    sd = {"a": torch.randn(3, 4, generator=g), "i": torch.arange(5), "h": torch.randn(2, generator=g).half(),
          "obj": {"x": 1}, "cl": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last)}
    dcp.save(sd, checkpoint_id=stock, no_dist=True)
    for directory in (ckpt, stock):
        meta = safe_load.read_metadata(directory)
        with open(os.path.join(directory, ".metadata"), "rb") as f:
            plain = pickle.load(f)
        assert meta.state_dict_metadata == plain.state_dict_metadata and meta.storage_data == plain.storage_data
    assert _cli("verify", "--deep", ckpt).returncode == 0
    assert _cli("inspect", stock).returncode == 0
    assert safe_load.load_common_state(stock, safe_load.read_metadata(stock)) is None
    assert safe_load.load_common_state(ckpt, safe_load.read_metadata(ckpt))["iteration"] == 0


def test_common_state_with_megatron_safe_globals_loads(tmp_path):
    """A training run's common state holds argparse.Namespace and megatron-core enums: torch's
    weights-only loader refuses them alone, megatron-core's safe globals admit them, as in stock Megatron."""
    import argparse

    from megatron.core.enums import ModelType

    state = _state(11)
    state["args"] = argparse.Namespace(lr=0.5, model_type=ModelType.encoder_or_decoder)
    path = str(tmp_path / "ck")
    safe_ckpt.save(state, path, options=safe_ckpt.SaveOptions(chunk_bytes=4096, io_threads=1, progress_interval_s=0))
    registered = torch.serialization.get_safe_globals()  # importing megatron.core registers its list
    torch.serialization.clear_safe_globals()
    try:
        with pytest.raises(pickle.UnpicklingError, match="argparse.Namespace"):
            torch.load(os.path.join(path, "common.pt"), weights_only=True)
        common = safe_load.load_common_state(path, safe_load.read_metadata(path))
    finally:
        torch.serialization.add_safe_globals(registered)
    assert common["args"].lr == 0.5 and common["args"].model_type == ModelType.encoder_or_decoder
    out = _cli("verify", "--deep", path)
    assert out.returncode == 0 and "common state loads" in out.stdout, out.stdout + out.stderr
    info = _cli("inspect", "--json", path)
    assert info.returncode == 0 and '"iteration": 11' in info.stdout, info.stdout + info.stderr


def test_the_admitted_globals_are_exactly_what_torch_pickles(ckpt, tmp_path):
    """Every global a legitimate file references is admitted; nothing outside ADMITTED_GLOBALS
    but torch's dtype / layout / memory-format constants is."""
    import torch.distributed.checkpoint as dcp

    stock = str(tmp_path / "stock")
    dcp.save({"a": torch.ones(2, 3).to(memory_format=torch.contiguous_format), "o": [1]}, checkpoint_id=stock,
             no_dist=True)
    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    for directory in (ckpt, stock):
        with open(os.path.join(directory, ".metadata"), "rb") as f:
            Recorder(f).load()
    constants = {(m, n) for m, n in seen if safe_load._torch_constant(m, n) is not None}
    assert seen - constants <= safe_load.ADMITTED_GLOBALS, seen - constants - safe_load.ADMITTED_GLOBALS
    assert ("torch", "float32") in constants and ("torch.serialization", "_get_layout") in seen
    assert safe_load._torch_constant("torch", "load") is None and safe_load._torch_constant("os", "system") is None
    assert safe_load._torch_constant("torch._utils", "torch.channels_last") is torch.channels_last
    data = pickle.dumps([torch.channels_last, torch.sparse_coo, torch.bfloat16, torch.Size([2, 3])])
    assert safe_load._MetadataUnpickler(data, "x").load() == [torch.channels_last, torch.sparse_coo,
                                                                torch.bfloat16, torch.Size([2, 3])]


def test_a_storage_entry_pointing_outside_the_checkpoint_is_refused(ckpt):
    meta = safe_load.read_metadata(ckpt)
    index, info = next(iter(meta.storage_data.items()))
    for outside in ("../outside.distcp", "/etc/passwd", "a//b"):
        info.relative_path = outside
        with open(os.path.join(ckpt, ".metadata"), "wb") as f:
            pickle.dump(meta, f)
        with pytest.raises(safe_load.UnreadableCheckpointError, match="points outside the checkpoint"):
            safe_load.read_metadata(ckpt)
        rc = _cli("verify", ckpt)
        assert rc.returncode == 1 and "points outside" in rc.stdout, rc
