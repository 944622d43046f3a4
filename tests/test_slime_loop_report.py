"""The slime-loop bench's report from a run's rows: the ceiling measured beside a rollout gets its
own ratio column, and torch's count of the bytes a save allocated stands beside NVML's sampled one."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import slime_loop_report as rep  # noqa: E402

GIB = 2**30


def variant(durable_s, ceiling_s, beside_s, **extra):
    return {"held_s": 0.01, "durable_s": durable_s, "gpu_extra_bytes": 0, "pinned_bytes": 0, "pinned_method": "peak",
            "ttd_over_ceiling": ceiling_s / durable_s, "ttd_over_ceiling_beside_rollout": beside_s / durable_s, **extra}


def run(torch_counted=True):
    rounds = [{"target": "/t", "round": 0, "profiled": True,
               "asleep": {"gpu_extra_bytes": 0, "durable_s": 1.0, "bytes_by_residence": {"offload_backup": 8}},
               "asleep_profile": {"HtoD": 0, "DtoH": 0, "kernels": 0, "nccl": 0}}]
    for r, (durable, ceiling, beside) in enumerate([(5.0, 4.0, 4.5), (6.0, 4.2, 5.0)], start=1):
        rounds.append({"target": "/t", "round": r, "profiled": False, "ceiling": {"seconds": ceiling},
                       "ceiling_beside_rollout": {"seconds": beside, "rollout": {"rollout_bytes": GIB}},
                       "asleep": variant(durable, ceiling, beside, save_model_s=0.01, wake_wait_s=0.0,
                                         rollout_bytes=GIB, rollout_take_s=0.1, sampler_paused_s=0.1),
                       "awake": variant(10.0, ceiling, beside), "stock": variant(20.0, ceiling, beside)})
        if torch_counted:
            for v in rep.VARIANTS:
                rounds[-1][v]["torch_gpu_extra_bytes"] = r * GIB if v == "awake" else 0
    return {"rounds": rounds, "state_bytes": 8 * 10**9, "params": 10**6}


def test_ratio_beside_a_rollout_has_its_column():
    text = rep.report(run(), "t")
    assert "beside a rollout 4.75 s" in text  # the median of the two rounds' beside-rollout ceilings
    row = next(line for line in text.splitlines() if line.startswith("| asleep |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-2] == "0.75 [0.70-0.80]"  # ceiling / durable: 4.0/5.0, 4.2/6.0
    assert cells[-1] == "0.87 [0.83-0.90]"  # beside-rollout ceiling / durable: 4.5/5.0, 5.0/6.0, median 0.867


def test_torch_counted_bytes_stand_beside_the_sampled_ones():
    text = rep.report(run(), "t")
    cells = lambda v: [c.strip() for c in next(  # noqa: E731
        line for line in text.splitlines() if line.startswith(f"| {v} |")).strip("|").split("|")]
    assert cells("asleep")[4] == "0.00 (0.00)"
    assert cells("awake")[4] == "0.00 (2.00)"  # the most of any round
    assert "took its memory 0.100 [0.100-0.100] s after each asleep save began" in text
    assert "partial" not in text
    assert "partial" in rep.report(run(torch_counted=False), "t")  # NVML alone still says what it cannot see


def test_rows_without_the_new_fields_report_as_before():
    out = run(torch_counted=False)
    for r in out["rounds"][1:]:
        r.pop("ceiling_beside_rollout")
        for v in rep.VARIANTS:
            r[v].pop("ttd_over_ceiling_beside_rollout")
        r["asleep"].pop("rollout_take_s")
    text = rep.report(out, "t")
    assert "beside a rollout" not in text and "ceiling beside a rollout / durable" not in text
