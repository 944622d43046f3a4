"""The benchmark loop: build state, measure ceilings, run every peer ``reps`` times per
(residence, target, cache) in rotating order, and write medians beside the ceilings.

Single process: ``python -m safe_ckpt.bench ...``; several GPUs: the same under
``torchrun --nproc-per-node N -m safe_ckpt.bench ...`` (each rank saves its own shard;
times are the slowest rank's). Must not: be imported by the library.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import sys
import time

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import ceilings, measure, peers, report
from .machine import fs_type, machine
from .state import build


@dataclass(frozen=True)
class Placement:
    """Which GPU a rank uses and over what its default group talks."""

    device: int | None  # None: no GPU
    backend: str
    ranks_per_gpu: int


def placement(local_rank: int, local_world: int, devices: int) -> Placement:
    """One rank per GPU where there are enough; otherwise the host's ranks share its GPUs
    (``torchrun --nproc-per-node 8`` on one GPU: every rank on device 0) and the default group
    is gloo only, since NCCL refuses two ranks on one device. A host's save is contended where
    the ranks meet anyway: memory bandwidth, page cache, disk, cores, pinned memory."""
    if devices <= 0:
        return Placement(None, "gloo", 0)
    if local_world > devices:
        return Placement(local_rank % devices, "gloo", -(-local_world // devices))
    return Placement(local_rank, "cpu:gloo,cuda:nccl", 1)


def _init_dist() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    where = placement(int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                      torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if where.device is not None:
        torch.cuda.set_device(where.device)
    dist.init_process_group(where.backend)
    return dist.get_rank(), dist.get_world_size()


def _everyone(mine, group) -> list:
    """Every rank's ``mine``, in rank order, the same list on every rank."""
    if group is None:
        return [mine]
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return gathered


def _max_over_ranks(values: dict, group) -> dict:
    if group is None:
        return values
    gathered = _everyone(values, group)
    out = {}
    for k in values:
        vals = [g[k] for g in gathered if isinstance(g.get(k), (int, float))]
        out[k] = max(vals) if vals else values[k]
    return out


def _empty_caches() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch._C._host_emptyCache()


