"""A node's save against its goals, per rank where the goal is per rank, from a run's rows.

One job: the per-rank figures of a summary row (`per_rank`: each rank's median stall and
time-to-durable, its peak extra host memory against its pool) and the goals of a run of N
ranks (`evaluate`), each with its measured numbers and PASS / FAIL (None: not measured), as
Markdown lines and one compact line per saver. Medians throughout, but memory, whose bound is
on the peak: the largest over runs. Must not: run savers, or read anything but rows and meta.
"""

from __future__ import annotations

import os
import statistics

TTD_VS_CEILING = 0.85  # aggregate time-to-durable against the aggregate ceiling (tmpfs: beside the copies)
VS_BEST_PEER = 1.5  # on disk, against the fastest stock peer
STALL_FACTOR, STALL_SLACK_S = 1.2, 0.1  # async stall per rank <= 1.2 x (GPU bytes / its share) + 0.1 s
POOL_SLACK = 1.05  # peak extra host memory per rank within its pool + 5 %


def _rank_lists(rows: list[dict], field: str) -> list[list] | None:
    """Per rank, ``field`` of every row (None where a row has no per-rank record)."""
    lists = [(r.get("by_rank") or {}).get(field) for r in rows]
    if not lists or any(v is None for v in lists) or len({len(v) for v in lists}) != 1:
        return None
    return [list(vals) for vals in zip(*lists)]


def _pool_by_rank(rows: list[dict], meta: dict, residence: str) -> list | None:
    own = _rank_lists(rows, "staging_budget_bytes")  # a safe_ckpt row: the pool each rank's save used
    if own and all(v is not None for per in own for v in per):
        return [max(per) for per in own]
    return ((meta.get("safe_options") or {}).get(residence) or {}).get("staging_budget_bytes")


def per_rank(rows: list[dict], meta: dict, residence: str, peer: str) -> dict:
    """Each rank's median stall and time-to-durable, and its peak extra host memory (largest
    over the runs) against its pool. A safe_ckpt save's extra memory is its pool plus what the
    save adds: a pinned pool allocated before the save is resident already (counted here), a
    pageable one (no CUDA) becomes resident during the save (in its RSS growth), and a pool the
    save had to allocate is in that growth too. A stock peer's is its RSS growth alone, set
    against the safe_ckpt pool of the same rank for comparison."""
    out = {}
    for field in ("stall_s", "total_s"):
        lists = _rank_lists(rows, field)
        if lists:
            out[f"{field}_by_rank"] = [statistics.median(v) for v in lists]
    extra = _rank_lists(rows, "extra_rss_bytes")
    pools = _pool_by_rank(rows, meta, residence)
    if not extra or not pools or len(pools) != len(extra) or not all(pools):
        return out
    allocs = _rank_lists(rows, "pool_allocations") or [[0] * len(runs) for runs in extra]
    held = peer.startswith("safe") and ((meta.get("staging_pool") or {}).get(residence) or {}).get("pinned", False)
    peaks = [max((pool if held and not (a or 0) else 0) + (e or 0) for e, a in zip(runs, alloc))
             for runs, alloc, pool in zip(extra, allocs, pools)]
    out["pool_bytes_by_rank"] = pools
    out["host_peak_bytes_by_rank"] = peaks
    out["host_peak_vs_pool_by_rank"] = [p / pool for p, pool in zip(peaks, pools)]
    out["host_peak_vs_pool"] = max(out["host_peak_vs_pool_by_rank"])
    return out


def _goal(s: dict, goal: str, value, bound, passed, detail: str) -> dict:
    return {"goal": goal, "residence": s["residence"], "target": s["target"], "cache": s["cache"],
            "peer": s["peer"], "value": value, "bound": bound, "passed": passed, "detail": detail}


def _ceiling_ratio(s: dict):
    for key, how in (("vs_write_ceiling_paired", "median of each run against its round's ceiling"),
                     ("vs_write_ceiling_median", "median against the median ceiling between rounds"),
                     ("vs_write_ceiling", "median against the best ceiling at the start")):
        if s.get(key) is not None:
            return s[key], how
    return None, "no write ceiling"


