"""`python -m safe_ckpt.integrations.slime`: its own help, one-line errors without slime, and the
hand-over to a slime checkout's train.py; each run as a user runs it, in a fresh interpreter."""

import os
import subprocess
import sys
import textwrap

import pytest

from safe_ckpt.integrations.slime import INIT_HOOK

from tests.helpers.paths import REPO as ROOT


def _launch(*argv, cwd):
    """The launcher in a fresh interpreter whose path holds this checkout and nothing of slime."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "safe_ckpt.integrations.slime", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def no_slime(tmp_path_factory):
    """A working directory from which slime cannot be imported (checked, so the tests mean it)."""
    cwd = tmp_path_factory.mktemp("no_slime")
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('slime'))"],
                           cwd=cwd, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True)
    assert probe.stdout.strip() == "None", "slime is importable here: these tests need an environment without it"
    return cwd


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_works_without_slime(no_slime, flag):
    r = _launch(flag, "--ckpt-backend", "safe", cwd=no_slime)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stdout + r.stderr and r.stderr == ""
    out = r.stdout
    assert out.startswith("usage: python -m safe_ckpt.integrations.slime [--slime-train-script PATH]")
    assert "goes to train.py unchanged" in out and INIT_HOOK in out
    for flag_name in ("--slime-train-script PATH", "--ckpt-backend", "--safe-ckpt-staging-budget-gib",
                      "--safe-ckpt-keep-last", "--safe-ckpt-save-awake"):
        assert flag_name in out


def test_any_other_call_without_slime_is_one_line_naming_the_remedy(no_slime):
    r = _launch("--ckpt-backend", "safe", "--save", "/ckpt", cwd=no_slime)
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr == ("python -m safe_ckpt.integrations.slime: slime is not installed: install slime in this "
                        "environment (pip install -e /path/to/slime) or pass --slime-train-script "
                        "/path/to/slime/train.py\n")


def test_bad_train_script_paths_are_one_line(no_slime, tmp_path):
    r = _launch("--slime-train-script", str(tmp_path / "nope.py"), "--save", "/ckpt", cwd=no_slime)
    assert (r.returncode, r.stderr) == (2, f"python -m safe_ckpt.integrations.slime: --slime-train-script "
                                           f"{tmp_path / 'nope.py'}: no such file; pass the train.py of a slime "
                                           "checkout\n")
    lone = tmp_path / "train.py"
    lone.write_text("raise SystemExit('must not run')\n")
    r = _launch("--save", "/ckpt", "--slime-train-script", str(lone), cwd=no_slime)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert f"slime is neither installed nor beside {lone}" in r.stderr
    r = _launch("--save", "/ckpt", "--slime-train-script", cwd=no_slime)
    assert (r.returncode, r.stderr) == (2, "python -m safe_ckpt.integrations.slime: --slime-train-script needs a "
                                           "PATH: the train.py of a slime checkout\n")


def test_train_script_of_an_uninstalled_checkout_runs_with_the_hook(no_slime, tmp_path):
    """A slime checkout that is not installed: its train.py imports the slime package beside it,
    and gets the init hook and safe_ckpt's flags through slime's `parse_args`. The checkout is a
    stand-in mirroring slime 624b824a's `slime.utils.arguments.parse_args(add_custom_arguments=None)`
    and train.py's `from slime.utils.arguments import parse_args`."""
    (tmp_path / "slime" / "utils").mkdir(parents=True)
    (tmp_path / "slime" / "__init__.py").write_text("")
    (tmp_path / "slime" / "utils" / "__init__.py").write_text("")
    (tmp_path / "slime" / "utils" / "arguments.py").write_text(textwrap.dedent("""
        import argparse

        def parse_args(add_custom_arguments=None):
            parser = argparse.ArgumentParser()
            parser.add_argument("--save")
            parser.add_argument("--custom-megatron-init-path")
            if add_custom_arguments is not None:
                parser = add_custom_arguments(parser)
            return parser.parse_args()
    """))
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        from slime.utils.arguments import parse_args

        if __name__ == "__main__":
            args = parse_args()
            print(args.save, args.ckpt_backend, args.custom_megatron_init_path, args.safe_ckpt_keep_last)
    """))
    r = _launch("--save", "/ckpt", "--slime-train-script", str(tmp_path / "train.py"), "--ckpt-backend", "safe",
                "--safe-ckpt-keep-last", "3", cwd=no_slime)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"/ckpt safe {INIT_HOOK} 3\n"
