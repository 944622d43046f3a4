"""The README's Python code runs as written, and its links point at committed files.

Every ```python block of README.md runs in a fresh interpreter in a temporary directory,
with this checkout first on the path. A block whose first line is `# continues the
quickstart` runs after the quickstart (the first block), in the same script. A block whose
first line starts with `# not run by the README test:` is skipped, and that line must say
what it needs.
"""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO as ROOT

README = os.path.join(ROOT, "README.md")
SKIP = "# not run by the README test:"
CONTINUES = "# continues the quickstart"


def _blocks(path: str) -> list[str]:
    with open(path) as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.S | re.M)


def _scripts() -> list[tuple[str, str]]:
    """(name, source) of every script the README's blocks make, in order."""
    blocks = _blocks(README)
    assert blocks, "README.md has no python blocks"
    quickstart = blocks[0]
    assert not quickstart.startswith((SKIP, CONTINUES)), "the first python block must be the runnable quickstart"
    scripts, continued = [], []
    for i, block in enumerate(blocks[1:], start=1):
        if block.startswith(SKIP):
            assert len(block.splitlines()[0]) > len(SKIP) + 5, f"block {i} must say what it needs"
        elif block.startswith(CONTINUES):
            continued.append(block)
        else:
            scripts.append((f"block{i}", block))
    return [("quickstart", "\n".join([quickstart, *continued]))] + scripts


def _run(source: str, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "readme_block.py"
    script.write_text(source)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TMPDIR=str(tmp_path), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("name,source", _scripts(), ids=[name for name, _ in _scripts()])
def test_readme_python_blocks_run(name, source, tmp_path):
    proc = _run(source, tmp_path)
    assert proc.returncode == 0, f"README {name} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    if name == "quickstart":
        assert re.search(r"saved [0-9.]+ MiB in [0-9.]+ s", proc.stdout)
        assert "loaded back bit-exact with megatron.core.dist_checkpointing.load" in proc.stdout
        assert re.search(r"training waited [0-9.]+ s", proc.stdout)
        # show_progress(): the summary of each save on stderr, with the logger's name said once
        assert re.search(r"^\d\d:\d\d:\d\d safe_ckpt: saved \S*iter_0000042: ", proc.stderr, flags=re.M), proc.stderr
        assert "safe_ckpt: safe_ckpt" not in proc.stderr


def test_readme_skips_at_most_two_blocks():
    """Only code that needs Megatron-LM's training package or a slime checkout is skipped."""
    skipped = [b.splitlines()[0] for b in _blocks(README) if b.startswith(SKIP)]
    assert len(skipped) <= 2, skipped


def test_readme_is_short_and_opens_with_the_two_commands():
    with open(README) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines"
    head = "\n".join(lines[:12])
    assert "bash scripts/demo.sh" in head and "bash scripts/test.sh" in head


@pytest.mark.parametrize("doc", ["README.md", "docs/options.md", "docs/results.md", "docs/format.md",
                                 "docs/load.md", "docs/slime.md", "docs/compat_results.md", "CHANGELOG.md",
                                 "benchmarks/README.md", "benchmarks/diag/README.md"])
def test_doc_links_point_at_committed_files(doc):
    """Every relative link (a result a table cites, the chart, another doc) exists."""
    path = os.path.join(ROOT, doc)
    with open(path) as f:
        text = f.read()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert local or doc in ("docs/format.md", "CHANGELOG.md"), f"{doc} links nothing"
    missing = [t for t in local if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(path), t)))]
    assert not missing, f"{doc} links missing files: {missing}"