def _stall(s: dict, meta: dict, world: int) -> dict:
    share = (meta.get("d2h_shares") or {}).get(s["residence"])
    stalls = s.get("stall_s_by_rank")
    device = (meta.get("device_bytes_by_rank") or {}).get(s["residence"])
    if not share or not stalls or not device:
        why = "no device-to-host share measured (no GPU bytes)" if not share else "no per-rank stalls recorded"
        return _goal(s, "async stall per rank", None, None, None, f"not measured: {why}")
    worst = None
    for r, (stall, dev, gbps) in enumerate(zip(stalls, device, share["gbps"])):
        bound = STALL_FACTOR * dev / (gbps * 1e9) + STALL_SLACK_S if gbps else STALL_SLACK_S
        if worst is None or stall - bound > worst[1] - worst[2]:
            worst = (r, stall, bound, dev, gbps)
    r, stall, bound, dev, gbps = worst
    passed = all(st <= (STALL_FACTOR * d / (g * 1e9) + STALL_SLACK_S if g else STALL_SLACK_S)
                 for st, d, g in zip(stalls, device, share["gbps"]))
    return _goal(s, "async stall per rank", stall, bound, passed,
                 f"worst rank {r} of {world}: median stall {stall:.3f} s, bound {STALL_FACTOR} x "
                 f"{dev / 1e9:.2f} GB / {gbps or 0:.2f} GB/s (its share, all ranks copying) + {STALL_SLACK_S} s "
                 f"= {bound:.3f} s; stalls by rank {[round(x, 3) for x in stalls]} s")


def evaluate(summary: list[dict], meta: dict) -> list[dict]:
    """Every goal of every safe_ckpt row: on tmpfs its aggregate rate against the ceiling beside N
    device-to-host copies, on disk against the write ceiling and against the best stock peer;
    an async saver's stall per rank; every saver's peak extra host memory per rank."""
    world = meta.get("world_size", 1)
    out = []
    for s in summary:
        if not s["peer"].startswith("safe") or "total_s" not in s:
            continue
        rate = f"{s['bytes'] / 1e9:.2f} GB in {s['total_s']:.3f} s = {s['gbps']:.2f} GB/s aggregate (median)"
        if (meta.get("targets") or {}).get(s["target"]) == "tmpfs":
            beside = (meta.get("ceilings") or {}).get(f"write_beside_d2h_gbps[{s['residence']} {s['target']}]")
            v = s.get("vs_write_beside_d2h")
            out.append(_goal(s, "time-to-durable vs ceiling beside N copies (tmpfs)", v, TTD_VS_CEILING,
                             None if v is None else v >= TTD_VS_CEILING,
                             f"{rate} vs {beside:.2f} GB/s, the write ceiling beside {world} device-to-host copies"
                             if v is not None else "not measured: no ceiling beside the copies (--ceiling-beside-d2h)"))
        else:
            v, how = _ceiling_ratio(s)
            out.append(_goal(s, "time-to-durable vs write ceiling (disk)", v, TTD_VS_CEILING,
                             None if v is None else v >= TTD_VS_CEILING, f"{rate}; {how}"))
            v = s.get("vs_best_peer")
            out.append(_goal(s, "vs best stock peer (disk)", v, VS_BEST_PEER, None if v is None else v >= VS_BEST_PEER,
                             f"{s.get('best_peer')} {v * s['total_s']:.3f} s vs {s['total_s']:.3f} s (medians)"
                             if v is not None else "not measured: no stock peer ran here"))
        if "async" in s["peer"]:
            out.append(_stall(s, meta, world))
        v = s.get("host_peak_vs_pool")
        if v is None:
            out.append(_goal(s, "peak extra host memory per rank", None, POOL_SLACK, None,
                             "not measured: no per-rank memory or pool recorded"))
        else:
            r = s["host_peak_vs_pool_by_rank"].index(v)
            out.append(_goal(s, "peak extra host memory per rank", v, POOL_SLACK, v <= POOL_SLACK,
                             f"worst rank {r}: {s['host_peak_bytes_by_rank'][r] / 2**20:.0f} MiB (largest over runs) "
                             f"vs its pool {s['pool_bytes_by_rank'][r] / 2**20:.0f} MiB"))
    return out


def _verdict(g: dict) -> str:
    return "n/a" if g["passed"] is None else "PASS" if g["passed"] else "FAIL"


