"""The report of slime_loop_bench.py: a run's rows (its JSON, or its log when the run was cut short)
turned into the markdown table and the notes that say what each figure does and does not cover.

It only reads rows and writes text: no torch, no GPU, so a committed log can be rebuilt anywhere
(`python benchmarks/slime_loop_bench.py --rebuild-log LOG --out PREFIX --label LABEL`).
"""

from __future__ import annotations

import json
import os
import re
import statistics

VARIANTS = ("asleep", "awake", "stock")


def summary_line(row) -> str:
    """One round on one line (the log's human-readable record; the `row` line beside it is the full one)."""
    parts = [f"{row['target']} r{row['round']} ceiling {row['ceiling']['seconds']:.2f}s"
             + (f" beside-rollout {row['ceiling_beside_rollout']['seconds']:.2f}s" if "ceiling_beside_rollout" in row
                else "")]
    for v in VARIANTS:
        x = row[v]
        paused = f" paused {x['sampler_paused_s']:.2f}s" if "sampler_paused_s" in x else ""
        parts.append(f"{v}: held {x['held_s']:.3f}s durable {x['durable_s']:.2f}s ({x['ttd_over_ceiling']:.2f} of "
                     f"ceiling) gpu+{x['gpu_extra_bytes'] / 2**30:.2f}GiB{paused} pinned {x['pinned_bytes'] / 2**30:.2f}GiB")
    return " | ".join(parts)


# The optional "paused" group: logs written before the sampler's pause was recorded lack it.
SUMMARY_VARIANT = re.compile(r"(\w+): held ([\d.]+)s durable ([\d.]+)s \(([\d.]+) of ceiling\) "
                             r"gpu\+([\d.]+)GiB(?: paused ([\d.]+)s)? pinned ([\d.]+)GiB")


def rounds_from_log(path: str) -> dict:
    """A run's rows from its log (for a run cut short before it wrote its JSON): the profiled
    save and the tweaks as printed, each round from its `row` line or, in logs written before
    those lines existed, from its summary line (held, durable, ratio, GPU and pinned GiB)."""
    out = {"rounds": [], "tweaks": [], "from_log": os.path.basename(path)}
    for line in open(path, errors="replace"):
        if "number of parameters on" in line and "params" not in out:
            out["params"] = int(line.rsplit(":", 1)[1])
        elif line.startswith("profiled asleep save: "):
            row = json.loads(line.split(": ", 1)[1])
            out["rounds"].append(row)
            out["state_bytes"] = row["asleep"]["bytes"]
        elif line.startswith("tweak "):
            out["tweaks"].append(json.loads(line[len("tweak "):]))
        elif line.startswith("row "):
            row = json.loads(line[len("row "):])
            out["rounds"] = [r for r in out["rounds"] if (r["target"], r["round"]) != (row["target"], row["round"])]
            out["rounds"].append(row)
        elif " ceiling " in line and "| asleep: held" in line:
            head, *parts = line.strip().split(" | ")
            target, rnd, _, ceiling = head.split()[:4]
            if any((r["target"], r["round"]) == (target, int(rnd[1:])) for r in out["rounds"]):
                continue
            row = {"target": target, "round": int(rnd[1:]), "profiled": False,
                   "ceiling": {"seconds": float(ceiling.rstrip("s"))}}
            for part in parts:
                m = SUMMARY_VARIANT.match(part)
                row[m.group(1)] = {"held_s": float(m.group(2)), "durable_s": float(m.group(3)),
                                   "ttd_over_ceiling": float(m.group(4)), "gpu_extra_bytes": float(m.group(5)) * 2**30,
                                   "pinned_bytes": float(m.group(7)) * 2**30}
                if m.group(6) is not None:
                    row[m.group(1)]["sampler_paused_s"] = float(m.group(6))
            out["rounds"].append(row)
    return out