def run(args) -> str:
    rank, world = _init_dist()
    group = dist.new_group(backend="gloo") if world > 1 else None
    meta = machine()
    launcher = os.environ.get("SAFE_CKPT_BENCH_LAUNCHER") or ("torchrun" if "TORCHELASTIC_RUN_ID" in os.environ
                                                               else "single process")
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    sharing = _everyone(device, group).count(device) if device is not None else 0  # rank 0's GPU's ranks
    meta.update(label=args.label, world_size=world, reps=args.reps, peer_reps=args.peer_reps, preset=args.preset,
                threads=args.threads, launcher=launcher, backend=dist.get_backend(), ranks_on_gpu0=sharing)
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        open(args.out + ".rows.jsonl", "w").close()  # this run's rows only
    targets = [t.rstrip("/") for t in args.targets.split(",")]
    meta["targets"] = {t: fs_type(t) for t in targets}
    chosen = peers.PEERS if args.peers == "all" else tuple(args.peers.split(","))
    rows: list[dict] = []
    meta["ceilings"] = {}
    source = None  # the write ceiling's source bytes, built once
    for residence in args.residences.split(","):
        state = build(args.preset, args.gib, residence, rank, world)
        meta["state"] = state.description
        meta.setdefault("states", {})[residence] = state.description
        if rank == 0:
            print(f"state: {state.description}", flush=True)
        if "d2h_gbps" not in meta["ceilings"]:
            meta["ceilings"]["d2h_gbps"] = ceilings.d2h_gbps(min(max(state.device_bytes, 1 << 28), 8 << 30))
            meta["ceilings"]["memcpy_gbps"] = ceilings.memcpy_gbps()
        budget = int(args.budget_gib * 2**30) if args.budget_gib else max(2 << 30, state.device_bytes + (256 << 20))
        if any(p.startswith("safe") for p in chosen):
            import safe_ckpt

            t0 = time.perf_counter()
            safe_ckpt.prepare_staging_pool(budget)  # once per process, as a training job would at startup
            meta.setdefault("staging_pool", {})[residence] = {"bytes": budget, "alloc_s": time.perf_counter() - t0}
        for target in targets:
            os.makedirs(target, exist_ok=True)
            key = f"write_gbps[{target}]"
            if key not in meta["ceilings"]:
                if source is None:
                    source = ceilings.source_buffer(state.nbytes)
                    meta["ceiling_source"] = f"{len(source) / 1e9:.2f} GB of distinct random bytes in host memory"
                by_threads = {n: _ceiling_rate(target, state, n, 3, source, rank, world, group)
                              for n in ceilings.thread_counts(args.threads)}
                meta.setdefault("write_gbps_by_threads", {})[target] = by_threads
                meta.setdefault("ceiling_threads", {})[target] = max(by_threads, key=by_threads.get)
                meta["ceilings"][key] = max(by_threads.values())
                if rank == 0:
                    print(f"ceiling write {target}: {meta['ceilings'][key]:.2f} GB/s (by threads: "
                          f"{ {n: round(r, 2) for n, r in by_threads.items()} })", flush=True)
            beside = report.beside_key(residence, target)
            if args.ceiling_beside_d2h and beside not in meta["ceilings"]:
                if source is None:
                    source = ceilings.source_buffer(state.nbytes)
                _ceiling_beside_d2h(beside, target, state, meta, source, rank, world, group)
            if not args.ceiling_each_rep:
                source = None  # the savers should not run beside a state-sized buffer they never read
            if rank == 0:
                _save_meta(args.out, meta)
            for cache in args.cache.split(","):
                for rep in range(args.reps):
                    if args.ceiling_each_rep:
                        rate = _ceiling_rate(target, state, meta["ceiling_threads"][target], 1, source, rank, world,
                                             group)
                        meta.setdefault("write_samples_gbps", {}).setdefault(target, []).append(rate)
                        # which rows ran right after this sample: the report pairs each save with it
                        meta.setdefault("write_sample_rounds", {}).setdefault(target, []).append(
                            report.round_key(residence, cache, rep))
                    order = list(chosen[rep % len(chosen):] + chosen[:rep % len(chosen)])
                    for peer in order:
                        stock = not peer.startswith("safe")
                        if stock and (rep >= args.peer_reps or cache not in args.peer_cache.split(",")):
                            continue
                        row = _one(peer, state, target, cache, residence, args, budget, group)
                        row.update(rep=rep, bytes=state.nbytes * world, device_bytes=state.device_bytes)
                        rows.append(row)
                        if rank == 0:
                            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()},
                                  flush=True)
                            with open(args.out + ".rows.jsonl", "a") as f:  # survives an interrupted run
                                f.write(json.dumps(row) + "\n")
                            _save_meta(args.out, meta)
            for peer in [p for p in args.verify if p in chosen]:
                _verify(peer, state, target, residence, args, budget, meta, rank, group)
            if args.count_h2d and torch.cuda.is_available():
                meta.setdefault("memcpy_events", {})
                for peer in chosen:
                    try:
                        counts = measure.count_memcpy(
                            lambda p=peer, st=state: peers.resolve(p)(st, f"{target}/h2d_{p}", args.threads, budget))
                    except Exception as exc:
                        counts = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                    meta["memcpy_events"][f"{peer}|{residence}|{target}"] = counts
                    shutil.rmtree(f"{target}/h2d_{peer}", ignore_errors=True)
        del state
        _empty_caches()
    meta["host_stats_keys"] = measure.host_stats_keys()
    summary = report.summarize(rows, meta)
    md = ""
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        md = report.write(args.out, meta, rows, summary)
        print(md, flush=True)
    dist.barrier()
    failed = {k: v for k, v in (meta.get("verified") or {}).items() if v.get("failed")}
    if failed:  # after the report, so the run's rows are kept; but the run must not pass
        raise RuntimeError("safe_ckpt bench: a save did not load back bit-exact with stock Megatron: "
                           + "; ".join(f"{k}: {v['failed']}" for k, v in failed.items()))
    return md


def _verify(peer, state, target, residence, args, budget, meta, rank, group) -> None:
    """One more ``peer`` save, loaded back with stock Megatron and compared on every rank
    (`verify.across_ranks`); the outcome goes to ``meta["verified"]``."""
    from . import verify

    dist.barrier()
    entry = verify.across_ranks(state, f"{target}/verify_{peer}",
                                lambda st, p: peers.resolve(peer)(st, p, args.threads, budget),
                                lambda mine: _everyone(mine, group), rank, peers.Unavailable)
    meta.setdefault("verified", {})[f"{peer} {residence} {target}"] = entry
    if rank == 0:
        print(f"verify {peer} {residence} {target}: {entry}", flush=True)
        _save_meta(args.out, meta)  # a run cut short later still reports it (--rebuild)