def markdown_lines(results: list[dict], meta: dict) -> list[str]:
    if not results:
        return []
    lines = ["", f"Goals, {meta.get('world_size', 1)} rank(s), {meta.get('ranks_on_gpu0', 0)} on GPU 0:", "",
             "| goal | residence | target | cache | peer | measured | goal | verdict | numbers |", "|" + "---|" * 9]
    for g in results:
        op = "<=" if g["goal"].startswith(("async", "peak")) else ">="
        lines.append(f"| {g['goal']} | {g['residence']} | {g['target']} | {g['cache']} | {g['peer']} | "
                     f"{'' if g['value'] is None else format(g['value'], '.3f')} | "
                     f"{op} {'' if g['bound'] is None else format(g['bound'], '.3f')} | **{_verdict(g)}** | "
                     f"{g['detail']} |")
    return lines


_SHORT = {"time-to-durable vs ceiling beside N copies (tmpfs)": "ttd/beside", "time-to-durable vs write ceiling (disk)":
          "ttd/ceiling", "vs best stock peer (disk)": "vs-best-peer", "async stall per rank": "stall-s",
          "peak extra host memory per rank": "mem/pool"}


def compact_lines(results: list[dict], meta: dict) -> list[str]:
    """One line per saver and target: ``goals N=4 shm gpu/cold safe_async: ttd/beside 0.91>=0.85 PASS; ...``."""
    lines, seen = [], {}
    for g in results:
        seen.setdefault((g["residence"], g["target"], g["cache"], g["peer"]), []).append(g)
    for (residence, target, cache, peer), gs in seen.items():
        parts = []
        for g in gs:
            op = "<=" if g["goal"].startswith(("async", "peak")) else ">="
            measured = "?" if g["value"] is None else f"{g['value']:.2f}"
            bound = "?" if g["bound"] is None else f"{g['bound']:.2f}"
            parts.append(f"{_SHORT.get(g['goal'], g['goal'])} {measured}{op}{bound} {_verdict(g)}")
        lines.append(f"goals N={meta.get('world_size', 1)} {os.path.basename(target)}({(meta.get('targets') or {}).get(target, '?')}) "
                     f"{residence}/{cache} {peer}: " + "; ".join(parts))
    return lines


def summary_lines(summary: list[dict], meta: dict) -> list[str]:
    """One line per residence, target and cache with the medians a reader of a long log needs:
    each saver's time-to-durable (and an async saver's stall), the ceilings, every rank's
    device-to-host share and what safe_ckpt resolved on each rank."""
    out = []
    keys = sorted({(s["residence"], s["target"], s["cache"]) for s in summary})
    for residence, target, cache in keys:
        rows = [s for s in summary if (s["residence"], s["target"], s["cache"]) == (residence, target, cache)]
        savers = "; ".join(
            f"{s['peer']} " + ("n/a" if "total_s" not in s else
                               f"{s['total_s']:.3f} s {s['gbps']:.1f} GB/s"
                               + (f" stall {s['stall_s']:.3f}" if "async" in s["peer"] else "")) for s in rows)
        c = meta.get("ceilings") or {}
        share = (meta.get("d2h_shares") or {}).get(residence) or {}
        opts = (meta.get("safe_options") or {}).get(residence) or {}
        pools = [None if b is None else round(b / 2**20) for b in opts.get("staging_budget_bytes") or []]
        beside = c.get(f"write_beside_d2h_gbps[{residence} {target}]")
        verified = [v for k, v in (meta.get("verified") or {}).items() if k.endswith(f" {residence} {target}")]
        out.append(
            f"node N={meta.get('world_size', 1)} {os.path.basename(target)}({(meta.get('targets') or {}).get(target, '?')}) "
            f"{residence}/{cache}: {savers} | ceilings write {c.get(f'write_gbps[{target}]') or 0:.1f}"
            + (f" beside-d2h {beside:.1f}" if beside else "") + " GB/s"
            + (f", d2h share by rank {[None if g is None else round(g, 1) for g in share['gbps']]} "
               f"agg {share['aggregate_gbps']:.1f} GB/s" if share else ", no d2h share")
            + f" | safe io_threads {opts.get('io_threads')} pool MiB {pools}"
            + f" | verified {sum(1 for v in verified if 'tensors' in v and not v.get('failed') and not v.get('skipped'))}"
              f"/{len(verified)}")
    return out