def spread(values: list, fmt: str) -> str:
    """median [min-max]; one value alone (with two rounds the median is their mean: the range says more)."""
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def header(out: dict, label: str) -> list:
    model = (f"GPTModel of {out['params'] / 1e6:.0f} M parameters" if "params" in out else "GPTModel")
    return [f"# {label}", "",
            (f"{out['gpu']}, torch {out['torch']}, megatron-core {out['megatron_core']}; " if "gpu" in out else "") +
            f"{model} with the distributed optimizer (bf16, fp32 main parameters and Adam moments): "
            f"{out['state_bytes'] / 1e9:.2f} GB per checkpoint, the whole training state in one "
            "torch_memory_saver region with a CPU backup.", "",
            "- `stock`: slime's own path: `wake_up` (torch_memory_saver `resume()`, clear memory), Megatron's "
            "`save_checkpoint` (synchronous, as slime saves without `--async-save`), `sleep` (clear memory, `pause()`);",
            "- `awake`: the same bracket with safe_ckpt's `save_checkpoint`, asynchronous, its pinned pool as large as "
            "the state (allocated before the round, as at startup);",
            "- `asleep`: what slime's actor does with `--ckpt-backend safe`: the RNG state taken, the state dict built "
            "and written in the background from the CPU backup, while a rollout stand-in (another process) fills 80 % "
            "of the freed GPU memory and runs matmuls; then the next `wake_up`'s wait for the save." +
            (" The stand-in is up for the whole run, as SGLang's engines are in slime's colocated mode; each rollout "
             "only takes the memory and the GPU." if persistent_rollout(out) else ""),
            "", "Loop held: from `save_model`'s call until the next step may start (for `asleep`: `save_model`'s own "
            "time plus what `wake_up` waited after the rollout). Neither bracket includes slime's process-group "
            "teardown and rebuild, which only add to `stock` and `awake`. Peak extra GPU: NVML's used bytes above "
            "the asleep state's, less the rollout stand-in's" + ("; in parentheses, where recorded, torch's peak of the "
            "bytes allocated in the saving process above those before the save" if torch_counted(out) else "") +
            ". Pinned host: torch's pinned allocator and "
            "safe_ckpt's pool. Write ceiling: the same bytes written by " +
            " and by ".join(str(t) for t in out.get("options", {}).get("threads", [8, 16])) + " threads with fsync into the "
            "same target before each round, the faster" + (("; measured again, " + (
                "the same thread counts, the faster, in turn before and after the ceiling alone"
                if alternating(out["rounds"]) else "with the faster count, after the ceiling alone") +
            ", while a rollout holds the freed GPU memory and runs its matmuls, as beside the asleep save (the last "
            "column)") if beside_ceilings(out) else "") + ". Held and durable times are the median and [min-max] of the "
            "target's rounds; the other timed columns are medians, the byte columns the most of any round. "
            "Command: `python benchmarks/slime_loop_bench.py --targets /dev/shm/...,/tmp/... --rounds "
            f"{out.get('options', {}).get('rounds', 2)}` "
            "(`bash benchmarks/gpu_suite.sh slimeloop`).", ""]


def persistent_rollout(out: dict) -> bool:
    return any("rollout_take_s" in r.get("asleep", {}) for r in out["rounds"])


def alternating(timed: list) -> bool:
    """Whether the rounds took the two ceilings in alternating order (runs before that did not)."""
    return any(r.get("ceiling_beside_rollout", {}).get("first") for r in timed)


def torch_counted(out: dict) -> bool:
    return any("torch_gpu_extra_bytes" in r.get("asleep", {}) for r in out["rounds"])


def beside_ceilings(out: dict) -> bool:
    return any("ceiling_beside_rollout" in r for r in out["rounds"])


def not_measured() -> list:
    return ["Not measured: work in the training process beside the asleep save's background build and writes. "
            "In slime the training process goes on with its own work (`update_weights`) while the save's threads "
            "read the CPU backup and write; this bench runs no CPU-bound stand-in in the main thread, only the "
            "rollout in another process. So the cost the asleep path moves off the loop into the background (its CPU time, "
            "memory bandwidth and the GIL shared with that work) is not shown: its loop-held figure is the time "
            "the loop waits, not what the save costs the work beside it.", ""]


def pinned_cell(out: dict, rows: list, v: str) -> str:
    """Pinned bytes of one variant on one target. Rows measured with the peak stat say what the save
    had checked out; older rows read the bytes torch's allocator held after the save less before,
    which is 0 once the blocks are cached: the run's most is then what the path holds."""
    here = [r[v]["pinned_bytes"] / 2**30 for r in rows]
    if all(r[v].get("pinned_method") == "peak" for r in rows):
        return f"{max(here):.2f}"
    run = [r[v]["pinned_bytes"] / 2**30 for r in out["rounds"] if not r["profiled"] and v in r]
    if max(run) == max(here) and min(here) == max(here):
        return f"{max(here):.2f}"
    return f"{max(run):.2f} (read per round: {', '.join(f'{x:.2f}' for x in here)})"


