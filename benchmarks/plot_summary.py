"""The README's results chart, from the committed bench reports it cites.

One job: read the summary rows of the canonical runs (GPU-resident state to tmpfs and to
disk, optimizer state in pinned host memory) and draw, per scenario, how long each saver
takes until the checkpoint is durable and how long an asynchronous save stalls training.
Must not: measure anything (the numbers are the committed files'), or read any other file.

    python benchmarks/plot_summary.py            # writes docs/summary.png, prints the numbers
"""

from __future__ import annotations

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
RUNS = {  # scenario -> (report, residence, target)
    "GPU state to tmpfs": ("h200_1gpu_8.6gib_16threads_tmpfs_9rounds_2026-12-02.json", "gpu", None),
    "GPU state to disk": ("h200_1gpu_8.6gib_8threads_disk_every_peer_2026-12-02.json", "gpu", None),
    "optimizer in pinned\nhost memory to tmpfs": ("h200_1gpu_8.6gib_host_optimizer_2026-12-01.json", "opt-pinned", None),
}
DURABLE = [("safe_sync", "safe_ckpt"), ("dcp_sync", "DCP"), ("megatron_sync", "Megatron"),
           ("megatron_async", "Megatron async")]
STALL = [("safe_async", "safe_ckpt async"), ("dcp_async_pinned", "DCP async, pinned"),
         ("megatron_async", "Megatron async")]
COLORS = {"safe": "#1f77b4", "dcp": "#ff7f0e", "megatron": "#7f7f7f"}


def medians(report: str, residence: str) -> dict[str, dict]:
    """Cold-cache summary rows of one report, by peer."""
    with open(os.path.join(RESULTS, report)) as f:
        summary = json.load(f)["summary"]
    return {s["peer"]: s for s in summary if s["residence"] == residence and s["cache"] == "cold"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "..", "docs", "summary.png"))
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    names = list(RUNS)
    for ax, pairs, key, title in ((ax1, DURABLE, "total_s", "seconds until the checkpoint is durable"),
                                  (ax2, STALL, "stall_s", "seconds an async save stalls training")):
        for y, name in enumerate(names):
            rows = medians(*RUNS[name][:2])
            shown = [(peer, label) for peer, label in pairs if peer in rows]
            if key == "total_s" and "megatron_sync" in rows:
                shown = [(p, lbl) for p, lbl in shown if p != "megatron_async"]
            for i, (peer, label) in enumerate(shown):
                value = rows[peer][key]
                bar_y = y + (i - (len(shown) - 1) / 2) * 0.25
                ax.barh(bar_y, value, height=0.23, color=COLORS[peer.split("_")[0]])
                ax.text(value * 1.08, bar_y, f"{label} {value:.2f} s", va="center", fontsize=7)
                print(f"{name.replace(chr(10), ' ')} | {peer} | {key} {value:.2f} s")
        ax.set_xscale("log")
        ax.set_xlim(0.02, 1000)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("seconds (log scale; shorter is better)", fontsize=8)
    ax2.set_yticklabels([])
    fig.suptitle("8.6 GiB Megatron-shaped state, one rank, one H200 host (16 cores), cold cache; stock DCP and Megatron in the same runs", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {os.path.normpath(args.out)}")


if __name__ == "__main__":
    main()
