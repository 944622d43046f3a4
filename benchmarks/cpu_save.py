"""CPU benchmark: `safe_ckpt.save` against stock `torch.distributed.checkpoint.save`.

What it measures, on one process (world size 1) and host-resident tensors only:
- the same seeded, Megatron-shaped state (`safe_ckpt_lab.synthetic.build_state`, ~1 GiB by
  default) written by safe_ckpt (`SaveOptions(io_threads=N)`) and by stock DCP
  (`FileSystemWriter(path, thread_count=N, sync_files=True)`, the state flattened to
  {fqn: tensor} over the very same tensors), both fsyncing their files;
- per save: wall time until the call returns, throughput (bytes of the files written
  / time) and peak extra RSS (RSS sampled every ~2 ms from /proc/self/statm during
  the save, minus RSS just before it); also CPU seconds of the saving process and of
  everything else on the machine (a noise indicator);
- the machine's ceiling: N threads pwrite (64 MiB pieces) + fsync the same number of
  bytes from one preallocated buffer into N files, median of 3.
Every measurement runs in a fresh child process, interleaved (A, B, ceiling, A, B,
ceiling, A, B, ...). On VMs that back guest memory lazily, page-cache / tmpfs writes
into frames the host has not backed yet are several times slower; a save child has
just freed the reference tensors it built its state from, so the ceiling child also
touches and frees a scratch buffer of the same size before it writes.
The first save of each variant on each target is checked: safe_ckpt's checkpoint is
loaded through stock DCP into whole tensors and compared bit for bit with
`reference_tensors`; DCP's is loaded with `dcp.load` and compared with what was saved.

Run (from the repository root, venv active):
    python benchmarks/cpu_save.py                       # 1 GiB, 5 reps, /dev/shm + /tmp
    python benchmarks/cpu_save.py --size-mb 256 --reps 3 --targets /dev/shm /work/scratch
Writes <out>.json and <out>.md (default benchmarks/results/cpu_<hostname>_<date>).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from safe_ckpt_lab.bench.measure import RssPeak

VARIANTS = ("safe_ckpt", "dcp", "dcp_views")


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    own = os.times()
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), own.user + own.system


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def flatten_for_dcp(state, views: bool = False) -> dict:
    """{fqn: tensor} over the same memory: every ShardedTensor's / factory's `.data`;
    keys seen more than once (per-layer entries, optimizer pieces) become f"{key}.{i}".
    With ``views`` the factories are applied first, as Megatron does before saving, so DCP
    gets the very tensors safe_ckpt writes (the fc1 gate/up halves are strided views)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from safe_ckpt import compat

    if views:
        state = compat.split_megatron_state(state).sharded_tree
    found = []

    def walk(obj):
        if isinstance(obj, (ShardedTensor, ShardedTensorFactory)):
            found.append((obj.key, obj.data))
        elif isinstance(obj, (dict, list, tuple)):
            for v in obj.values() if isinstance(obj, dict) else obj:
                walk(v)

    walk(state)
    counts, seen, flat = collections.Counter(k for k, _ in found), collections.Counter(), {}
    for key, data in found:
        flat[key if counts[key] == 1 else f"{key}.{seen[key]}"] = data
        seen[key] += 1
    return flat


def load_whole(ckpt: str) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(ckpt).read_metadata()
    whole = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in meta.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    dcp.load(whole, checkpoint_id=ckpt, no_dist=True)
    return whole