def gpu_cell(prof: dict | None, rows: list, v: str) -> str:
    most = max(r[v]["gpu_extra_bytes"] for r in rows) / 2**30
    if all("torch_gpu_extra_bytes" in r[v] for r in rows):
        return f"{most:.2f} ({max(r[v]['torch_gpu_extra_bytes'] for r in rows) / 2**30:.2f})"
    if v != "asleep" or prof is None:
        return f"{most:.2f}"
    return f"{prof['asleep']['gpu_extra_bytes'] / 2**30:.2f} profiled (timed: {most:.2f}, partial)"


def target_table(out: dict, prof: dict | None, target: str, rows: list) -> list:
    med = lambda v, k: statistics.median(r[v][k] for r in rows)  # noqa: E731
    has = lambda v, k: all(k in r[v] for r in rows)  # noqa: E731
    ceiling = statistics.median(r["ceiling"]["seconds"] for r in rows)
    beside = all("ceiling_beside_rollout" in r for r in rows)
    n = len(rows)
    head = (f"## {target} ({n} round{'s' if n != 1 else ''}; write ceiling {ceiling:.2f} s = "
            f"{out['state_bytes'] / ceiling / 1e9:.2f} GB/s{', median' if n > 1 else ''}")
    if beside:
        b = statistics.median(r["ceiling_beside_rollout"]["seconds"] for r in rows)
        head += f"; beside a rollout {b:.2f} s = {out['state_bytes'] / b / 1e9:.2f} GB/s"
    lines = [head + ")", "",
             "| variant | loop held (s) | save_model (s) | wake_up waited (s) | peak extra GPU (GiB, most) "
             "| pinned host (GiB, most) | time to durable (s) | ceiling / durable |"
             + (" ceiling beside a rollout / durable |" if beside else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if beside else "")]
    for v in VARIANTS:
        sm = f"{med(v, 'save_model_s'):.3f}" if v == "asleep" and has(v, "save_model_s") else "-"
        ww = f"{med(v, 'wake_wait_s'):.3f}" if v == "asleep" and has(v, "wake_wait_s") else "-"
        lines.append(f"| {v} | {spread([r[v]['held_s'] for r in rows], '.3f')} | {sm} | {ww} | "
                     f"{gpu_cell(prof, rows, v)} | {pinned_cell(out, rows, v)} | "
                     f"{spread([r[v]['durable_s'] for r in rows], '.2f')} | {spread([r[v]['ttd_over_ceiling'] for r in rows], '.2f')} |"
                     + ((f" {spread([r[v]['ttd_over_ceiling_beside_rollout'] for r in rows], '.2f')} |"
                         if v == "asleep" else " - |") if beside else ""))
    lines.append("")
    a = rows[0]["asleep"]
    if "rollout_bytes" in a:
        lines += [f"Rollout stand-in beside the asleep save: {a['rollout_bytes'] / 2**30:.1f} GiB of the freed "
                  "GPU memory, matmuls for the rollout time.", ""]
    if has("asleep", "sampler_paused_s") and not has("asleep", "rollout_take_s"):
        paused = [r["asleep"]["sampler_paused_s"] for r in rows]
        durable = [r["asleep"]["durable_s"] for r in rows]
        lines += [f"GPU sampler paused while the rollout stand-in started: {spread(paused, '.2f')} s per asleep "
                  f"round, against the save's {spread(durable, '.2f')} s to durable.", ""]
    return lines


