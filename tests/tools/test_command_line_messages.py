"""What the command line says, with the exact input a user gave it: flags, never the library's
Python option names; a save root without a tracker points at the checkpoints inside it; a plain
DCP checkpoint is verified, not refused; sizes in binary units; --version; bench's help and its
missing chart; one progress line on a terminal, none with -q."""

import contextlib
import io
import json
import os
import re

import pytest
import torch

import safe_ckpt
from safe_ckpt import cli
from safe_ckpt.cli import output as cli_output
from tests.tools.test_cli_edges import OPTS, _cli, _cli_process, _save_root, _state
from tests.helpers.paths import REPO as ROOT

PYTHON_NAMES = ("SaveOptions", "LoadOptions", "replace=", "_timeout_s", "io_threads")


def _one_clean_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert not any(name in err for name in PYTHON_NAMES), err
    return lines[0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("msg") / "ck")
    safe_ckpt.save(_state(7), path, options=safe_ckpt.SaveOptions(**OPTS))
    return path


def test_copy_into_a_directory_holding_other_files_names_the_flag(ckpt, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkdir("notes")
    with open("notes/todo.txt", "w") as f:
        f.write("mine")
    rc, out, err = _cli("copy", ckpt, "notes")
    line = _one_clean_line(err)
    assert rc == 1 and out == ""
    assert line == ("safe-ckpt copy: notes holds files but no complete torch_dist checkpoint (foreign data or a "
                    "broken save); refusing to replace it. Remove it, or pass --replace"), line
    assert os.listdir("notes") == ["todo.txt"] and not [n for n in os.listdir(".") if n.startswith(".")]


def test_the_library_remedies_the_command_line_rewords_are_still_worded_so():
    """`cli_words` rewrites phrases of the library's messages; a reworded message would slip past it."""
    sources = ""
    for directory, _, names in os.walk(os.path.join(ROOT, "safe_ckpt")):
        for name in names:
            if name.endswith(".py") and os.path.basename(directory) != "cli":
                with open(os.path.join(directory, name)) as f:
                    sources += re.sub(r'"\s*\n\s*f?"', "", f.read())  # implicit concatenation joined
    for pattern, flag in cli_output._CLI_WORDS:
        assert re.search(pattern, sources), pattern
        reworded = cli_output.cli_words("... " + re.sub(r"\\(.)", r"\1", pattern) + " ...")
        assert "--" in reworded and not any(name in reworded for name in PYTHON_NAMES), reworded


@pytest.mark.parametrize("command", ["verify", "inspect", "copy"])
def test_a_save_root_without_a_tracker_points_at_its_checkpoints(tmp_path, monkeypatch, command):
    _save_root(tmp_path, [100, 200, 300, 400])
    os.remove(tmp_path / "run" / "latest_checkpointed_iteration.txt")
    monkeypatch.chdir(tmp_path)
    rc, out, err = _cli(command, "run", *(["elsewhere"] if command == "copy" else []))
    assert rc == 2 and out == "", (rc, out, err)
    assert _one_clean_line(err) == (
        f"safe-ckpt {command}: error: run: no tracker (latest_checkpointed_iteration.txt) and no .metadata: this "
        "looks like a save root holding iter_0000100, iter_0000200, ..., iter_0000400 (4 checkpoints); pass one "
        "of them, e.g. run/iter_0000400")
    assert not os.path.exists("elsewhere")


def test_a_tracker_naming_a_missing_checkpoint_says_what_to_do(tmp_path):
    root = _save_root(tmp_path, [3])
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("9")
    rc, _, err = _cli("inspect", root)
    assert rc == 1 and _one_clean_line(err).endswith(
        "iter_0000009 does not exist; pass a checkpoint directory instead, or point the tracker at one"), err


def _plain_dcp(path):
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(11)
    state = {"w": torch.randn(100, 30, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16), "step": 3}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return state


def test_verify_checks_a_plain_dcp_checkpoint_that_inspect_reads(tmp_path):
    path = str(tmp_path / "plain")
    _plain_dcp(path)
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp"]
    assert _cli("inspect", path)[0] == 0
    rc, out, err = _cli("verify", path)
    assert rc == 0 and err == "", out + err
    assert "WARNING metadata.json: missing: a plain DCP checkpoint" in out
    assert re.search(r"^OK: 3 items, [0-9.]+ KiB read, checksums unavailable \(no safe_ckpt manifest\): files, "
                     r"sizes and structure checked$", out, re.M), out
    report = json.loads(_cli("verify", "--json", path)[1])
    assert report["ok"] and report["plain_dcp"] and not report["checksums_available"] and report["items"] == 3
    # what can be checked still is: a cut-short data file fails
    data = os.path.join(path, "__0_0.distcp")
    os.truncate(data, os.path.getsize(data) - 100)
    rc, out, _ = _cli("verify", path)
    assert rc == 1 and "ERROR   __0_0.distcp: truncated" in out and out.rstrip().splitlines()[-1].startswith("FAILED")


def test_a_directory_without_metadata_is_still_not_a_checkpoint(tmp_path):
    (tmp_path / "metadata.json").write_text("{}")
    rc, out, _ = _cli("verify", str(tmp_path))
    assert rc == 1 and "ERROR   .metadata: missing: this is not a torch_dist or DCP checkpoint" in out


def test_sizes_are_in_binary_units(ckpt):
    rc, out, _ = _cli("verify", ckpt)
    assert rc == 0 and re.search(r"^OK: \d+ items, [0-9.]+ KiB read, \d+ items checked against the manifest", out,
                                 re.M), out
    assert " GB" not in out and " MB" not in out


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == f"safe-ckpt {safe_ckpt.__version__}\n"


def test_a_bad_thread_count_for_the_demo_names_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--io-threads", "0"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --io-threads: must be positive, got 0" in err and "io_threads" not in err


def test_bench_help_describes_it_in_whole_sentences(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert exc.value.code == 0
    description = text.split("options:")[0].split("]")[-1].strip()
    assert description.startswith("Benchmark safe_ckpt beside stock Megatron and stock DCP") and \
        description.endswith("a chart PREFIX.png."), description


def test_bench_says_when_it_writes_no_chart(tmp_path, monkeypatch, capsys):
    import sys

    prefix = str(tmp_path / "run")
    row = {"peer": "safe_sync", "residence": "gpu", "target": "/t", "cache": "cold", "stall_s": 1.0, "total_s": 1.0,
           "bytes": 10**9, "device_bytes": 10**9}
    with open(prefix + ".meta.json", "w") as f:
        json.dump({"ceilings": {"write_gbps[/t]": 2.0}, "write_samples_gbps": {"/t": [2.0]}}, f)
    with open(prefix + ".rows.jsonl", "w") as f:
        f.write("\n".join(json.dumps({**row, "rep": i}) for i in range(2)))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where it is not installed
    assert cli.main(["bench", "--rebuild", prefix]) == 0
    err = capsys.readouterr().err
    assert err == (f"safe-ckpt bench: no chart ({prefix}.png): matplotlib is not installed (pip install "
                   f"matplotlib); the report is {prefix}.md\n"), err
    assert os.path.exists(prefix + ".md") and not os.path.exists(prefix + ".png")


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _on_a_terminal(*argv):
    out, err = io.StringIO(), _Terminal()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_demo_and_bench_without_the_lab_say_where_it_is_in_one_line(tmp_path, monkeypatch, capsys):
    """An installation without the lab (a wheel of the library alone, not a clone): `demo` and
    `bench` exit 2 with one line naming the lab and the remedy, no traceback."""
    import sys

    from safe_ckpt.cli import lab

    for name in ["safe_ckpt_lab", *[m for m in sys.modules if m.startswith("safe_ckpt_lab.")]]:
        monkeypatch.setitem(sys.modules, name, None)  # not importable, as where it is not installed
    monkeypatch.setattr(lab, "clone_root", lambda: tmp_path)  # and no clone around this package
    for argv in (["demo"], ["bench", "--help"]):
        assert cli.main(argv) == 2
        line = _one_clean_line(capsys.readouterr().err)
        assert line == (f"safe-ckpt {argv[0]}: error: `safe-ckpt {argv[0]}` runs the lab kept in safe_ckpt's "
                        "source repository (safe_ckpt_lab/), which this installation does not include; run it "
                        "from a clone (pip install -e .)"), line


def test_the_lab_is_found_beside_the_package_in_a_clone(monkeypatch):
    """A clone whose lab is not on the path (an editable install made before the lab was a
    package of its own): `demo` and `bench` still find it beside `safe_ckpt`."""
    import pathlib
    import sys

    from safe_ckpt.cli import lab

    repo = pathlib.Path(ROOT).resolve()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p and pathlib.Path(p).resolve() != repo])
    for name in [m for m in sys.modules if m == "safe_ckpt_lab" or m.startswith("safe_ckpt_lab.")]:
        monkeypatch.delitem(sys.modules, name)
    demo = lab.lab_module("demo", "demo")
    assert pathlib.Path(demo.__file__).resolve() == repo / "safe_ckpt_lab" / "demo.py"


