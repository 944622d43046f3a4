"""The report of zero_stall_bench.py: a run's rows turned into a markdown table with the notes that
say what each figure covers. Reads rows, writes text: no torch, no GPU (a run's JSON can be
rebuilt anywhere: `python benchmarks/zero_stall_bench.py --rebuild RUN.json --out PREFIX`).
"""

from __future__ import annotations

import json
import statistics

MODES = {
    "window_core": "copy window alone (this mode's core: copies into the pool during the next step, "
                   "optimizer-step gate, content sums; no files)",
    "writes_beside": "the target alone: at the call, a separate process (no GIL shared; started, and its seeded "
                     "random buffer filled, before any timed step) writes as many bytes as the saved state into the "
                     "save's directory, in as many files (two of equal size per writer thread), with the save's "
                     "writer threads, niceness and fsync; no copies, no hashing; to durable = the end of its writes",
    "overlap": "this mode: async save that returns after planning (Megatron drop-in, --safe-ckpt-overlap-copy; "
               "the copies start where the window opens: `finalize_async_saves` at the next loop top, else the next step's zero_grad)",
    "safe_async": "today's safe_ckpt async save (returns once the device bytes are in the pool)",
    "dcp_async": "DCP async_save with its pinned DefaultStager, staging waited for before optimizer.step",
    "megatron_async": "stock Megatron --async-save (torch_dist, persistent worker as slime sets it, its async "
                      "queue finalized at the loop top; its first save also starts the worker)",
}


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(out: dict) -> list[dict]:
    """One line per mode: medians over its saves."""
    base = _median([s["iter_s"] for s in out.get("baseline", [])])
    base_fb = _median([s["fb_gpu_s"] for s in out.get("baseline", [])])
    lines = []
    for mode, saves in out.get("modes", {}).items():
        if isinstance(saves, dict):  # {"skipped": reason}
            lines.append({"mode": mode, "skipped": saves.get("skipped")})
            continue
        timed = [s for s in saves if not s.get("untimed") and not s.get("profiled")]
        with_save = [s["call_s"] + s["next"]["iter_s"] for s in timed]
        fb = [s["next"]["fb_gpu_s"] for s in timed]
        lines.append({
            "mode": mode, "saves": len(timed),
            "stall_s": _median([s["stall_s"] for s in timed]),
            "call_s": _median([s["call_s"] for s in timed]),
            "gate_s": _median([s.get("gate_s", 0.0) for s in timed]),
            "step_with_save_s": _median(with_save),
            "ratio": None if not base or not with_save else _median(with_save) / base,
            "fb_slowdown": None if not base_fb or not fb else _median(fb) / base_fb,
            "ttd_s": _median([s.get("ttd_s") for s in timed]),
            "pcie_tx_gbps": _median([s["next"].get("pcie_tx_gbps") for s in timed]),
            "fb_gpu_s": _median(fb),
            "fb_host_s": _median([s["next"].get("fb_host_s") for s in timed]),
            "cpu_s": _median([s["next"].get("cpu_s") for s in timed]),
            "writes": _writes(timed),
            "verified": (None if not any("verified" in s for s in saves)
                         else all(s.get("verified", True) for s in saves)),
        })
    return lines


def _writes(timed: list) -> dict | None:
    """The writer process's own figures (writes_beside): medians over the timed saves."""
    rows = [s["writes"] for s in timed if isinstance(s.get("writes"), dict)]
    if not rows:
        return None
    return {"write_s": _median([r.get("write_s") for r in rows]), "cpu_s": _median([r.get("cpu_s") for r in rows]),
            "bytes": rows[0].get("bytes"), "files": rows[0].get("files"), "threads": rows[0].get("threads"),
            "fsync": rows[0].get("fsync"), "nice": rows[0].get("nice")}


def _parts_line(summary: list) -> list[str]:
    """Where writes_beside ran: its step ratio beside the other modes' of the same run (measured only)."""
    labels = {"window_core": "copies alone", "writes_beside": "writes alone", "overlap": "copies and writes",
              "safe_async": "copies in the call, writes beside the step"}
    lines = [line for line in summary if "skipped" not in line and line["mode"].partition(":")[0] in labels]
    if not any(line["mode"].partition(":")[0] == "writes_beside" for line in lines):
        return []
    order = list(labels)
    lines.sort(key=lambda line: order.index(line["mode"].partition(":")[0]))
    parts = [f"{labels[line['mode'].partition(':')[0]]} (`{line['mode']}`) {_fmt(line['ratio'], '{:.3f}')}x step, "
             f"fwd+bwd {_fmt(line['fb_slowdown'], '{:.3f}')}x, training-thread CPU {_fmt(line['cpu_s'])} s"
             for line in lines]
    return ["", "Same run, the step after the call: " + "; ".join(parts) + "."]