def notes(out: dict, prof: dict | None, timed: list) -> list:
    lines = []
    if persistent_rollout(out):
        took = [r["asleep"]["rollout_take_s"] for r in timed if "rollout_take_s" in r.get("asleep", {})]
        alone = [r["ceiling_beside_rollout"]["rollout"]["rollout_take_s"] for r in timed
                 if "rollout_take_s" in r.get("ceiling_beside_rollout", {}).get("rollout", {})]
        by_target: dict = {}
        for r in timed:
            if "rollout_take_s" in r.get("asleep", {}):
                by_target.setdefault(r["target"], []).append(100 * r["asleep"]["rollout_take_s"] / r["asleep"]["durable_s"])
        shares = "; ".join(f"{spread(v, '.0f')} % on {t}" for t, v in by_target.items())
        lines += [f"- The rollout stand-in, already up, took its memory {spread(took, '.3f')} s after each asleep "
                  "save began. NVML's device-wide figure is not sampled during that take (the stand-in's size is "
                  f"not known until it has taken it): of each save's time to durable, {shares}, its planning and "
                  "first writes included; and what the device gained during it is discounted as the stand-in's, "
                  "so an allocation the save made then and kept would be missed for the whole rollout. Torch's count (in parentheses) "
                  "covers the whole save, for every allocation made through torch; the profiled save above was "
                  "sampled by NVML throughout. The ceiling beside a rollout" +
                  ("" if alternating(timed) else " (one run, after the ceiling alone: its difference from that "
                   "one is not the rollout's alone)") + " starts writing once the stand-in has its memory, while the asleep save runs through that "
                  "take, which it also slows" +
                  (f" (the take before those ceilings: {spread(alone, '.3f')} s)." if alone else ".")]
    elif prof is not None:
        paused = [r["asleep"]["sampler_paused_s"] for r in timed if "sampler_paused_s" in r.get("asleep", {})]
        when = (f"here {spread(paused, '.2f')} s" if paused else
                "not recorded in this run; it spans the child's Python start, torch import, CUDA init and "
                "allocation, typically longer than the tmpfs save")
        lines += [f"- Peak extra GPU of `asleep`: from the profiled save ({prof['asleep']['gpu_extra_bytes'] / 2**30:.2f} "
                  "GiB; no rollout beside it, the whole save sampled; it ran on the first target, and the asleep save's "
                  "GPU use does not depend on where it writes). The timed rounds' figure is partial: the sampler is "
                  "paused from the rollout stand-in's start until it reports ready, because its allocation is not yet "
                  f"known to be discounted ({when}). It covers only the time outside that start: a save durable "
                  "before the stand-in is ready (the tmpfs one, under 1 s, can be) is not seen at all, and its timed "
                  "figure is not a measurement.", ]
    legacy = [r[v] for r in timed for v in VARIANTS if v in r and r[v].get("pinned_method") != "peak"]
    if legacy:
        stock_first = next((r["stock"]["pinned_bytes"] for r in timed if r["stock"]["pinned_bytes"] > 0), 0)
        lines += ["- Pinned host in this run: the bytes torch's pinned allocator held after the save less before. "
                  "Torch caches freed pinned blocks, so a path's later saves read 0 for the same use"
                  + (f": `stock`'s {stock_first / 2**30:.2f} GiB were allocated in its first save and kept cached by "
                     "torch for the later ones" if stock_first else "") +
                  ". The figure shown is the most over the run's rounds (what the path holds); the per-round "
                  "readings follow it. Later runs take the peak of the bytes checked out during the save instead.", ]
    peak = [r[v] for r in timed for v in VARIANTS if v in r and r[v].get("pinned_method") == "peak"]
    if peak:
        lines += ["- Pinned host: the peak of the bytes torch's pinned allocator had checked out during the save "
                  "(peak stats reset before it) less those checked out before, plus safe_ckpt's pool; cached blocks "
                  "reused by a later save count in it again (torch keeps its peaks per block size: an approximation).", ]
    return lines + ([""] if lines else [])


def report(out: dict, label: str) -> str:
    lines = header(out, label)
    if out.get("from_log"):
        lines += [f"Rebuilt from the run's log, `{out['from_log']}` (the run was stopped before it wrote its "
                  "JSON; rounds it did not finish are left out).", ""]
    prof = next((r for r in out["rounds"] if r["profiled"]), None)
    if prof:
        p = prof["asleep_profile"]
        lines += [f"Profiled asleep save (no rollout beside it, the GPU sampled throughout): {p['HtoD']} host-to-device "
                  f"copies, {p['kernels']} kernels, {p['nccl']} NCCL calls, {p['DtoH']} device-to-host copies; peak "
                  f"extra GPU {prof['asleep']['gpu_extra_bytes'] / 2**30:.2f} GiB; durable after "
                  f"{prof['asleep']['durable_s']:.2f} s (under the profiler); bytes by residence "
                  f"{prof['asleep']['bytes_by_residence']}.", ""]
    if out.get("tweaks"):
        lines += ["Asleep saves with one setting changed (no rollout beside them, one each, same target as the "
                  "profiled save):", "", "| setting | time to durable (s) | planning (s) | writing (s) |", "|---|---|---|---|"]
        lines += [tweak_row(t) for t in out["tweaks"]]  # in the order they ran
        lines.append("")
        lines += [f"- Item writes of the `trace` save: {json.dumps(t['trace'])}" for t in out["tweaks"] if t.get("trace")]
    timed = [r for r in out["rounds"] if not r["profiled"] and all(v in r for v in VARIANTS)]
    for target in dict.fromkeys(r["target"] for r in timed):
        lines += target_table(out, prof, target, [r for r in timed if r["target"] == target])
    lines += notes(out, prof, timed)
    lines += not_measured()
    compare = next((r["compare"] for r in out["rounds"] if "compare" in r), None)
    if compare:
        lines += [compare_line(name, c) for name, c in compare.items()]
    return "\n".join(lines) + "\n"


