"""The benchmark loop: build state, measure ceilings, run every peer ``reps`` times per
(residence, target, cache) in rotating order, and write medians beside the ceilings.

Single process: ``python -m safe_ckpt_lab.bench ...``; several GPUs: the same under
``torchrun --nproc-per-node N -m safe_ckpt_lab.bench ...`` (each rank saves its own shard;
times are the slowest rank's). Must not: be imported by the library.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import ceilings, goals, measure, node, peers, report
from .machine import fs_type, machine
from .state import build
from .collective import _ceiling_beside_d2h, _ceiling_rate, _d2h_share, _empty_caches, _everyone


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


def _at(args, meta: dict | None = None, phase: str | None = None) -> str:
    """Seconds since the run began, as a log prefix; with ``phase``, also kept in
    ``meta["at_s"]`` so a report shows where a long run spent its time."""
    start = getattr(args, "t0", None)  # parts called on their own (tests) have no run clock
    if start is None:
        return "[      - s]"
    elapsed = time.perf_counter() - start
    if meta is not None and phase:
        meta.setdefault("at_s", {})[phase] = round(elapsed, 1)
    return f"[{elapsed:7.1f} s]"


def run(args) -> str:
    args.t0 = time.perf_counter()
    rank, world = _init_dist()
    group = dist.new_group(backend="gloo") if world > 1 else None
    everyone = lambda mine: _everyone(mine, group)  # noqa: E731
    meta = machine()
    launcher = os.environ.get("SAFE_CKPT_BENCH_LAUNCHER") or ("torchrun" if "TORCHELASTIC_RUN_ID" in os.environ
                                                               else "single process")
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    sharing = everyone(device).count(device) if device is not None else 0  # rank 0's GPU's ranks
    local = node.local_ranks(everyone)
    args.peer_threads = node.peer_threads(args.threads, local)  # the stock peers' and the ceilings' writers
    meta.update(label=args.label, world_size=world, reps=args.reps, peer_reps=args.peer_reps, preset=args.preset,
                threads=args.threads, peer_threads=args.peer_threads, ranks_on_host=local, launcher=launcher,
                backend=dist.get_backend(), ranks_on_gpu0=sharing,
                safe_defaults=args.threads == 0,  # the safe_ckpt peers on the library's per-host defaults
                budget_gib=args.budget_gib or None)  # None: the pool left to the library, or the bench's rule
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        open(args.out + ".rows.jsonl", "w").close()  # this run's rows only
    targets = [t.rstrip("/") for t in args.targets.split(",")]
    meta["targets"] = {t: fs_type(t) for t in targets}
    chosen = peers.PEERS if args.peers == "all" else tuple(args.peers.split(","))
    rows: list[dict] = []
    meta["ceilings"] = {}
    source = None  # the write ceilings' source bytes: one copy per host, built once
    for residence in args.residences.split(","):
        state = build(args.preset, args.gib, residence, rank, world)
        meta["state"] = state.description
        meta.setdefault("states", {})[residence] = state.description
        meta.setdefault("device_bytes_by_rank", {})[residence] = everyone(state.device_bytes)
        if rank == 0:
            print(f"{_at(args, meta, f'state {residence}')} state: {state.description}", flush=True)
        if "d2h_gbps" not in meta["ceilings"]:  # one rank alone, the others waiting: the link uncontended
            dist.barrier()
            alone = ceilings.d2h_gbps(min(max(state.device_bytes, 1 << 28), 8 << 30)) if rank == 0 else None
            _empty_caches()
            meta["ceilings"]["d2h_gbps"] = everyone(alone)[0]
            meta["ceilings"]["memcpy_gbps"] = ceilings.memcpy_gbps()
        _d2h_share(residence, state, meta, rank, group)
        _at(args, meta, f"d2h share {residence}")
        for target in targets:  # every ceiling before any pool is pinned: they never hold memory together
            os.makedirs(target, exist_ok=True)
            key = f"write_gbps[{target}]"
            beside = report.beside_key(residence, target)
            if source is None and (key not in meta["ceilings"] or args.ceiling_each_rep
                                   or (args.ceiling_beside_d2h and beside not in meta["ceilings"])):
                source = node.host_source(state.nbytes, rank, everyone, dist.barrier)
                meta["ceiling_source"] = (f"{len(source.view) / 1e9:.2f} GB of distinct bytes in host memory"
                                          + (", one copy per host" if source.shared else ""))
            if key not in meta["ceilings"]:
                by_threads = {n: _ceiling_rate(target, state, n, args.ceiling_reps, source.view, rank, world, group)
                              for n in ceilings.thread_counts(args.peer_threads, local)}
                meta.setdefault("write_gbps_by_threads", {})[target] = by_threads
                meta.setdefault("ceiling_threads", {})[target] = max(by_threads, key=by_threads.get)
                meta["ceilings"][key] = max(by_threads.values())
                if rank == 0:
                    print(f"{_at(args, meta, f'ceiling {target}')} ceiling write {target}: "
                          f"{meta['ceilings'][key]:.2f} GB/s (by threads: "
                          f"{ {n: round(r, 2) for n, r in by_threads.items()} })", flush=True)
            if args.ceiling_beside_d2h and beside not in meta["ceilings"]:
                if args.ceiling_beside_d2h == "all" or meta["targets"][target] == args.ceiling_beside_d2h:
                    _ceiling_beside_d2h(beside, target, state, meta, source.view, rank, world, group)
                    _at(args, meta, f"ceiling beside copies {target}")
                else:
                    meta.setdefault("ceiling_notes", {})[beside] = (
                        f"not measured: {meta['targets'][target]}, not {args.ceiling_beside_d2h}")
        if not args.ceiling_each_rep and source is not None:
            source.close()  # the savers should not run beside a state-sized buffer they never read
            source = None
        budget = _prepare_safe(residence, state, targets[0], chosen, args, meta, rank, group)
        if rank == 0:
            _save_meta(args.out, meta)
        for target in targets:
            for cache in args.cache.split(","):
                for rep in range(args.reps):
                    if args.ceiling_each_rep:
                        rate = _ceiling_rate(target, state, meta["ceiling_threads"][target], 1, source.view, rank,
                                             world, group)
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
                        row.update(rep=rep, bytes=state.nbytes * world, device_bytes=state.device_bytes,
                                   at_s=round(time.perf_counter() - args.t0, 1))
                        rows.append(row)
                        if rank == 0:
                            print(_at(args), {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                                   if k != "by_rank"}, flush=True)
                            with open(args.out + ".rows.jsonl", "a") as f:  # survives an interrupted run
                                f.write(json.dumps(row) + "\n")
                            _save_meta(args.out, meta)
            for peer in [p for p in args.verify if p in chosen]:
                _verify(peer, state, target, residence, args, budget, meta, rank, group)
            if args.count_h2d and torch.cuda.is_available():
                meta.setdefault("memcpy_events", {})
                for peer in chosen:
                    try:
                        counts = measure.count_memcpy(lambda p=peer, st=state: _saver(p, args, budget)(
                            st, f"{target}/h2d_{p}"))
                    except Exception as exc:
                        counts = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                    meta["memcpy_events"][f"{peer}|{residence}|{target}"] = counts
                    shutil.rmtree(f"{target}/h2d_{peer}", ignore_errors=True)
        del state
        _empty_caches()
    if source is not None:
        source.close()
    meta["host_stats_keys"] = measure.host_stats_keys()
    summary = report.summarize(rows, meta)
    md = ""
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        md = report.write(args.out, meta, rows, summary)
        print(md, flush=True)
        _say_if_no_chart(args.out)
        for line in goals.summary_lines(summary, meta) + goals.compact_lines(goals.evaluate(summary, meta), meta):
            print(line, flush=True)
    dist.barrier()
    failed = {k: v for k, v in (meta.get("verified") or {}).items() if v.get("failed")}
    if failed:  # after the report, so the run's rows are kept; but the run must not pass
        raise RuntimeError("safe_ckpt bench: a save did not load back bit-exact with stock Megatron: "
                           + "; ".join(f"{k}: {v['failed']}" for k, v in failed.items()))
    return md


def _saver(peer, args, budget):
    """``save(state, path)`` for ``peer``: the safe_ckpt peers with ``--threads`` writers and the
    pool ``budget``, or both left to the library (None) where ``--threads`` is 0; every other
    saver with the stock peers' thread count."""
    if peer.startswith("safe"):
        threads = None if args.threads == 0 else args.threads
        return lambda state, path: peers.resolve(peer)(state, path, threads, budget)
    return lambda state, path: peers.resolve(peer)(state, path, getattr(args, "peer_threads", args.threads), budget)


