"""Medians, ratios and the three outputs (JSON, Markdown table, PNG chart) of a benchmark run.
Must not: run savers.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict

from . import goals

BREAKDOWN = ("plan_s", "write_s", "commit_s")  # safe_ckpt rows: where the time-to-durable went


def beside_key(residence: str, target: str) -> str:
    """The key of the write ceiling measured with a residence's GPU bytes copied beside it."""
    return f"write_beside_d2h_gbps[{residence} {target}]"


def round_key(residence: str, cache: str, rep: int) -> str:
    """Names one round of runs, so a row can be paired with the write ceiling measured just before it."""
    return f"{residence}|{cache}|{rep}"


def paired_ratios(rows: list[dict], samples: list[float], rounds: list[str]) -> list[float]:
    """Each row's rate against the write ceiling measured at the start of its own round
    (``--ceiling-each-rep``). A target that drifts between rounds moves both sides of a pair
    together, which neither the best start ceiling nor the median of all rounds does; rows
    of a round with no sample are left out."""
    by_round = dict(zip(rounds, samples))
    out = []
    for r in rows:
        ceiling = by_round.get(round_key(r["residence"], r["cache"], r["rep"])) if "rep" in r else None
        if ceiling and r.get("total_s"):
            out.append(r["bytes"] / r["total_s"] / 1e9 / ceiling)
    return out


def summarize(rows: list[dict], meta: dict) -> list[dict]:
    groups = defaultdict(list)
    for r in rows:
        groups[(r["residence"], r["target"], r["cache"], r["peer"])].append(r)
    out = []
    for (residence, target, cache, peer), rs in groups.items():
        ok = [r for r in rs if "error" not in r]
        s = {"residence": residence, "target": target, "cache": cache, "peer": peer, "runs": len(ok)}
        if not ok:
            s["error"] = rs[0].get("error", "no runs")
            out.append(s)
            continue
        for field in ("stall_s", "total_s", "extra_rss_bytes", "pinned_alloc_bytes") + BREAKDOWN:
            vals = [r[field] for r in ok if r.get(field) is not None]
            if vals:
                s[field] = statistics.median(vals)
                s[field + "_min"], s[field + "_max"] = min(vals), max(vals)
        total_bytes = ok[0]["bytes"]
        s["bytes"] = total_bytes
        s["gbps"] = total_bytes / s["total_s"] / 1e9
        ceiling = meta["ceilings"].get(f"write_gbps[{target}]")
        if ceiling:
            s["vs_write_ceiling"] = s["gbps"] / ceiling
        samples = (meta.get("write_samples_gbps") or {}).get(target)
        if samples:
            s["vs_write_ceiling_median"] = s["gbps"] / statistics.median(samples)
            paired = paired_ratios(ok, samples, (meta.get("write_sample_rounds") or {}).get(target) or [])
            if paired:
                s["vs_write_ceiling_paired"] = statistics.median(paired)
                s["vs_write_ceiling_paired_min"], s["vs_write_ceiling_paired_max"] = min(paired), max(paired)
        beside = meta["ceilings"].get(beside_key(residence, target))
        if beside:
            s["vs_write_beside_d2h"] = s["gbps"] / beside
        d2h = meta["ceilings"].get("d2h_gbps")
        dev = ok[0].get("device_bytes", 0)
        if d2h and dev:
            s["ideal_stall_s"] = dev / (d2h * 1e9)
        s.update(goals.per_rank(ok, meta, residence, peer))
        out.append(s)
    for s in out:
        peers = [p for p in out if p["residence"] == s["residence"] and p["target"] == s["target"]
                 and p["cache"] == s["cache"] and not p["peer"].startswith("safe") and "total_s" in p]
        if peers and "total_s" in s:
            best = min(peers, key=lambda p: p["total_s"])
            s["vs_best_peer"] = best["total_s"] / s["total_s"]
            s["best_peer"] = best["peer"]
            meg = [p for p in peers if p["peer"] == "megatron_sync"]
            if meg:
                s["vs_megatron_sync"] = meg[0]["total_s"] / s["total_s"]
            mas = [p for p in peers if p["peer"] == "megatron_async" and "stall_s" in p]
            if mas and "stall_s" in s:
                s["stall_vs_megatron_async"] = s["stall_s"] / mas[0]["stall_s"] if mas[0]["stall_s"] else None
    order = {"safe_sync": 0, "safe_async": 1}
    return sorted(out, key=lambda s: (s["residence"], s["target"], s["cache"],  # NAME@T beside NAME
                                      order.get(s["peer"].partition("@")[0], 2), s["peer"]))


def _f(v, fmt):
    return "" if v is None else format(v, fmt)


