"""The command line's edges: bad paths, save roots, --deep, help, import noise, optimizer
sharding, unexpected errors; each with the exact input a user gave it."""

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch

import safe_ckpt
from safe_ckpt import cli

from tests.helpers.paths import REPO as ROOT

OPTS = dict(chunk_bytes=4096, io_threads=1, progress_interval_s=0)


def _state(seed=0):
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    g = torch.Generator().manual_seed(seed)
    return {"w": ShardedTensor.from_rank_offsets("w", torch.randn(60, 40, generator=g)),
            "b": ShardedTensor.from_rank_offsets("b", torch.randn(17, generator=g).to(torch.bfloat16)),
            "o": ShardedObject("o", {"seed": seed}, (1,), (0,)), "iteration": seed}


def _cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def _cli_process(*argv):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "safe_ckpt", *argv], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cli") / "ck")
    safe_ckpt.save(_state(), path, options=safe_ckpt.SaveOptions(**OPTS))
    return path


@pytest.mark.parametrize("argv, message", [
    (["inspect", "/nonexistent"], "/nonexistent: no such checkpoint directory"),
    (["verify", "/nonexistent"], "/nonexistent: no such checkpoint directory"),
    (["gc", "/nonexistent"], "/nonexistent: no such save root"),
    (["gc", "/etc/passwd"], "/etc/passwd: not a directory"),
    (["inspect", "/etc/passwd"], "/etc/passwd: not a directory"),
    (["verify", "/etc/passwd"], "/etc/passwd: not a directory"),
    (["copy", "/nonexistent", "/tmp/never_written"], "/nonexistent: no such source directory"),
    (["copy", "/etc", "/tmp/never_written", "--src-spec", "{"], "--src-spec is not valid JSON"),
])
def test_a_bad_path_is_a_usage_error_without_traceback(argv, message):
    rc, out, err = _cli(*argv)
    assert rc == 2 and out == "", (rc, out, err)
    assert err.startswith(f"safe-ckpt {argv[0]}: error: {message}"), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert ".metadata" not in err  # verify /nonexistent used to say ".metadata: missing"
    assert not os.path.exists("/tmp/never_written")


@pytest.mark.parametrize("argv", [["verify"], ["inspect"], ["gc"], ["copy", "x"], ["verify", "--nope", "x"]])
def test_a_missing_or_unknown_argument_exits_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2 and "usage: safe-ckpt" in capsys.readouterr().err


def test_a_directory_that_is_not_a_checkpoint_exits_1(tmp_path):
    for command in ("verify", "inspect"):
        rc, out, err = _cli(command, str(tmp_path))
        assert rc == 1 and ".metadata" in out + err and "missing" in out + err and "Traceback" not in err


def test_inspect_of_a_garbage_metadata_exits_1_without_traceback(tmp_path):
    path = str(tmp_path / "ck")
    safe_ckpt.save(_state(), path, options=safe_ckpt.SaveOptions(**OPTS))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(b"\x80\x04garbage, not a pickle")
    rc, out, err = _cli("inspect", path)
    assert rc == 1 and out == "" and "Traceback" not in err
    assert err.startswith(f"safe-ckpt inspect: {path}/.metadata: is not a DCP metadata file"), err


def _save_root(tmp_path, iterations):
    from safe_ckpt.megatron import save_state

    root = str(tmp_path / "run")
    for it in iterations:
        save_state(_state(it), root, os.path.join(root, f"iter_{it:07d}"), str(it),
                   options=safe_ckpt.SaveOptions(**OPTS))
    return root


