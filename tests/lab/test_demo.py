"""The demo (`safe-ckpt demo`, `bash scripts/demo.sh`): what it prints and what it leaves."""

import glob
import os
import re

from safe_ckpt_lab import demo
from safe_ckpt_lab.bench.machine import fs_type
from safe_ckpt_lab.synthetic import StateSpec
from safe_ckpt.names import iteration_dir


def _lines(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("20"))  # drop log lines


def test_demo_kept_checkpoint_and_same_run_comparisons(tmp_path, capsys):
    """With --out the checkpoint and tracker stay, and nothing else the demo wrote does; the
    save's rate stands beside the target's write ceiling and DCP's save, all in MiB, each a
    median with the rounds' spread; the target's filesystem is named; the size asked for is
    the size saved."""
    out = tmp_path / "demo"
    assert demo.main(world_size=2, size_mb=16, out=str(out), io_threads=2, rounds=2) == 0
    text = _lines(capsys.readouterr().out)
    ckpt = out / "iter_0000042"
    assert sorted(os.listdir(out)) == ["iter_0000042", "latest_checkpointed_iteration.txt"]
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "42"
    assert f"checkpoint kept: {ckpt}" in text
    size = re.search(r"2 ranks saved ([0-9.]+) MiB", text)
    data_bytes = sum(os.path.getsize(ckpt / f) for f in os.listdir(ckpt) if f.endswith(".distcp"))
    assert size and abs(float(size.group(1)) - data_bytes / 2**20) < 0.05
    assert abs(data_bytes / 2**20 - 16) <= 0.16, "the reported size is --size-mb within 1 %"
    assert f"target: {out} on {fs_type(str(out))}," in text
    assert "2 interleaved rounds" in text
    spread = r"[0-9.]+ MiB/s +[0-9.]+ s \(rounds: [0-9.]+-[0-9.]+ s\)"
    assert re.search(r"safe_ckpt\.save +" + spread, text)
    assert re.search(r"write ceiling \(same bytes, pwrite \+ fsync\) +" + spread, text)
    assert re.search(r"stock DCP save of the same tensors +" + spread, text)
    assert re.search(r"safe_ckpt at [0-9]+ % \(rounds: [0-9]+-[0-9]+ %\) of the write ceiling", text)
    assert re.search(r"safe_ckpt (faster than|slower than|as fast as) stock DCP.*: DCP took [0-9.]+x "
                     r"\(rounds: [0-9.]+-[0-9.]+x\) as long", text)
    assert "all bit-exact" in text
    assert "GB" not in text and " MB" not in text


def test_demo_saves_the_size_asked_for_at_any_rank_count():
    """--size-mb is the size saved (within 1 %), whatever the rank count: a save at TP=N writes
    N copies of the optimizer buckets, and the smallest shape is no longer a floor."""
    for size_mb, ranks in ((384, 2), (100, 1), (16, 2), (50, 3), (2000, 8)):
        spec = StateSpec.for_saved_bytes(size_mb << 20, tp=ranks)
        assert abs(spec.saved_bytes(ranks) / 2**20 - size_mb) <= size_mb / 100, (size_mb, ranks)
        assert spec.hidden % ranks == 0


def test_demo_claims_against_dcp_only_what_every_round_showed():
    """Faster or slower only when every round says so; otherwise "as fast, here"."""
    assert demo.dcp_verdict([1.0, 1.0, 1.0], [1.35, 1.2, 1.1]).startswith("safe_ckpt faster than stock DCP in every")
    assert demo.dcp_verdict([1.0, 1.0, 1.0], [0.98, 1.35, 1.2]).startswith(
        "safe_ckpt as fast as stock DCP, here (neither was faster in every round): DCP took 1.20x (rounds: 0.98-1.35x)")
    assert demo.dcp_verdict([1.0, 1.0], [0.9, 0.8]).startswith("safe_ckpt slower than stock DCP in every round")


def test_demo_names_the_filesystem_it_measured(tmp_path):
    """tmpfs measures memory, not a disk: the demo says which it wrote to."""
    if fs_type("/dev/shm") == "tmpfs":
        assert "on tmpfs, memory" in demo.filesystem_line("/dev/shm")
    line = demo.filesystem_line(str(tmp_path))
    assert line.startswith(f"target: {tmp_path} on {fs_type(os.path.realpath(tmp_path))}, ")


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


def test_demo_says_what_its_share_of_the_ceiling_compares_and_why_it_can_pass_100_percent():
    """The ratio is of rates, round by round; a round above 100 % is explained, not left as a puzzle."""
    below = demo.ceiling_line([80.0, 95.0, 90.0])
    assert below == ("safe_ckpt at 90 % (rounds: 80-95 %) of the write ceiling (its MiB/s over the ceiling's, "
                     "each round against its own)")
    above = demo.ceiling_line([98.0, 125.0, 110.0])
    assert above.startswith("safe_ckpt at 110 % (rounds: 98-125 %) of the write ceiling (its MiB/s over")
    assert above.endswith("; over 100 %: the ceiling is a separate run of plain writes, and page-cache writeback "
                          "and other load move each run, so it is a reference, not a bound")


def test_demo_warns_when_the_target_itself_was_noisy():
    """A ceiling that moved 9x between rounds makes any ratio rough: the demo says so, and
    stays quiet when the target held steady."""
    assert "varied 9.1x between rounds" in demo.noise_line([0.29, 0.75, 2.65])
    assert demo.noise_line([0.70, 0.75, 0.80]) == ""
    assert demo.noise_line([0.70]) == ""


def test_filesystem_is_the_mount_that_holds_the_path(tmp_path):
    """/tmpfoo is not on the /tmp mount: a mount point holds itself and what lies below it."""
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\ntmpfs /tmp tmpfs rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n")
    assert fs_type("/tmp", str(mounts)) == "tmpfs"
    assert fs_type("/tmp/demo", str(mounts)) == "tmpfs"
    assert fs_type("/tmpfoo/demo", str(mounts)) == "ext4"
    assert fs_type("/home/x", str(mounts)) == "ext4"


def test_an_interrupted_demo_stops_its_ranks_and_removes_its_directory(tmp_path):
    """SIGINT to the demo's own process (what `timeout -s INT` or a supervisor sends) while its ranks
    are saving: it exits 130 within seconds, prints no traceback, leaves no rank running and removes
    its temporary directory (it once waited for its ranks for ever)."""
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    # SIGINT as a terminal delivers it, whatever this runner inherited (a background job ignores it)
    restore = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = subprocess.Popen([sys.executable, "-m", "safe_ckpt", "demo", "--size-mb", "64", "--ranks", "2"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=restore)
    deadline = time.monotonic() + 240
    started = False
    while time.monotonic() < deadline and proc.poll() is None and not started:
        # both ranks are running (they take seconds to import torch and Megatron before saving)
        started = len(_children(proc.pid)) >= 2 and glob.glob(str(tmp_path / "safe_ckpt_demo_*")) != []
        time.sleep(0.05)
    assert started, "the demo's ranks never started"
    proc.send_signal(signal.SIGINT)
    try:
        output, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the interrupted demo did not exit within 60 s")
    assert proc.returncode == 130, output
    assert "Traceback" not in output and "interrupted" in output, output
    assert glob.glob(str(tmp_path / "safe_ckpt_demo_*")) == [], output


def _children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (Linux's /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found