def _ceiling(s: dict) -> str:
    """Against the best ceiling measured at the start, and in brackets against the median of
    those measured between rounds and the median of each run against its own round's ceiling:
    a target whose speed drifts during the run shows all three."""
    between, paired = s.get("vs_write_ceiling_median"), s.get("vs_write_ceiling_paired")
    inner = "; ".join(x for x in (_f(between, ".0%"), paired and f"paired {paired:.0%}") if x)
    return (_f(s.get("vs_write_ceiling"), ".0%") + (f" ({inner})" if inner else "")).strip()


def _beside_lines(meta: dict) -> list[str]:
    lines = []
    for key, b in (meta.get("beside_d2h") or {}).items():
        gbps = meta["ceilings"].get(key)
        if gbps:
            lines.append(f"{key}: {gbps:.2f} GB/s, the write ceiling with {b['device_bytes'] / 1e9:.2f} GB a rank "
                         f"copied device-to-host beside it (best of 3; rank {b['rank']}'s writers "
                         f"{b['write_s']:.2f} s, its copy {b['copy_s']:.2f} s)")
    return lines + [f"{key}: {note}" for key, note in (meta.get("ceiling_notes") or {}).items()]


def _verified_lines(meta: dict) -> list[str]:
    lines = []
    for key, v in (meta.get("verified") or {}).items():
        if v.get("failed"):
            lines.append(f"Loaded back with stock Megatron, {key}: **FAILED**: {v['failed']}")
        elif v.get("skipped"):
            lines.append(f"Loaded back with stock Megatron, {key}: not checked: {v['skipped']}")
        else:
            lines.append(f"Loaded back with stock Megatron, {key}: {v['tensors']} tensors and {v['objects']} "
                         f"objects bit-exact over {v['ranks']} rank(s) (one more, untimed save after the runs)")
    return lines


def _runs_line(summary: list[dict], meta: dict) -> str:
    """Runs per row as asked, or, where fewer were recorded (a run cut short, runs that
    failed), as recorded: "1 of 3"."""
    asked = {True: meta.get("reps"), False: meta.get("peer_reps", meta.get("reps"))}
    done = {side: sorted({int(r.get("runs") or 0) for r in summary if r["peer"].startswith("safe_") == side})
            for side in (True, False)}
    if not summary or all(done[side] in ([], [asked[side]]) for side in (True, False)):
        return f"{asked[True]} runs per safe_ckpt row, {asked[False]} per stock peer"
    said = {side: (str(d[0]) if d[0] == d[-1] else f"{d[0]}-{d[-1]}") for side, d in done.items() if d}
    parts = [f"{said[True]} of {asked[True]} runs per safe_ckpt row"] if True in said else []
    parts += [f"{said[False]} of {asked[False]} per stock peer"] if False in said else []
    return ", ".join(parts) + " recorded"


def to_markdown(summary: list[dict], meta: dict) -> str:
    c = meta["ceilings"]
    lines = [f"# {meta.get('label', 'benchmark')}", "", meta.get("machine_line", ""), "",
             "State: " + "; ".join((meta.get("states") or {"": meta.get("state", "")}).values())
             + f"; world size {meta.get('world_size', 1)} ({meta.get('launcher', '')}); "
             f"{_runs_line(summary, meta)} (median, [min-max]).", "",
             "Ceilings (same run): " + ", ".join(f"{k} {v:.2f}" for k, v in c.items() if v), "",
             *[f"Write ceiling by writer threads, {t}: "
               + ", ".join(f"{n} threads {r:.2f} GB/s" for n, r in by.items()) + " (the best is the ceiling); "
               f"from {meta.get('ceiling_source', 'an in-memory buffer')}" for t, by in
               (meta.get("write_gbps_by_threads") or {}).items()],
             *[f"Write ceiling measured between rounds, {t}: median {statistics.median(v):.2f} GB/s "
               f"[{min(v):.2f}-{max(v):.2f}], {len(v)} runs" for t, v in (meta.get("write_samples_gbps") or {}).items()],
             *_beside_lines(meta),
             *_verified_lines(meta),
             "",
             "| residence | target | cache | peer | stall s | time-to-durable s | GB/s | vs write ceiling, best (between rounds; paired) | "
             "vs write beside D2H | vs best peer | vs megatron sync | stall vs megatron async | ideal stall s | "
             "peak extra RSS MiB | pinned alloc MiB | peak extra host / pool, worst rank |",
             "|" + "---|" * 16]
    for s in summary:
        if "error" in s:
            lines.append(f"| {s['residence']} | {s['target']} | {s['cache']} | {s['peer']} | "
                         f"n/a: {s['error'][:90]} |" + " |" * 11)
            continue
        lines.append(
            f"| {s['residence']} | {s['target']} | {s['cache']} | {s['peer']} | "
            f"{s['stall_s']:.2f} [{s['stall_s_min']:.2f}-{s['stall_s_max']:.2f}] | "
            f"{s['total_s']:.2f} [{s['total_s_min']:.2f}-{s['total_s_max']:.2f}] | {s['gbps']:.2f} | "
            f"{_ceiling(s)} | {_f(s.get('vs_write_beside_d2h'), '.0%')} | {_f(s.get('vs_best_peer'), '.2f')}{'x' if s.get('vs_best_peer') else ''} | "
            f"{_f(s.get('vs_megatron_sync'), '.2f')}{'x' if s.get('vs_megatron_sync') else ''} | "
            f"{_f(s.get('stall_vs_megatron_async'), '.3f')} | {_f(s.get('ideal_stall_s'), '.3f')} | "
            f"{_f(s.get('extra_rss_bytes', 0) / 2**20, '.0f')} | "
            f"{_f((s.get('pinned_alloc_bytes') or 0) / 2**20, '.0f')} | {_f(s.get('host_peak_vs_pool'), '.3f')} |")
    timed = [s for s in summary if all(f in s for f in BREAKDOWN)]
    if timed:
        lines += ["", "safe_ckpt rows, medians: plan (collect, exchange, validate, open the staging directory), "
                  "write (stage + write + fsync of this rank's files), commit (votes, index, publish).", "",
                  "| residence | target | cache | peer | plan s | write s | commit s | time-to-durable s |",
                  "|" + "---|" * 8]
        for s in timed:
            lines.append(f"| {s['residence']} | {s['target']} | {s['cache']} | {s['peer']} | {s['plan_s']:.3f} | "
                         f"{s['write_s']:.3f} | {s['commit_s']:.3f} | {s['total_s']:.3f} |")
    lines += _rank_lines(meta) + goals.markdown_lines(goals.evaluate(summary, meta), meta)
    return "\n".join(lines) + "\n"


