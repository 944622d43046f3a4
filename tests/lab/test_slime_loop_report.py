"""The slime-loop bench's report from a run's rows: the ceiling measured beside a rollout gets its
own ratio column (for the asleep save only, the one variant that runs beside a rollout), torch's
count of the bytes a save allocated stands beside NVML's sampled one, the notes say how long
NVML was not sampled, rows of older runs keep their older notes, and a run's log gives back the
rows it printed."""

import json
import os
import sys

from tests.helpers.paths import BENCHMARKS

sys.path.insert(0, BENCHMARKS)

import slime_loop_report as rep  # noqa: E402

GIB = 2**30


def variant(durable_s, ceiling_s, beside_s, **extra):
    return {"held_s": 0.01, "durable_s": durable_s, "gpu_extra_bytes": 0, "pinned_bytes": 0, "pinned_method": "peak",
            "ttd_over_ceiling": ceiling_s / durable_s, "ttd_over_ceiling_beside_rollout": beside_s / durable_s, **extra}


def run(new=True):
    """Two timed rounds as the bench writes them now (``new``), or as runs before the stand-in
    stayed up wrote them (no beside-rollout ceiling, no torch count, a sampler paused for the
    stand-in's start)."""
    rounds = [{"target": "/t", "round": 0, "profiled": True,
               "asleep": {"gpu_extra_bytes": 0, "durable_s": 1.0, "bytes": 8, "bytes_by_residence": {"offload_backup": 8}},
               "asleep_profile": {"HtoD": 0, "DtoH": 0, "kernels": 0, "nccl": 0}}]
    for r, (durable, ceiling, beside) in enumerate([(5.0, 4.0, 4.5), (6.0, 4.2, 5.0)], start=1):
        row = {"target": "/t", "round": r, "profiled": False, "ceiling": {"seconds": ceiling},
               "asleep": variant(durable, ceiling, beside, save_model_s=0.01, wake_wait_s=0.0, rollout_bytes=GIB,
                                 rollout_take_s=0.5, sampler_paused_s=0.5),
               "awake": variant(10.0, ceiling, beside), "stock": variant(20.0, ceiling, beside)}
        if new:
            row["ceiling_beside_rollout"] = {"seconds": beside, "first": r % 2 == 1,
                                             "rollout": {"rollout_bytes": GIB, "rollout_take_s": 0.1}}
            for v in rep.VARIANTS:
                row[v]["torch_gpu_extra_bytes"] = r * GIB if v == "awake" else 0
        else:
            row["asleep"].pop("rollout_take_s")
            row["asleep"]["sampler_paused_s"] = 4.0
            for v in rep.VARIANTS:
                row[v].pop("ttd_over_ceiling_beside_rollout")
        rounds.append(row)
    return {"rounds": rounds, "state_bytes": 8 * 10**9, "params": 10**6}