def child_save(variant: str, target: str, size_mb: int, threads: int, verify: bool) -> dict:
    import gc
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp

    import safe_ckpt
    from safe_ckpt_lab.synthetic import StateSpec, bits_equal, build_state, reference_tensors

    spec = StateSpec.for_bytes(size_mb << 20)
    state = build_state(0, 1, tp=1, spec=spec)
    flat = flatten_for_dcp(state, views=variant == "dcp_views")
    root = tempfile.mkdtemp(prefix="cpu_save_bench_", dir=target)
    ckpt = os.path.join(root, "ckpt")
    try:
        if variant == "safe_ckpt":
            options = safe_ckpt.SaveOptions(io_threads=threads)
            run = lambda: safe_ckpt.save(state, ckpt, options=options)  # noqa: E731
        else:
            writer = dcp.FileSystemWriter(ckpt, thread_count=threads, sync_files=True)
            run = lambda: dcp.save(flat, storage_writer=writer, no_dist=True)  # noqa: E731
        gc.collect()
        cpu0 = cpu_seconds()
        with RssPeak() as rss:
            t0 = time.perf_counter()
            run()
            seconds = time.perf_counter() - t0
        cpu1 = cpu_seconds()
        own = cpu1[1] - cpu0[1]
        out = {"seconds": seconds, "bytes": dir_bytes(ckpt), "payload_bytes": sum(t.nbytes for t in flat.values()),
               "peak_extra_rss": rss.extra_bytes, "base_rss": rss.base, "files": len(os.listdir(ckpt)),
               "own_cpu_s": own, "other_cpu_s": max(0.0, cpu1[0] - cpu0[0] - own)}
        if verify:
            whole = load_whole(ckpt)
            expected = reference_tensors(spec, 1) if variant == "safe_ckpt" else flat
            bad = sorted(k for k in expected if k not in whole or not bits_equal(whole[k], expected[k]))
            extra = sorted(set(whole) - set(expected))
            out["verified"] = {"tensors": len(expected), "mismatched": bad, "unexpected": extra,
                               "ok": not bad and not extra}
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def child_ceiling(target: str, nbytes: int, threads: int) -> dict:
    """N threads pwrite their share of one preallocated buffer (64 MiB pieces) + fsync."""
    import numpy as np

    from safe_ckpt_lab.bench.ceilings import write_gbps

    scratch = np.ones(nbytes, dtype=np.uint8)  # like the save child's freed reference tensors
    del scratch
    gbps = write_gbps(target, nbytes, threads, reps=1)
    return {"seconds": nbytes / (gbps * 1e9), "bytes": nbytes}


def spawn(*args: str) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *args],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine(targets: list[str]) -> dict:
    from importlib.metadata import version

    import torch

    import safe_ckpt

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    mem_kb = next(int(ln.split()[1]) for ln in open("/proc/meminfo") if ln.startswith("MemTotal"))
    mounts = [ln.split()[:3] for ln in open("/proc/mounts")]

    def fs(path: str) -> str:
        real = os.path.realpath(path)
        dev, mnt, kind = max((m for m in mounts if real == m[1] or real.startswith(m[1].rstrip("/") + "/")),
                             key=lambda m: len(m[1]))
        return f"{kind} ({dev} on {mnt})"

    return {"host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(), "ram_gib": round(mem_kb / 2**20, 1),
            "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__,
            "megatron_core": version("megatron-core"), "safe_ckpt": safe_ckpt.__version__,
            "filesystems": {t: fs(t) for t in targets}}


def summarize(runs: list[dict]) -> dict:
    s = [r["seconds"] for r in runs]
    gbps = [r["bytes"] / r["seconds"] / 1e9 for r in runs]
    rss = [r["peak_extra_rss"] / 2**20 for r in runs]
    return {"reps": len(runs), "bytes": runs[0]["bytes"], "median_s": statistics.median(s), "min_s": min(s),
            "max_s": max(s), "median_gbps": statistics.median(gbps), "min_gbps": min(gbps), "max_gbps": max(gbps),
            "median_rss_mib": statistics.median(rss), "min_rss_mib": min(rss), "max_rss_mib": max(rss),
            "median_cpu_s": statistics.median(r["own_cpu_s"] for r in runs),
            "max_other_cpu_s": max(r["other_cpu_s"] for r in runs)}