def compare_line(name: str, c: dict) -> str:
    """What two variants' checkpoints of the same step hold, item by item (from
    tests/helpers/megatron_evidence.compare_contents, which names ``a_vs_b``'s sides ours and stock):
    which items differ, which only one side holds, and, where Megatron's common state differs,
    which of its entries and `args` fields do, so that a reader can tell a save's own settings
    (where it wrote, its options) from a difference in the training state. Claims no more than
    the comparison recorded: common-state keys held by one side only are named only where the
    run recorded them."""
    first, _, second = name.partition("_vs_")
    if not second:
        first, second = "the first", "the second"
    if c.get("differ") is None:
        return f"- {name}: not compared ({c.get('error') or 'no comparison recorded'})"
    text = (f"- {name}: {first}'s {c.get('tensors')} tensors and {c.get('objects')} objects compared with "
            f"{second}'s; ")
    differ, raw = c["differ"], c.get("object_bytes_differ_value_equal") or []
    if differ:
        text += f"items that differ: {differ}"
    else:
        text += "every item both hold equal in value" if raw else "every item both hold equal byte for byte"
    if raw:
        text += f"; equal in value, not in bytes: {raw}"
    if c.get("common_differ"):
        text += f"; of the common-state keys both hold only {c['common_differ']} differ"
        if c.get("common_args_differ"):
            text += f", and of `args` only {c['common_args_differ']}"
    for side, key in ((first, "common_only_ours"), (second, "common_only_stock")):
        if c.get(key):
            text += f"; common-state keys only in {side}'s: {c[key]}"
    only = False
    for side, key in ((first, "only_ours"), (second, "only_stock")):
        if c.get(key):
            only = True
            count = c.get(f"{key}_count")
            text += f"; only in {side}'s: {c[key]}" + (f" ({count} in all)" if count and count > len(c[key]) else "")
    return text + ("" if only else "; no item in one checkpoint only")


CEILING_ROWS = {
    "ceiling": "write ceiling, measured here",
    "ceil_pageable": "the ceiling's loop from new pageable memory",
    "ceil_hostalloc": "the ceiling's loop from newly allocated cudaHostAlloc memory (the backup's kind)",
    "ceil_registered": "the ceiling's loop from newly cudaHostRegister'ed memory (the staging pool's kind)",
    "ceil_backup": "the ceiling's loop from the CPU backup itself, 64 MiB writes",
    "ceil_backup2m": "the ceiling's loop from the CPU backup itself, 2 MiB writes",
}


def tweak_row(t: dict) -> str:
    if "ceiling" not in t:
        return f"| {t['tweak']} | {t['durable_s']:.2f} | {t['timings']['plan_s']:.3f} | {t['timings']['write_s']:.2f} |"
    c = t["ceiling"]
    beside = f"; the ceiling just before: {c['ceiling_s']:.2f} s" if "ceiling_s" in c else ""
    return (f"| {CEILING_ROWS.get(t['tweak'], t['tweak'])} ({c['threads']} threads, fsync{beside}) | "
            f"{c['seconds']:.2f} | - | - |")


def write_report(out: dict, prefix: str, label: str) -> None:
    with open(prefix + ".json", "w") as f:
        json.dump(out, f, indent=1, default=str)
    text = report(out, label)
    with open(prefix + ".md", "w") as f:
        f.write(text)
    print(text)