def cells(text, v):
    line = next(line for line in text.splitlines() if line.startswith(f"| {v} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_the_ceiling_beside_a_rollout_has_its_column_for_the_asleep_save():
    text = rep.report(run(), "t")
    assert "beside a rollout 4.75 s" in text  # the median of the two rounds' beside-rollout ceilings
    assert cells(text, "asleep")[-2] == "0.75 [0.70-0.80]"  # ceiling / durable: 4.0/5.0, 4.2/6.0
    assert cells(text, "asleep")[-1] == "0.87 [0.83-0.90]"  # 4.5/5.0, 5.0/6.0
    assert cells(text, "awake")[-1] == "-" and cells(text, "stock")[-1] == "-"  # never beside a rollout
    assert "while a rollout holds the freed GPU memory" in text
    assert "in turn before and after the ceiling alone" in text
    assert "not the rollout's alone" not in text  # said only of runs that always took it second


def test_torch_counts_stand_beside_nvml_and_the_pause_is_stated():
    text = rep.report(run(), "t")
    assert cells(text, "asleep")[4] == "0.00 (0.00)"
    assert cells(text, "awake")[4] == "0.00 (2.00)"  # the most of any round: the control reads nonzero
    assert "in parentheses, where recorded, torch's peak" in text
    assert "took its memory 0.500 [0.500-0.500] s after each asleep save began" in text
    assert "of each save's time to durable, 9 [8-10] % on /t" in text  # 0.5 s of 5.0 s and of 6.0 s
    assert "(the take before those ceilings: 0.100 [0.100-0.100] s)" in text
    assert "partial" not in text and "while the rollout stand-in started" not in text


def test_a_run_that_took_the_beside_ceiling_second_says_so():
    out = run()
    for r in out["rounds"][1:]:
        del r["ceiling_beside_rollout"]["first"]
    out["options"] = {"threads": [4, 12], "rounds": 3}
    text = rep.report(out, "t")
    assert "with the faster count, after the ceiling alone" in text
    assert "(one run, after the ceiling alone: its difference from that one is not the rollout's alone)" in text
    assert "written by 4 and by 12 threads" in text and "--rounds 3`" in text  # the run's own options


def test_rows_of_older_runs_keep_their_notes():
    text = rep.report(run(new=False), "t")
    assert "beside a rollout" not in text and "ceiling beside a rollout / durable" not in text
    assert "torch's peak" not in text and "took its memory" not in text
    assert "partial" in text  # NVML alone, paused for the stand-in's start: says what it could not see
    assert "GPU sampler paused while the rollout stand-in started: 4.00 [4.00-4.00] s" in text


def test_a_runs_log_gives_back_its_rows(tmp_path):
    out = run()
    log = tmp_path / "run.log"
    with open(log, "w") as f:
        f.write("profiled asleep save: " + json.dumps(out["rounds"][0]) + "\n")
        for row in out["rounds"][1:]:
            f.write(rep.summary_line(row) + "\n")
            f.write("row " + json.dumps(row) + "\n")
    back = rep.rounds_from_log(str(log))
    assert back["rounds"] == out["rounds"]
    # a log cut before its row lines (or written before they existed): the summary lines still
    # give each round's ceiling, durable times and ratios
    only_summaries = tmp_path / "old.log"
    only_summaries.write_text("\n".join(rep.summary_line(r) for r in out["rounds"][1:]) + "\n")
    rows = rep.rounds_from_log(str(only_summaries))["rounds"]
    assert [r["ceiling"]["seconds"] for r in rows] == [4.0, 4.2]
    assert [r["asleep"]["durable_s"] for r in rows] == [5.0, 6.0]
    assert "beside-rollout 4.50s" in rep.summary_line(out["rounds"][1])


def test_the_checkpoints_comparison_says_what_differs_and_claims_no_more():
    out = run()
    out["rounds"][1]["compare"] = {
        "asleep_vs_stock": {"differ": ["common_state/shard_0_1"], "tensors": 16, "objects": 58, "only_ours": [],
                            "only_stock": [], "common_differ": ["args"], "common_args_differ": ["save"]},
        "awake_vs_stock": {"differ": ["model.w"], "tensors": 16, "objects": 58, "only_ours": ["x"],
                           "only_stock": [], "only_ours_count": 12, "common_only_stock": ["rng"]},
        "same_vs_stock": {"differ": [], "tensors": 2, "objects": 1, "only_ours": [], "only_stock": []},
        "pickled_vs_stock": {"differ": [], "tensors": 2, "objects": 1, "only_ours": [], "only_stock": ["s1"],
                             "object_bytes_differ_value_equal": ["o"]},
        "broken_vs_stock": {"differ": None, "error": "OSError: gone"},
        "empty_vs_stock": {}}
    lines = [line for line in rep.report(out, "t").splitlines() if "_vs_stock:" in line]
    assert lines[0] == ("- asleep_vs_stock: asleep's 16 tensors and 58 objects compared with stock's; items that "
                        "differ: ['common_state/shard_0_1']; of the common-state keys both hold only ['args'] differ, "
                        "and of `args` only ['save']; no item in one checkpoint only")
    assert "items that differ: ['model.w']" in lines[1] and "only in awake's: ['x'] (12 in all)" in lines[1]
    assert "common-state keys only in stock's: ['rng']" in lines[1] and "no item in one" not in lines[1]
    assert lines[2] == ("- same_vs_stock: same's 2 tensors and 1 objects compared with stock's; every item both "
                        "hold equal byte for byte; no item in one checkpoint only")
    # bytes that differ in an equal value, and an item only the stock checkpoint holds, are never "all equal"
    assert "byte for byte" not in lines[3] and "equal in value, not in bytes: ['o']" in lines[3]
    assert "only in stock's: ['s1']" in lines[3] and "no item in one" not in lines[3]
    assert lines[4] == "- broken_vs_stock: not compared (OSError: gone)"
    assert lines[5] == "- empty_vs_stock: not compared (no comparison recorded)"
