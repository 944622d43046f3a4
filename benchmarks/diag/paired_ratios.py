"""Every committed 8.6 GiB bench run's safe_ckpt rows set against the write ceiling of their own
round, beside the two statistics the reports have always given (best start ceiling, median of
the rounds).

The bench measures the ceiling again at the start of every round (``--ceiling-each-rep``).
Runs from before 2026-12-02's round names (``write_sample_rounds``) did not record which
round a sample belongs to; for them the names are rebuilt from the bench's loop order
(residence, then target, then cache, then rep: one sample per round), and a run whose sample
count does not match that order is listed as skipped. Reads only committed files.

    python benchmarks/diag/paired_ratios.py [benchmarks/results] > benchmarks/results/paired_ratios_<date>.md
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys

from safe_ckpt_lab.bench import report


def _rounds(meta: dict, rows: list[dict], target: str) -> tuple[list[str] | None, str]:
    named = (meta.get("write_sample_rounds") or {}).get(target)
    if named:
        return named, "recorded"
    seen = [r for r in rows if r["target"] == target]
    residences = list(dict.fromkeys(r["residence"] for r in seen))
    caches = list(dict.fromkeys(r["cache"] for r in seen))
    keys = [report.round_key(res, c, i) for res in residences for c in caches for i in range(meta["reps"])]
    return (keys, "rebuilt") if len(keys) == len(meta["write_samples_gbps"][target]) else (None, "")


def run_lines(prefix: str) -> list[str]:
    with open(prefix + ".meta.json") as f:
        meta = json.load(f)
    with open(prefix + ".rows.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    name, out = os.path.basename(prefix), []
    for target, samples in (meta.get("write_samples_gbps") or {}).items():
        rounds, how = _rounds(meta, rows, target)
        if rounds is None:
            out.append(f"| {name} | {target} | skipped: {len(samples)} samples do not match the loop order |"
                       + " |" * 5)
            continue
        ok = [r for r in rows if r["target"] == target and "error" not in r and r["peer"] in ("safe_sync", "safe_async")]
        for s in report.summarize(ok, meta):
            paired = report.paired_ratios([r for r in ok if (r["peer"], r["cache"]) == (s["peer"], s["cache"])],
                                          samples, rounds)
            out.append(f"| {name} | {target} | {s['peer']} {s['cache']} | {s['total_s']:.3f} | "
                       f"{s['vs_write_ceiling']:.0%} | {s['vs_write_ceiling_median']:.0%} | "
                       f"{statistics.median(paired):.0%} [{min(paired):.0%}-{max(paired):.0%}] | {len(paired)}, {how} |")
    return out


def main(argv: list[str]) -> int:
    folder = argv[0] if argv else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results")
    lines = ["| run | target | row | time-to-durable s (median) | vs best start ceiling | vs median of rounds | "
             "vs its own round's ceiling, median [min-max] | runs, round names |", "|" + "---|" * 8]
    for meta_path in sorted(glob.glob(os.path.join(folder, "h200_1gpu_*.meta.json"))):
        lines += run_lines(meta_path[:-len(".meta.json")])
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
