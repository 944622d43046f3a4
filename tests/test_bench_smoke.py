"""The benchmark harness runs end to end at a small size on CPU (the CI smoke test)."""

import json
import subprocess
import sys


def test_bench_harness_smoke(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "safe_ckpt.bench", "--gib", "0.03", "--reps", "2", "--peer-reps", "1",
           "--targets", str(tmp_path / "target"), "--cache", "cold,warm", "--peer-cache", "cold",
           "--peers", "safe_sync,safe_async,dcp_sync,megatron_sync,safe_sync_nosum", "--ceiling-each-rep",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {(s["peer"], s["cache"]): s for s in report["summary"]}
    for peer in ("safe_sync", "safe_async"):
        for cache in ("cold", "warm"):
            s = rows[(peer, cache)]
            assert s["runs"] == 2 and s["total_s"] > 0 and s["gbps"] > 0 and s["stall_s"] <= s["total_s"] + 1e-6
            assert s["plan_s"] > 0 and s["write_s"] > 0 and s["commit_s"] > 0
    for r in report["rows"]:  # each row's breakdown is of that save: the parts fit inside its time
        if r["peer"].startswith("safe"):
            assert r["plan_s"] + r["write_s"] + r["commit_s"] <= r["total_s"] + 2e-3, r
    assert rows[("safe_sync_nosum", "cold")]["runs"] == 2
    assert rows[("dcp_sync", "cold")]["runs"] == 1 and ("dcp_sync", "warm") not in rows
    assert "vs_best_peer" in rows[("safe_sync", "cold")]
    assert report["meta"]["ceilings"][f"write_gbps[{tmp_path / 'target'}]"] > 0
    assert len(report["meta"]["write_samples_gbps"][str(tmp_path / "target")]) == 2 * 2  # a run per round
    assert rows[("safe_sync", "cold")]["vs_write_ceiling_median"] > 0
    megatron = rows[("megatron_sync", "cold")]
    import torch

    if not torch.cuda.is_available():
        assert "needs CUDA" in megatron["error"]
    md = (tmp_path / "bench.md").read_text()
    assert "| safe_sync |" in md and "| plan s | write s | commit s |" in md
    sync = rows[("safe_sync", "cold")]  # both ceilings side by side in the row's cell
    assert f"| {sync['vs_write_ceiling']:.0%} ({sync['vs_write_ceiling_median']:.0%}) |" in md
    # a run cut short keeps its rows and meta: the report can be rebuilt from them alone
    (tmp_path / "bench.md").unlink()
    proc = subprocess.run([sys.executable, "-m", "safe_ckpt.bench", "--rebuild", str(out)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rebuilt = (tmp_path / "bench.md").read_text()
    assert "rebuilt from" in rebuilt and rebuilt.count("| safe_sync |") == md.count("| safe_sync |")


def _multi_rank(tmp_path, launcher_cmd):
    out = tmp_path / "bench"
    cmd = [*launcher_cmd, "--gib", "0.02", "--reps", "1", "--threads", "2", "--targets", str(tmp_path / "t"),
           "--peers", "safe_sync,safe_async,dcp_sync", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["meta"]["world_size"] == 2
    rows = {s["peer"]: s for s in report["summary"]}
    assert rows["safe_sync"]["runs"] == 1 and rows["safe_sync"]["total_s"] > 0
    return report


def test_bench_two_ranks_with_torchrun(tmp_path):
    report = _multi_rank(tmp_path, [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                    "-m", "safe_ckpt.bench"])
    assert report["meta"]["launcher"] == "torchrun"


def test_bench_two_ray_actors(tmp_path):
    import pytest

    pytest.importorskip("ray")
    report = _multi_rank(tmp_path, [sys.executable, "-m", "safe_ckpt.bench", "--ray-actors", "2"])
    assert report["meta"]["launcher"] == "ray"


def test_item_overhead_benchmark_smoke(tmp_path):
    """benchmarks/item_overhead.py runs at a small size, checks its first save bit for bit
    through stock DCP, and reports every saver."""
    import os

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "item_overhead.py")
    cmd = [sys.executable, script, "--items", "40", "--reps", "1", "--distinct", "--target", str(tmp_path / "t"),
           "--out", str(tmp_path / "items")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "items.json").read_text())
    assert [r["saver"] for r in report["rows"]] == ["safe_ckpt", "dcp", "ceiling"]
    assert report["meta"]["items"] == 40 and report["meta"]["bytes"] > 40 * 4096 * 4
    assert all(r["median_s"] > 0 for r in report["rows"])
    assert "| safe_ckpt |" in (tmp_path / "items.md").read_text()


def test_gil_handoffs_benchmark_smoke(tmp_path):
    """benchmarks/gil_handoffs.py runs at a small size and reports every case, with and
    without writers, the writers at their priority and 5 nicer, and cleans its files up."""
    import os

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gil_handoffs.py")
    target = tmp_path / "gil"
    cmd = [sys.executable, script, "--writers", "2", "--piece-mib", "1", "--chunks", "4", "--calls", "3",
           "--rounds", "1", "--target", str(target)]
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), ".."))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if '"case"' in line]
    assert {(r["case"], r["writers"], r["writer_nice"]) for r in rows} == {
        (k, w, n) for k in ("release", "hold", "torch", "python") for w, n in ((0, 0), (2, 0), (2, 5))}
    assert all(r["us_per_chunk_median"] > 0 for r in rows)
    assert not target.exists()
