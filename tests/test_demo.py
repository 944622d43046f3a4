"""The demo (`safe-ckpt demo`, `bash scripts/demo.sh`): what it prints and what it leaves."""

import os
import re

from safe_ckpt import demo


def _lines(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("20"))  # drop log lines


def test_demo_kept_checkpoint_and_same_run_comparisons(tmp_path, capsys):
    """With --out the checkpoint and tracker stay, and nothing else the demo wrote does; the
    save's rate stands beside the target's write ceiling and DCP's save, all in MiB."""
    out = tmp_path / "demo"
    assert demo.main(world_size=2, size_mb=16, out=str(out), io_threads=2, rounds=1) == 0
    text = _lines(capsys.readouterr().out)
    ckpt = out / "iter_0000042"
    assert sorted(os.listdir(out)) == ["iter_0000042", "latest_checkpointed_iteration.txt"]
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "42"
    assert f"checkpoint kept: {ckpt}" in text
    size = re.search(r"saved ([0-9.]+) MiB", text)
    data_bytes = sum(os.path.getsize(ckpt / f) for f in os.listdir(ckpt) if f.endswith(".distcp"))
    assert size and abs(float(size.group(1)) - data_bytes / 2**20) < 0.05
    assert re.search(r"safe_ckpt\.save +[0-9.]+ s +[0-9.]+ MiB/s", text)
    assert re.search(r"write ceiling .* [0-9.]+ s +[0-9.]+ MiB/s +safe_ckpt at [0-9]+ % of it", text)
    assert re.search(r"stock DCP save of the same tensors +[0-9.]+ s +[0-9.]+ MiB/s +safe_ckpt [0-9.]+x as fast", text)
    assert "all bit-exact" in text
    assert "GB" not in text and " MB" not in text


def test_demo_says_whether_it_kept_the_checkpoint(tmp_path):
    """Without --out or --keep the checkpoint goes with its temporary directory, and the demo
    says so and names --keep; with --keep it stays and the demo says where."""
    kept = tmp_path / "kept"
    (kept / "iter_0000042").mkdir(parents=True)
    line = demo.dispose(str(kept), keep=True)
    assert line.startswith(f"checkpoint kept: {kept / 'iter_0000042'}") and (kept / "iter_0000042").is_dir()
    gone = tmp_path / "gone"
    (gone / "iter_0000042").mkdir(parents=True)
    line = demo.dispose(str(gone), keep=False)
    assert line == f"checkpoint removed with its temporary directory {gone}; pass --keep (or --out DIR) to keep it"
    assert not gone.exists()
