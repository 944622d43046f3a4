"""The benchmark report's ratios against the write ceiling, on hand-built rows (no saves run)."""

import pytest

from safe_ckpt_lab.bench import report

GB = 10**9


def _row(peer, cache, rep, total_s, nbytes=10 * GB):
    return {"peer": peer, "residence": "gpu", "target": "/t", "cache": cache, "rep": rep, "stall_s": total_s,
            "total_s": total_s, "bytes": nbytes, "device_bytes": nbytes}


def _meta(samples, rounds, best):
    meta = {"ceilings": {"write_gbps[/t]": best}, "write_samples_gbps": {"/t": samples}}
    if rounds is not None:
        meta["write_sample_rounds"] = {"/t": rounds}
    return meta


def test_each_run_is_set_against_its_own_rounds_ceiling():
    # the target halves its speed after round 1, and the save with it: paired, every run is at
    # 80 %; against the median of all rounds (15 GB/s) the same runs read 67 % and 133 %
    rows = [_row("safe_sync", "cold", 0, 10 * GB / (0.8 * 20 * GB)), _row("safe_sync", "cold", 1, 10 * GB / (0.8 * 10 * GB)),
            _row("safe_sync", "cold", 2, 10 * GB / (0.8 * 20 * GB))]
    rounds = [report.round_key("gpu", "cold", i) for i in range(3)]
    assert report.paired_ratios(rows, [20.0, 10.0, 20.0], rounds) == pytest.approx([0.8, 0.8, 0.8])
    s = report.summarize(rows, _meta([20.0, 10.0, 20.0], rounds, best=20.0))[0]
    assert s["vs_write_ceiling_paired"] == pytest.approx(0.8)
    assert s["vs_write_ceiling_paired_min"] == pytest.approx(0.8) == s["vs_write_ceiling_paired_max"]
    assert s["vs_write_ceiling"] == pytest.approx(s["gbps"] / 20.0)
    md = report.to_markdown([s], _meta([20.0, 10.0, 20.0], rounds, best=20.0))
    assert f"| {s['vs_write_ceiling']:.0%} ({s['vs_write_ceiling_median']:.0%}; paired 80%) |" in md


def test_rows_pair_only_with_their_own_residence_cache_and_round():
    rounds = [report.round_key("gpu", "cold", 0), report.round_key("gpu", "warm", 0)]
    rows = [_row("safe_sync", "warm", 0, 1.0), _row("safe_sync", "warm", 1, 1.0),  # round 1: no sample, left out
            {**_row("safe_sync", "cold", 0, 1.0), "residence": "opt-pinned"}]
    assert report.paired_ratios(rows, [5.0, 20.0], rounds) == pytest.approx([0.5])


def test_a_run_without_round_names_reports_no_paired_ratio():
    # results recorded before the rounds were named (rebuilt from their files) keep their old cell
    rows = [_row("safe_async", "cold", 0, 1.0), _row("safe_async", "cold", 1, 1.0)]
    s = report.summarize(rows, _meta([10.0, 12.0], None, best=12.0))[0]
    assert "vs_write_ceiling_paired" not in s and s["vs_write_ceiling_median"] == pytest.approx(10 / 11)
    md = report.to_markdown([s], _meta([10.0, 12.0], None, best=12.0))
    assert f"| {s['vs_write_ceiling']:.0%} ({s['vs_write_ceiling_median']:.0%}) |" in md


def test_runs_per_row_as_asked_or_as_recorded():
    from safe_ckpt_lab.bench.report import _runs_line

    meta = {"reps": 3, "peer_reps": 1}
    full = [{"peer": "safe_sync", "runs": 3}, {"peer": "safe_async", "runs": 3}, {"peer": "dcp_sync", "runs": 1}]
    assert _runs_line(full, meta) == "3 runs per safe_ckpt row, 1 per stock peer"
    assert _runs_line([], meta) == "3 runs per safe_ckpt row, 1 per stock peer"
    cut = [{"peer": "safe_sync", "runs": 1}, {"peer": "safe_async", "runs": 2}, {"peer": "dcp_sync", "runs": 1}]
    assert _runs_line(cut, meta) == "1-2 of 3 runs per safe_ckpt row, 1 of 1 per stock peer recorded"
    failed = [{"peer": "safe_sync", "runs": 0}]
    assert _runs_line(failed, meta) == "0 of 3 runs per safe_ckpt row recorded"
    no_runs_field = [{"peer": "safe_sync"}, {"peer": "megatron_sync", "runs": 1}]
    assert _runs_line(no_runs_field, meta) == "0 of 3 runs per safe_ckpt row, 1 of 1 per stock peer recorded"