def test_long_commands_show_one_progress_line_on_a_terminal(ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(cli_output.ProgressLine, "INTERVAL_S", 0.0)  # every step draws: a short run shows its line
    rc, out, err = _on_a_terminal("verify", "--deep", ckpt)
    assert rc == 0 and out.startswith("checkpoint ")
    assert err.startswith("\rverify --deep: ") and err.endswith("\n") and err.count("\n") == 1, repr(err)
    last = err.rstrip("\n").split("\r")[-1].rstrip()
    assert re.fullmatch(r"verify --deep: ([0-9.]+ KiB) of \1 \(100%\), [0-9.]+ [KMG]iB/s", last), last
    rc, out, err = _on_a_terminal("copy", ckpt, str(tmp_path / "copied"))
    last = err.rstrip("\n").split("\r")[-1].rstrip()
    assert rc == 0 and re.fullmatch(r"copy: ([0-9.]+ KiB) of \1 \(100%\), [0-9.]+ [KMG]iB/s, (\d+) of \2 files",
                                    last), repr(err)
    for quiet in (["-q", "verify", ckpt], ["verify", "-q", ckpt], ["verify", "--json", ckpt]):
        rc, _, err = _on_a_terminal(*quiet)
        assert rc == 0 and err == "", (quiet, err)


def test_no_progress_line_off_a_terminal_or_for_a_short_command(ckpt):
    rc, _, err = _cli("verify", "--deep", ckpt)  # not a terminal
    assert rc == 0 and err == ""
    rc, _, err = _on_a_terminal("verify", ckpt)  # over within one interval
    assert rc == 0 and err == ""


def test_gc_logs_its_lines_as_show_progress_prints_them_and_leaves_logging_as_it_was(tmp_path):
    import logging

    leftover = tmp_path / ".iter_0000001.safe_ckpt-staging-x"  # what an interrupted save leaves
    os.makedirs(leftover)
    lib = logging.getLogger("safe_ckpt")
    before = (list(lib.handlers), lib.level, lib.propagate)
    rc, out, err = _cli("gc", str(tmp_path))
    assert rc == 0 and out == f"removed {leftover}\n", out + err
    # the line show_progress() prints: "HH:MM:SS safe_ckpt: message" (no date, no level at INFO)
    assert re.fullmatch(rf"\d\d:\d\d:\d\d safe_ckpt: removing {re.escape(str(leftover))} left by an "
                        rf"interrupted save\n", err), err
    record = logging.LogRecord("safe_ckpt", logging.INFO, __file__, 0, "removing %s left by an interrupted save",
                               (str(leftover),), None)
    from safe_ckpt.write.progress import LineFormatter  # show_progress's formatter

    assert err.split(" ", 1)[1] == LineFormatter().format(record).split(" ", 1)[1] + "\n"
    assert (list(lib.handlers), lib.level, lib.propagate) == before
    os.makedirs(leftover)  # and as its own process, where nothing else configured logging
    proc = _cli_process("gc", str(tmp_path))
    assert proc.returncode == 0 and re.fullmatch(rf"\d\d:\d\d:\d\d safe_ckpt: removing {re.escape(str(leftover))} "
                                                 rf"left by an interrupted save\n", proc.stderr), proc.stderr


def test_paths_a_command_cannot_use_are_named_as_given(ckpt, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open("plain.txt", "w") as f:
        f.write("mine")
    cases = [
        (["copy", ckpt, "plain.txt/ck"], "safe-ckpt copy: error: plain.txt/ck: plain.txt is not a directory"),
        (["copy", ckpt, "/proc/ck"], "safe-ckpt copy: error: /proc/ck: cannot create a checkpoint there (No such "
                                     "file or directory)"),
        (["demo", "--out", "plain.txt"], "safe-ckpt demo: error: --out plain.txt: not a directory"),
        (["copy", ckpt, "s3://"], "safe-ckpt copy: error: s3://: the URL names no bucket (s3://BUCKET/PREFIX)"),
        (["verify", "gs:///run"], "safe-ckpt verify: error: gs:///run: the URL names no bucket (gs://BUCKET/PREFIX)"),
    ]
    for argv, message in cases:
        rc, out, err = _cli(*argv)
        assert rc == 2 and out == "" and _one_clean_line(err) == message, (argv, err)
    assert sorted(os.listdir(".")) == ["plain.txt"]  # no staging directory left anywhere


def test_a_copy_that_cannot_write_names_the_destination_not_its_staging_directory(ckpt, tmp_path, monkeypatch):
    from safe_ckpt.tools import copy as copy_tool

    def full(directory, name, blob):
        raise OSError(28, "No space left on device", os.path.join(directory, name))

    from safe_ckpt.targets.directory import copying

    monkeypatch.setattr(copying, "_write_local", full)
    monkeypatch.chdir(tmp_path)
    rc, out, err = _cli("copy", ckpt, "dst")
    line = _one_clean_line(err)
    assert rc == 1 and out == "" and "staging" not in line, line
    assert re.fullmatch(r"safe-ckpt copy: dst: cannot write __0_0\.distcp \(No space left on device\); dst is as it "
                        r"was", line), line
    assert os.listdir(".") == []
