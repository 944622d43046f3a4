"""safe_ckpt through TensorStore's `s3` driver beside DCP's FsspecWriter with s3fs, on one local S3 server.

Both save the same seeded random state (one process, float32 tensors) to a local moto server
(`python -m moto.server`), each save in a fresh process so that its peak host memory (RSS,
`ru_maxrss`) is its own; each checkpoint is then loaded back with stock DCP through s3fs
(`FsspecReader`) and compared bit-exact. The server is a Python process on the same cores, so
it bounds the absolute numbers; the ratio between the two writers is the point.

  python benchmarks/s3_bench.py --size-mb 256 --rounds 2 --out benchmarks/results/s3_<machine>_<date>

Needs `moto[server]`, `s3fs` and `tensorstore` (the `test` and `bench` extras).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TENSOR_MB = 32


def _state(size_mb: int, seed: int = 7) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    n = max(1, size_mb // TENSOR_MB)
    return {f"layer{i}.weight": torch.randn(TENSOR_MB << 18, generator=g) for i in range(n)}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _s3fs_options(endpoint: str) -> dict:
    return {"endpoint_url": endpoint, "key": os.environ["AWS_ACCESS_KEY_ID"],
            "secret": os.environ["AWS_SECRET_ACCESS_KEY"], "client_kwargs": {"region_name": "us-east-1"}}


def child(peer: str, endpoint: str, bucket: str, prefix: str, size_mb: int, io_threads: int) -> dict:
    """One save in this (fresh) process; prints a JSON line."""
    import torch

    def save(state, where):
        if peer == "safe_ckpt_s3":
            from megatron.core.dist_checkpointing.mapping import ShardedTensor

            import safe_ckpt

            spec = {"driver": "s3", "bucket": bucket, "endpoint": endpoint, "aws_region": "us-east-1"}
            sharded = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in state.items()}
            safe_ckpt.save(sharded, where, options=safe_ckpt.SaveOptions(
                kvstore_spec=spec, io_threads=io_threads, progress_interval_s=0, kvstore_request_timeout_s=120))
        elif peer == "dcp_fsspec_s3fs":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            writer = FsspecWriter(f"s3://{bucket}/{where}", thread_count=io_threads, **_s3fs_options(endpoint))
            dcp.save(state, storage_writer=writer, no_dist=True)
        else:
            raise ValueError(peer)

    # A warm process, as in training: imports and clients in place before the clock and the RSS baseline.
    save({"warm": torch.arange(1024, dtype=torch.float32)}, prefix + "-warm")
    state = _state(size_mb)
    payload = sum(t.numel() * t.element_size() for t in state.values())
    baseline = _rss_bytes()
    t0 = time.perf_counter()
    save(state, prefix)
    save_s = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del state
    out = {"peer": peer, "payload_bytes": payload, "save_s": save_s, "save_gb_s": payload / save_s / 1e9,
           "rss_baseline_bytes": baseline, "rss_peak_bytes": peak, "rss_peak_over_state_bytes": peak - baseline}
    # Loaded back with stock DCP through s3fs, into fresh tensors; bit-exact against the seeded state.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    expected = _state(size_mb)
    target = {k: torch.empty_like(v) for k, v in expected.items()}
    t0 = time.perf_counter()
    dcp.load(target, storage_reader=FsspecReader(f"s3://{bucket}/{prefix}", **_s3fs_options(endpoint)), no_dist=True)
    out["load_s"] = time.perf_counter() - t0
    out["bit_exact"] = all(torch.equal(target[k].view(torch.int32), expected[k].view(torch.int32)) for k in expected)
    print("RESULT " + json.dumps(out), flush=True)
    return out


def _run_child(peer, endpoint, bucket, prefix, size_mb, io_threads) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", peer, "--endpoint", endpoint,
                           "--bucket", bucket, "--prefix", prefix, "--size-mb", str(size_mb),
                           "--io-threads", str(io_threads)], capture_output=True, text=True, env=env, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{peer} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def _summary(rows: list[dict]) -> dict:
    out = {}
    for peer in sorted({r["peer"] for r in rows}):
        mine = [r for r in rows if r["peer"] == peer]
        out[peer] = {
            "rounds": len(mine), "payload_bytes": mine[0]["payload_bytes"],
            "save_s_median": statistics.median(r["save_s"] for r in mine),
            "save_gb_s_median": statistics.median(r["save_gb_s"] for r in mine),
            "save_gb_s_best": max(r["save_gb_s"] for r in mine),
            "load_s_median": statistics.median(r["load_s"] for r in mine),
            "rss_peak_bytes_max": max(r["rss_peak_bytes"] for r in mine),
            "rss_peak_over_state_bytes_max": max(r["rss_peak_over_state_bytes"] for r in mine),
            "all_bit_exact": all(r["bit_exact"] for r in mine),
        }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--endpoint", default=None, help=argparse.SUPPRESS)
    p.add_argument("--bucket", default=None, help=argparse.SUPPRESS)
    p.add_argument("--prefix", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    if args.child:
        child(args.child, args.endpoint, args.bucket, args.prefix, args.size_mb, args.io_threads)
        return 0

    sys.path.insert(0, ROOT)
    from safe_ckpt_lab.bench.machine import machine
    from tests.helpers.s3server import start_server

    load_before = os.getloadavg()
    server = start_server()
    rows = []
    try:
        server.bucket("bench")
        peers = ["safe_ckpt_s3", "dcp_fsspec_s3fs"]
        for r in range(args.rounds):
            for peer in peers if r % 2 == 0 else peers[::-1]:  # alternate who goes first
                row = _run_child(peer, server.endpoint, "bench", f"r{r}/{peer}", args.size_mb, args.io_threads)
                row["round"] = r
                rows.append(row)
                print(f"round {r} {peer}: save {row['save_s']:.2f} s ({row['save_gb_s'] * 1e3:.1f} MB/s), "
                      f"load {row['load_s']:.2f} s, peak RSS {row['rss_peak_bytes'] / 2**20:.0f} MiB "
                      f"(+{row['rss_peak_over_state_bytes'] / 2**20:.0f} MiB over the state), "
                      f"bit-exact {row['bit_exact']}", flush=True)
    finally:
        server.stop()
    summary = _summary(rows)
    s, d = summary["safe_ckpt_s3"], summary["dcp_fsspec_s3fs"]
    report = {
        "machine": machine(), "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "size_mb": args.size_mb, "io_threads": args.io_threads, "server": "moto server (python -m moto.server), "
        "same host, loopback", "rows": rows, "summary": summary,
        "ratio_save_throughput_safe_over_dcp": s["save_gb_s_median"] / d["save_gb_s_median"],
        "ratio_peak_rss_over_state_safe_over_dcp": s["rss_peak_over_state_bytes_max"] / max(1, d["rss_peak_over_state_bytes_max"]),
    }
    print(json.dumps({k: report[k] for k in ("summary", "ratio_save_throughput_safe_over_dcp",
                                              "ratio_peak_rss_over_state_safe_over_dcp")}, indent=1))
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(report, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(_markdown(report))
    return 0


def _markdown(rep: dict) -> str:
    m = rep["machine"]
    lines = [f"# safe_ckpt (TensorStore s3) vs DCP FsspecWriter + s3fs, local S3 server ({m['date']})", "",
             f"Machine: {m['machine_line']}; load average before {rep['load_average_before'][0]:.1f}, "
             f"after {rep['load_average_after'][0]:.1f} (other work shared the cores).",
             f"Server: {rep['server']}. State: {rep['size_mb']} MB of seeded random float32 tensors in one process; "
             f"{rep['io_threads']} writer threads for both; each save in a fresh process; every checkpoint loaded "
             "back with stock DCP (FsspecReader, s3fs) and compared bit-exact.", "",
             "| peer | rounds | save s (median) | MB/s (median) | MB/s (best) | load s (median) | peak RSS MiB | "
             "peak RSS over the state MiB | bit-exact |", "|---|---|---|---|---|---|---|---|---|"]
    for peer, s in rep["summary"].items():
        lines.append(f"| {peer} | {s['rounds']} | {s['save_s_median']:.2f} | {s['save_gb_s_median'] * 1e3:.1f} | "
                     f"{s['save_gb_s_best'] * 1e3:.1f} | {s['load_s_median']:.2f} | {s['rss_peak_bytes_max'] / 2**20:.0f} | "
                     f"{s['rss_peak_over_state_bytes_max'] / 2**20:.0f} | {s['all_bit_exact']} |")
    lines += ["", f"Save throughput ratio safe_ckpt / DCP+s3fs (medians): "
                  f"{rep['ratio_save_throughput_safe_over_dcp']:.2f}x; peak host memory over the state, "
                  f"safe_ckpt / DCP+s3fs: {rep['ratio_peak_rss_over_state_safe_over_dcp']:.2f}x.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