def markdown(report: dict) -> str:
    m, a, res, targets = report["machine"], report["args"], report["results"], report["targets"]
    each = [(t, v) for t in targets for v in VARIANTS]
    lines = [f"# safe_ckpt vs stock DCP save on CPU ({m['host']}, {report['date']})", "",
             f"- command: `{report['command']}`",
             f"- machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, Linux {m['kernel']}",
             f"- versions: python {m['python']}, torch {m['torch']}, megatron-core {m['megatron_core']}, "
             f"safe_ckpt {m['safe_ckpt']}",
             f"- state: {report['payload_bytes'] / 2**30:.3f} GiB of tensors, world size 1, {a['threads']} writer "
             f"threads each, {a['reps']} reps per variant (fresh process each, alternating), fsync on",
             "- CPU seconds of the saving process (median): "
             + ", ".join(f"{t} {v} {res[t][v]['median_cpu_s']:.2f}" for t, v in each),
             "- noise: CPU seconds of other processes and kernel threads during a save (worst run): "
             + ", ".join(f"{t} {v} {res[t][v]['max_other_cpu_s']:.2f}" for t, v in each),
             "- `dcp` gets the fused fc1 factory `.data` (one contiguous tensor); safe_ckpt writes Megatron's "
             "gate/up split of it (two non-contiguous views), as Megatron's torch_dist layout requires; "
             "`dcp_views` gets exactly the tensors safe_ckpt writes (factories applied, views included)"]
    for t, fs in m["filesystems"].items():
        c = report["ceiling"][t]
        lines.append(f"- target `{t}`: {fs}; write ceiling {c['median_gbps']:.2f} GB/s (median of "
                     f"{len(c['seconds'])}: {c['median_s']:.3f} s; {min(c['seconds']):.3f}-{max(c['seconds']):.3f} s)")
    lines += ["", "| target | variant | median s (min-max) | GB/s | vs DCP (throughput) | vs write ceiling "
              "| peak extra RSS MiB (min-max) | RSS vs DCP |", "|---|---|---|---|---|---|---|---|"]
    for t, v in each:
        r, d, ceiling = res[t][v], res[t]["dcp"], report["ceiling"][t]["median_gbps"]
        rss_ratio = r["median_rss_mib"] / d["median_rss_mib"] if d["median_rss_mib"] > 0 else float("nan")
        lines.append(
            f"| {t} | {v} | {r['median_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f}) | {r['median_gbps']:.2f} "
            f"| {r['median_gbps'] / d['median_gbps']:.2f}x | {r['median_gbps'] / ceiling:.2f} "
            f"| {r['median_rss_mib']:.0f} ({r['min_rss_mib']:.0f}-{r['max_rss_mib']:.0f}) | {rss_ratio:.2f}x |")
    ver = report["verified"]
    lines += ["", "Verification (first save of each variant per target, loaded back through stock DCP, bit-exact): "
              + ", ".join(f"{t} {v}: {'ok' if ver[t][v]['ok'] else 'FAILED'} ({ver[t][v]['tensors']} tensors)"
                          for t, v in each), ""]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, rest = sys.argv[2], sys.argv[3:]
        if kind == "ceiling":
            out = child_ceiling(rest[0], int(rest[1]), int(rest[2]))
        else:
            out = child_save(kind, rest[0], int(rest[1]), int(rest[2]), rest[3] == "1")
        print(json.dumps(out))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=int, default=1024, help="approximate state size (MiB)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=4, help="io_threads / FileSystemWriter thread_count")
    p.add_argument("--targets", nargs="+", default=["/dev/shm", "/tmp"])
    p.add_argument("--label", default=socket.gethostname())
    p.add_argument("--out", default=None, help="output path without extension")
    args = p.parse_args()
    date = datetime.date.today().isoformat()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"cpu_{args.label}_{date}")
    from safe_ckpt_lab.synthetic import StateSpec

    payload = StateSpec.for_bytes(args.size_mb << 20).global_bytes()
    report = {"date": date, "command": " ".join(["python", *sys.argv]), "args": vars(args), "payload_bytes": payload,
              "machine": machine(args.targets), "targets": args.targets, "ceiling": {}, "results": {},
              "verified": {}, "runs": {}}
    for t in args.targets:
        runs, ceiling = {v: [] for v in VARIANTS}, []
        for rep in range(max(args.reps, 3)):
            for v in VARIANTS if rep < args.reps else ():
                r = spawn(v, t, str(args.size_mb), str(args.threads), "1" if rep == 0 else "0")
                runs[v].append(r)
                print(f"{t} {v} rep {rep}: {r['seconds']:.3f} s, {r['bytes'] / r['seconds'] / 1e9:.2f} GB/s, "
                      f"others {r['other_cpu_s']:.2f} CPU s, peak extra RSS {r['peak_extra_rss'] / 2**20:.0f} MiB",
                      file=sys.stderr)
            if rep < 3:
                ceiling.append(spawn("ceiling", t, str(payload), str(args.threads))["seconds"])
        c = statistics.median(ceiling)
        report["ceiling"][t] = {"seconds": ceiling, "median_s": c, "median_gbps": payload / c / 1e9}
        report["verified"][t] = {v: runs[v][0]["verified"] for v in VARIANTS}
        report["results"][t] = {v: summarize(runs[v]) for v in VARIANTS}
        report["runs"][t] = runs
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    md = markdown(report)
    with open(out + ".md", "w") as f:
        f.write(md)
    print(md)
    if not all(x["ok"] for t in report["verified"].values() for x in t.values()):
        sys.exit("verification FAILED; see the JSON report")


if __name__ == "__main__":
    main()