def _ceiling_rate(target, state, threads, reps, source, rank, world, group) -> float:
    """Aggregate write-ceiling rate (GB/s) of every rank writing its share at once, as the saves do.
    Once per round of runs (``--ceiling-each-rep``), it shows drift of the target beside the best."""
    dist.barrier()
    seconds = ceilings.write_seconds(os.path.join(target, f"rank{rank}"), state.nbytes, threads, reps, source)
    slowest = _max_over_ranks({"s": seconds}, group)["s"]
    return state.nbytes // threads * threads * world / slowest / 1e9


def _ceiling_beside_d2h(key, target, state, meta, source, rank, world, group) -> None:
    """The write ceiling with this rank's GPU bytes copied device-to-host beside it (best of 3),
    every rank at once (a rank without GPU bytes writes only); recorded under ``key``, or, where
    it cannot run, why (``ceiling_notes``). Every rank reaches the same collectives whatever
    fails on one of them; only strings outlive a failure, so the buffer is freed at once."""
    threads = meta["ceiling_threads"][target]
    copy, note = None, None
    try:
        copy = ceilings.device_to_host_copier(state.plain.values())
    except Exception as exc:
        note = f"failed on rank {rank}: {type(exc).__name__}: {exc}"[:300]
    try:
        ready = _gathered(note, copy is not None, group)
        if ready.note or not ready.gpu:
            meta.setdefault("ceiling_notes", {})[key] = ready.note or "not measured: no GPU bytes in this state"
            return
        dist.barrier()
        best = None
        try:
            best = ceilings.write_beside_copy(os.path.join(target, f"rank{rank}"), state.nbytes, threads,
                                              copy or (lambda: None), 3, source)
        except Exception as exc:  # a ceiling that cannot be measured must not cost the run its rows
            note = f"failed on rank {rank}: {type(exc).__name__}: {exc}"[:300]
        done = _gathered(note, True, group)
        slowest = _max_over_ranks({"s": best.seconds if best else 0.0}, group)["s"]
        if done.note:
            meta.setdefault("ceiling_notes", {})[key] = done.note
            return
        meta["ceilings"][key] = state.nbytes // threads * threads * world / slowest / 1e9
        meta.setdefault("beside_d2h", {})[key] = {"write_s": best.write_s, "copy_s": best.copy_s, "rank": rank,
                                                 "device_bytes": state.device_bytes}
    finally:
        if copy is not None:
            copy.close()
        del copy
        _empty_caches()


@dataclass(frozen=True)
class _Gathered:
    note: str | None  # the first rank's failure, if any
    gpu: bool  # some rank has GPU bytes


def _gathered(note: str | None, gpu: bool, group) -> _Gathered:
    """Every rank's failure note and GPU flag, the same answer on every rank."""
    everyone = _everyone({"note": note, "gpu": gpu}, group)
    notes = [e["note"] for e in everyone if e["note"]]
    return _Gathered(notes[0] if notes else None, any(e["gpu"] for e in everyone))


def _save_meta(prefix: str, meta: dict) -> None:
    """Keep what the report needs beside the rows, so a run cut short can still be reported
    (`--rebuild PREFIX`)."""
    with open(prefix + ".meta.json", "w") as f:
        json.dump(meta, f, indent=1, default=str)