def _prepare_safe(residence, state, target, chosen, args, meta, rank, group):
    """The safe_ckpt peers' pool, allocated once per process as a training job would at startup,
    after the ceilings (which then never hold memory beside it). An untimed save of a tiny state
    settles what the library resolves on this rank (writers, pool, hashing threads; with
    ``--threads 0`` from its share of the host) and records it per rank; returns the budget the
    savers are called with (None: the library's default)."""
    budget = (int(args.budget_gib * 2**30) if args.budget_gib
              else None if args.threads == 0 else max(2 << 30, state.device_bytes + (256 << 20)))
    if not any(p.startswith("safe") for p in chosen):
        return budget
    import safe_ckpt

    t0 = time.perf_counter()
    if budget is not None:
        safe_ckpt.prepare_staging_pool(budget)
    tiny = build("anchor", 0.001, residence, rank, dist.get_world_size(), seed=9)
    resolved = _saver("safe_sync", args, budget)(tiny, f"{target}/warmup")
    del tiny
    if budget is None:
        safe_ckpt.prepare_staging_pool(resolved["staging_budget_bytes"])
    alloc_s = time.perf_counter() - t0
    dist.barrier()
    shutil.rmtree(f"{target}/warmup", ignore_errors=True)
    per_rank = _everyone({k: resolved.get(k) for k in peers.RESOLVED}, group)
    meta.setdefault("safe_options", {})[residence] = {k: [r[k] for r in per_rank] for k in peers.RESOLVED}
    meta.setdefault("staging_pool", {})[residence] = {"staging_budget_bytes": resolved["staging_budget_bytes"],
                                                      "alloc_s": alloc_s,
                                                      "pinned": torch.cuda.is_available()}
    if rank == 0:
        print(f"{_at(args, meta, f'pool {residence}')} safe_ckpt resolved per rank ({residence}): "
              f"{meta['safe_options'][residence]}", flush=True)
    return budget