def _host_table(out: dict, summary: list) -> list[str]:
    """The next step's host time per mode beside the baseline's, and the writer process's own time."""
    base = out.get("baseline", [])
    lines = ["", "Host time of the step after the call (medians): forward+backward GPU time, the training thread's "
             "time to enqueue it, the training thread's CPU time over the whole step; for writes_beside, the writer "
             "process's own: from the go to the last fsync, its CPU time (every thread), its throughput.", "",
             "| mode | fwd+bwd GPU s | fwd+bwd host enqueue s | training-thread CPU s | writer process: write s, "
             "CPU s, GB/s |", "|---|---|---|---|---|",
             f"| (no save) | {_fmt(_median([s.get('fb_gpu_s') for s in base]))} | "
             f"{_fmt(_median([s.get('fb_host_s') for s in base]))} | {_fmt(_median([s.get('cpu_s') for s in base]))} "
             "| |"]
    for line in summary:
        if "skipped" in line:
            continue
        w = line.get("writes")
        writer = ""
        if w:
            rate = w["bytes"] / w["write_s"] / 1e9 if w.get("bytes") and w.get("write_s") else None
            writer = (f"{_fmt(w['write_s'])}, {_fmt(w['cpu_s'])}, {_fmt(rate, '{:.1f}')} ({w['files']} files, "
                      f"{w['threads']} threads, fsync {w['fsync']}, nice +{w['nice']})")
        lines.append(f"| {line['mode']} | {_fmt(line.get('fb_gpu_s'))} | {_fmt(line.get('fb_host_s'))} | "
                     f"{_fmt(line.get('cpu_s'))} | {writer} |")
    return lines


def _fmt(v, spec="{:.3f}"):
    return "n/a" if v is None else spec.format(v)


def write_report(out: dict, prefix: str, label: str) -> None:
    with open(prefix + ".json", "w") as f:
        json.dump(out, f, indent=1, default=str)
    base = _median([s["iter_s"] for s in out.get("baseline", [])])
    base_fb = _median([s["fb_gpu_s"] for s in out.get("baseline", [])])
    lines = [f"# {label}", "",
             f"{out.get('gpu', '?')}, torch {out.get('torch', '?')}, megatron-core {out.get('megatron_core', '?')}; "
             f"variant `{out.get('variant')}`, {out.get('params', 0) / 1e6:.0f} M parameters, saved state "
             f"{out.get('state_bytes', 0) / 1e9:.2f} GB ({out.get('device_bytes', 0) / 1e9:.2f} GB on the GPU), "
             f"{out.get('microbatches')} micro-batches a step, target `{out.get('target')}`.", "",
             f"Step without a save: {_fmt(base)} s (median of {len(out.get('baseline', []))}; forward+backward "
             f"{_fmt(base_fb)} s of GPU time).", "",
             "| mode | saves | stall s | call s | gate s | step with save s | x step | fwd+bwd x | to durable s | "
             "PCIe TX GB/s | bytes checked |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    summary = summarize(out)
    for line in summary:
        if "skipped" in line:
            lines.append(f"| {line['mode']} | skipped: {line['skipped']} |||||||||| ")
            continue
        lines.append(
            f"| {line['mode']} | {line['saves']} | {_fmt(line['stall_s'])} | {_fmt(line['call_s'])} | "
            f"{_fmt(line['gate_s'])} | {_fmt(line['step_with_save_s'])} | {_fmt(line['ratio'], '{:.3f}')} | "
            f"{_fmt(line['fb_slowdown'], '{:.3f}')} | {_fmt(line['ttd_s'], '{:.2f}')} | "
            f"{_fmt(line['pcie_tx_gbps'], '{:.1f}')} | "
            f"{'not checked' if line['verified'] is None else 'yes' if line['verified'] else 'MISMATCH'} |")
    lines += _parts_line(summary)
    lines += _host_table(out, summary)
    lines += ["", "Modes:"] + [f"- `{m}`: {d}" for m, d in MODES.items()]
    lines += ["", "Columns: stall = host time the training thread was held by the save (the call, plus gate waits, "
              "plus DCP's staging wait before the optimizer step, plus stock Megatron's finalize waits at the loop "
              "top; for window_core and overlap also the window's opening: at the next loop top's finalize poll, counted in the gate column, or at the next step's zero_grad); step with save = the call plus the next iteration (loop top to loop top, each ending in the "
              "loss's `.item()`), x step = that over the step without a save; fwd+bwd x = the next step's "
              "forward+backward GPU time (CUDA events) over the baseline's; to durable = from the call until the "
              "checkpoint (or, for window_core, every copy; for writes_beside, every write and fsync) landed; PCIe TX = NVML's device-to-host throughput "
              "sampled during the next step; bytes checked = the saved bytes compared bit for bit with the state "
              "at the call (window_core: per-chunk hashes against a copy taken before the window; overlap: "
              "content compared with today's async save of the same state through stock readers)."]
    if out.get("notes"):
        lines += [""] + [f"- {n}" for n in out["notes"]]
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