def test_verify_and_inspect_of_a_save_root_follow_the_tracker(tmp_path):
    root = _save_root(tmp_path, [3, 5])
    target = os.path.join(root, "iter_0000005")
    rc, out, err = _cli("verify", root)
    assert rc == 0, out + err
    assert f"followed latest_checkpointed_iteration.txt (5) to {target}" in err and f"checkpoint {target}" in out
    rc, out, err = _cli("inspect", "--json", root)
    info = json.loads(out)
    assert rc == 0 and info["directory"] == target and info["followed_tracker"] == "5" and info["iteration"] == 5
    rc, out, _ = _cli("verify", "--json", target)  # a checkpoint directory itself is taken as it is
    assert rc == 0 and json.loads(out)["followed_tracker"] is None

    os.rename(target, os.path.join(root, "release"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release")
    rc, out, err = _cli("inspect", root)
    assert rc == 0 and "followed latest_checkpointed_iteration.txt (release)" in err, out + err

    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("9")
    rc, out, err = _cli("verify", root)
    assert rc == 1 and "names '9'" in err and "iter_0000009 does not exist" in err and "Traceback" not in err


def test_deep_verify_reports_what_it_loaded(ckpt):
    rc, out, _ = _cli("verify", ckpt)
    assert rc == 0 and "deep:" not in out
    rc, deep, _ = _cli("verify", "--deep", ckpt)
    tensor_bytes = 60 * 40 * 4 + 17 * 2
    from safe_ckpt.encoding.safe_read import read_metadata

    tensor_items = sum(1 for index in read_metadata(ckpt).storage_data if index.fqn in ("w", "b"))
    assert rc == 0 and tensor_items >= 2
    assert (f"deep: torch.load(weights_only=True) of {tensor_items} tensor items, {tensor_bytes} bytes of "
            f"tensor data") in deep, deep
    assert "1 object item checked by checksum only" in deep
    report = json.loads(_cli("verify", "--deep", "--json", ckpt)[1])
    assert report["deep_loaded_items"] == tensor_items and report["deep_loaded_bytes"] == tensor_bytes


def test_every_argument_of_every_subcommand_has_help():
    import argparse

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {action.dest}" for name, p in sub.choices.items() if name != "bench"
               for action in p._actions
               if not isinstance(action, argparse._HelpAction) and not (action.help or "").strip()]
    missing += [a.dest for a in parser._actions if not (a.help or "").strip() and a is not sub]
    assert not missing, missing
    assert {"demo", "verify", "inspect", "gc", "copy", "bench"} <= set(sub.choices)
    for name in ("verify", "inspect", "gc", "copy", "demo"):
        with pytest.raises(SystemExit) as exc, contextlib.redirect_stdout(io.StringIO()) as out:
            cli.main([name, "-h"])
        assert exc.value.code == 0 and "options:" in out.getvalue()


def test_inspect_and_verify_print_no_megatron_import_noise(ckpt):
    for command in ("inspect", "verify"):
        done = _cli_process(command, ckpt)
        assert done.returncode == 0, done.stderr
        for noise in ("Warning", "Transformer Engine", "Megatron-FSDP", "warnings.warn"):
            assert noise not in done.stderr, (command, done.stderr)
        assert done.stderr.strip() == "", done.stderr


def _synthetic_save(path, content_metadata=None, sharding_in_common=None, optimizer=True):
    from safe_ckpt.megatron import save_state
    from safe_ckpt_lab.synthetic import StateSpec, build_state

    spec = StateSpec(hidden=16, ffn=32, vocab=64, layers=2, seq=8, buckets=2, bucket_numel=500, pieces_per_rank=2)
    state = build_state(0, 1, tp=1, spec=spec)
    if not optimizer:
        del state["optimizer"]
    elif sharding_in_common:
        state["optimizer"]["param_state_sharding_type"] = sharding_in_common  # as megatron-core stores it
    root = os.path.dirname(path)
    save_state(state, root, path, "42", content_metadata=content_metadata, options=safe_ckpt.SaveOptions(**OPTS))
    return path


@pytest.mark.parametrize("how, expected, source", [
    ("keys", "dp_reshardable", "inferred from optimizer.distributed.*.bucket_idx_* keys"),
    ("content_metadata", "fully_reshardable", "content_metadata"),
    ("common", "dp_reshardable", "the optimizer's common state"),
    ("none", None, "no distributed-optimizer state"),
])
def test_inspect_reports_the_distributed_optimizer_sharding(tmp_path, how, expected, source):
    path = _synthetic_save(
        str(tmp_path / "iter_0000042"),
        content_metadata={"distrib_optim_sharding_type": "fully_reshardable"} if how == "content_metadata" else None,
        sharding_in_common="dp_reshardable" if how == "common" else None, optimizer=how != "none")
    rc, out, _ = _cli("inspect", "--json", path)
    info = json.loads(out)
    assert rc == 0 and info["distrib_optim_sharding_type"] == expected and info["distrib_optim_sharding_source"] == source
    text = _cli("inspect", path)[1]
    assert f"optimizer sharding {expected or 'none'} ({source})" in text


def test_an_unexpected_error_is_one_line_and_v_gives_the_traceback(ckpt, monkeypatch):
    from safe_ckpt.tools import inspect as inspect_tool

    def boom(directory):
        raise RuntimeError("boom in " + os.path.basename(directory))

    monkeypatch.setattr(inspect_tool, "inspect", boom)
    rc, out, err = _cli("inspect", ckpt)
    assert rc == 1 and out == ""
    assert err == "safe-ckpt inspect: failed: RuntimeError: boom in ck (run with -v for the traceback)\n", err
    for argv in (["-v", "inspect", ckpt], ["inspect", "-v", ckpt]):
        rc, _, err = _cli(*argv)
        assert rc == 1 and "Traceback (most recent call last)" in err and "RuntimeError: boom in ck" in err


def test_ctrl_c_exits_130(ckpt, monkeypatch):
    from safe_ckpt.tools import verify as verify_tool

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(verify_tool, "verify", interrupted)
    rc, out, err = _cli("verify", ckpt)
    assert rc == 130 and err == "safe-ckpt verify: interrupted\n" and "Traceback" not in err


def test_copy_of_a_directory_that_is_not_a_checkpoint_exits_1(tmp_path):
    src = tmp_path / "notes"
    src.mkdir()
    (src / "a.txt").write_text("mine")
    rc, out, err = _cli("copy", str(src), str(tmp_path / "dst"))
    assert rc == 1 and "not a complete torch_dist checkpoint" in err and "Traceback" not in err
    assert not (tmp_path / "dst").exists() or not os.listdir(tmp_path / "dst")


def test_every_argument_of_bench_has_help(monkeypatch):
    import argparse

    class Parsed(Exception):
        pass

    seen = []

    def capture(self, argv=None, namespace=None):
        seen.append(self)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(Parsed):
        cli.main(["bench", "--reps", "1"])
    missing = [a.dest for a in seen[0]._actions if not (a.help or "").strip()]
    assert seen[0].prog == "safe-ckpt bench" and not missing, missing


def test_inspect_piped_into_a_reader_that_leaves_early_says_nothing_on_stderr(tmp_path):
    """`safe-ckpt inspect CKPT | head -1`: the reader closes the pipe; no BrokenPipeError, exit 0."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    g = torch.Generator().manual_seed(3)
    state = {f"layer.{i}.weight": ShardedTensor.from_rank_offsets(f"layer.{i}.weight", torch.randn(8, generator=g))
             for i in range(3000)}  # its listing is far larger than a pipe's buffer
    path = str(tmp_path / "ck")
    safe_ckpt.save(state, path, options=safe_ckpt.SaveOptions(**OPTS))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cli_proc = subprocess.Popen([sys.executable, "-m", "safe_ckpt", "inspect", path], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, cwd=ROOT)
    first = cli_proc.stdout.readline()
    cli_proc.stdout.close()  # what `head -1` does after its line
    err = cli_proc.stderr.read().decode()
    assert cli_proc.wait(timeout=120) == 0, err
    assert first and "BrokenPipe" not in err and "Traceback" not in err, err


def test_verify_of_a_checkpoint_that_lost_only_its_metadata_says_it_is_damaged(ckpt, tmp_path):
    import shutil

    damaged = str(tmp_path / "damaged")
    shutil.copytree(ckpt, damaged)
    os.remove(os.path.join(damaged, ".metadata"))
    rc, out, err = _cli("verify", damaged)
    assert rc == 1
    assert "damaged or incomplete checkpoint" in out + err and "not a torch_dist" not in out + err, out + err
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out, err = _cli("verify", str(empty))
    assert rc == 1 and "not a torch_dist or DCP checkpoint" in out + err