def _verify(peer, state, target, residence, args, budget, meta, rank, group) -> None:
    """One more ``peer`` save, loaded back with stock Megatron and compared on every rank
    (`verify.across_ranks`); the outcome goes to ``meta["verified"]``."""
    from . import verify

    dist.barrier()
    entry = verify.across_ranks(state, f"{target}/verify_{peer}",
                                _saver(peer, args, budget),
                                lambda mine: _everyone(mine, group), rank, peers.Unavailable)
    meta.setdefault("verified", {})[f"{peer} {residence} {target}"] = entry
    if rank == 0:
        print(f"{_at(args, meta, f'verify {peer} {residence} {target}')} verify {peer} {residence} {target}: {entry}",
              flush=True)
        _save_meta(args.out, meta)  # a run cut short later still reports it (--rebuild)


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
    summary = report.summarize(rows, meta)
    md = report.write(prefix, meta, rows, summary)
    _say_if_no_chart(prefix)
    return "\n".join([md, *goals.summary_lines(summary, meta), *goals.compact_lines(goals.evaluate(summary, meta), meta)])


def _say_if_no_chart(prefix: str) -> None:
    """One line on stderr when the report has no chart, and why."""
    if os.path.exists(prefix + ".png"):
        return
    try:
        import matplotlib  # noqa: F401
        why = "no saver finished a timed run"
    except ImportError:
        why = "matplotlib is not installed (pip install matplotlib)"
    print(f"safe-ckpt bench: no chart ({prefix}.png): {why}; the report is {prefix}.md", file=sys.stderr, flush=True)


def _one(peer, state, target, cache, residence, args, budget, group) -> dict:
    row = {"peer": peer, "residence": residence, "target": target, "cache": cache}
    path = f"{target}/ck_{peer}"
    if cache == "cold":
        _empty_caches()
    dist.barrier()
    before = measure.host_alloc_bytes()
    result, error = None, None
    try:
        with measure.RssPeak() as rss:
            result = _saver(peer, args, budget)(state, path)
        result["extra_rss_bytes"] = rss.extra_bytes
        after = measure.host_alloc_bytes()
        result["pinned_alloc_bytes"] = None if before is None or after is None else after - before
    except peers.Unavailable as exc:
        error = str(exc)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
    row.update(node.gather_result(result, error, lambda mine: _everyone(mine, group)))  # every rank, even failed
    dist.barrier()
    shutil.rmtree(path, ignore_errors=True)
    return row


def run_here(args) -> int:
    """This process's part of the benchmark (alone, one rank under torchrun, or one Ray actor),
    its default group torn down after."""
    try:
        run(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