def rebuild(prefix: str) -> str:
    """The report of a run from its `.meta.json` and `.rows.jsonl` (e.g. one stopped at a time limit)."""
    with open(prefix + ".meta.json") as f:
        meta = json.load(f)
    with open(prefix + ".rows.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    meta["label"] = f"{meta.get('label', 'benchmark')} (rebuilt from {len(rows)} recorded rows)"
    return report.write(prefix, meta, rows, report.summarize(rows, meta))


def _resolves(peer: str) -> bool:
    try:
        peers.resolve(peer)
    except ValueError:
        return False
    return True


def _one(peer, state, target, cache, residence, args, budget, group) -> dict:
    row = {"peer": peer, "residence": residence, "target": target, "cache": cache}
    path = f"{target}/ck_{peer}"
    if cache == "cold":
        _empty_caches()
    dist.barrier()
    before = measure.host_alloc_bytes()
    try:
        with measure.RssPeak() as rss:
            result = peers.resolve(peer)(state, path, args.threads, budget)
        result["extra_rss_bytes"] = rss.extra_bytes
        after = measure.host_alloc_bytes()
        result["pinned_alloc_bytes"] = None if before is None or after is None else after - before
        row.update(_max_over_ranks(result, group))
    except peers.Unavailable as exc:
        row["error"] = str(exc)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    dist.barrier()
    shutil.rmtree(path, ignore_errors=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="safe-ckpt bench", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="anchor", choices=["anchor", "qwen3-4b-dp8"],
                    help="state shape and rank count to benchmark (default: anchor)")
    ap.add_argument("--gib", type=float, default=None, help="state size per rank (default: the preset's)")
    ap.add_argument("--residences", default="gpu", help="comma list of gpu, opt-pinned, opt-pageable")
    ap.add_argument("--targets", default="/dev/shm/safe_ckpt_bench",
                    help="comma list of directories to save into (default: /dev/shm/safe_ckpt_bench)")
    ap.add_argument("--peers", default="all",
                    help=f"comma list of {', '.join(peers.PEERS + peers.EXTRA_PEERS)} (all: the first {len(peers.PEERS)}); "
                         "NAME@T: that saver with T writer threads")
    ap.add_argument("--reps", type=int, default=3, help="timed runs of each saver (default: 3)")
    ap.add_argument("--peer-reps", type=int, default=None, help="runs of the stock peers (default: --reps)")
    ap.add_argument("--cache", default="cold", help="cold, warm or cold,warm (pinned host cache)")
    ap.add_argument("--peer-cache", default=None, help="cache modes for the stock peers (default: --cache)")
    ap.add_argument("--threads", type=int, default=8, help="writer threads per rank (default: 8)")
    ap.add_argument("--budget-gib", type=float, default=None, help="safe_ckpt staging budget")
    ap.add_argument("--count-h2d", action="store_true", help="count memcpy events per peer with the profiler")
    ap.add_argument("--ceiling-each-rep", action="store_true",
                    help="also measure the write ceiling once per round of runs (reports its median beside the best)")
    ap.add_argument("--ceiling-beside-d2h", action="store_true",
                    help="also measure the write ceiling with the state's GPU bytes copied device-to-host beside it")
    ap.add_argument("--verify", default="safe_sync,safe_async",
                    help="after each target's timed runs, one more save by each of these safe_ckpt peers, loaded "
                         "back with stock Megatron and compared bit for bit on every rank; a mismatch fails the "
                         "run after its report is written ('none': skip)")
    ap.add_argument("--label", default=None, help="a name for this run in its report")
    ap.add_argument("--out", default=None, help="output prefix (writes .json, .md, .png)")
    ap.add_argument("--rebuild", metavar="PREFIX", default=None,
                    help="only write the report of an earlier run from PREFIX.meta.json and PREFIX.rows.jsonl")
    ap.add_argument("--ray-actors", type=int, default=0,
                    help="run as N Ray actors (one per GPU), as slime launches training, instead of in-process")
    args = ap.parse_args(argv)
    if args.rebuild:
        print(rebuild(os.path.abspath(args.rebuild)))
        return 0
    chosen = peers.PEERS if args.peers == "all" else tuple(args.peers.split(","))
    for peer in chosen:
        try:
            peers.resolve(peer)
        except ValueError as exc:
            ap.error(f"--peers: {exc}")
    args.verify = [] if args.verify == "none" else [p for p in args.verify.split(",") if p]
    wrong = [p for p in args.verify if not p.startswith("safe") or not _resolves(p)]
    if wrong:
        ap.error(f"--verify takes safe_ckpt peers ({', '.join(p for p in peers.RUNNERS if p.startswith('safe'))}) "
                 f"or 'none', not {', '.join(wrong)}")
    unused = [p for p in args.verify if p not in chosen]
    if unused and "--verify" in (argv if argv is not None else sys.argv[1:]):
        print(f"safe-ckpt bench: --verify {', '.join(unused)}: not among --peers, not verified", file=sys.stderr)
    unchecked = [p for p in chosen if p.startswith("safe") and "@" in p and p not in args.verify]
    if unchecked:
        print(f"safe-ckpt bench: {', '.join(unchecked)}: not loaded back (name it in --verify to check it)",
              file=sys.stderr)
    args.peer_reps = args.reps if args.peer_reps is None else args.peer_reps
    args.peer_cache = args.peer_cache or args.cache
    args.label = args.label or f"safe_ckpt bench {datetime.date.today().isoformat()}"
    args.out = os.path.abspath(args.out or f"benchmarks/results/bench_{socket.gethostname()}_{int(time.time())}")
    if args.ray_actors:
        from .ray_launch import launch

        rest = list(argv if argv is not None else sys.argv[1:])
        i = rest.index("--ray-actors")
        launch(args.ray_actors, rest[:i] + rest[i + 2:] + ["--out", args.out, "--label", args.label])
        return 0
    try:
        run(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