def _rank_lines(meta: dict) -> list[str]:
    """What each rank had: its device-to-host share with every rank copying at once, and what
    the library resolved for its safe_ckpt saves."""
    lines = []
    for residence, share in (meta.get("d2h_shares") or {}).items():
        if share:
            lines.append(f"Device-to-host share by rank, {residence}, every rank copying at once after a barrier "
                         f"(median of {share['reps']}): {[None if g is None else round(g, 2) for g in share['gbps']]} "
                         f"GB/s; aggregate {share['aggregate_gbps']:.2f} GB/s")
    writers = "library default" if meta.get("safe_defaults") else f"--threads {meta.get('threads')}"
    for residence, opts in (meta.get("safe_options") or {}).items():
        lines.append(f"safe_ckpt by rank, {residence}: io_threads {opts['io_threads']} ({writers}), staging pool MiB "
                     f"{[None if b is None else round(b / 2**20) for b in opts['staging_budget_bytes']]} "
                     f"({pool_origin(meta)}), checksum_threads {opts['checksum_threads']} (library default); "
                     f"other savers and the ceiling {meta.get('peer_threads')} threads each")
    return [""] + lines if lines else []


def pool_origin(meta: dict) -> str:
    """Who set the safe_ckpt savers' staging pool (`run._prepare_safe`): ``--budget-gib``, the
    library, or with ``--threads`` above 0 the bench's own size; a run recorded before the
    budget was kept in its meta does not say."""
    if "budget_gib" not in meta:
        return "how it was set not recorded"
    if meta["budget_gib"]:
        return f"set by --budget-gib {meta['budget_gib']}"
    if meta.get("safe_defaults"):
        return "library default"
    return "the bench's: the GPU bytes + 0.25 GiB, at least 2 GiB"


def to_png(summary: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [s for s in summary if "total_s" in s]
    if not rows:
        return False
    labels = [f"{s['peer']}\n{s['target'].rstrip('/').split('/')[-2] if '/' in s['target'] else s['target']}"
              f" {s['cache']} {s['residence']}" for s in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.55), 5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [s["total_s"] for s in rows], 0.4, label="time-to-durable s")
    ax.bar([x + 0.2 for x in xs], [s["stall_s"] for s in rows], 0.4, label="stall s")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=70, fontsize=7)
    ax.set_ylabel("seconds (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(prefix: str, meta: dict, rows: list[dict], summary: list[dict]) -> str:
    with open(prefix + ".json", "w") as f:
        json.dump({"meta": meta, "summary": summary, "goals": goals.evaluate(summary, meta), "rows": rows}, f,
                  indent=1, default=str)
    md = to_markdown(summary, meta)
    with open(prefix + ".md", "w") as f:
        f.write(md)
    to_png(summary, prefix + ".png")
    return md
