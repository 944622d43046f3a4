"""Saving in slime's colocated loop, three ways, side by side for the same training state (the GPU run;
the report is slime_loop_report.py's).

One process, one GPU: a real GPTModel with Megatron's DistributedOptimizer whose whole training
state lives in a torch_memory_saver region with a CPU backup (as slime's `--offload-train`), put
to sleep after training. Each round checkpoints that same asleep state three ways:

- ``stock``: slime's own path: wake up (`resume()`, clear memory), Megatron's `save_checkpoint`
  (torch_dist, synchronous, as slime saves without `--async-save`), sleep (clear, `pause()`);
- ``awake``: the same bracket with safe_ckpt's `save_checkpoint`, asynchronous, its pool as
  large as the state (so the loop is held for the copy out of the device only);
- ``asleep``: safe_ckpt's asleep save as slime's actor runs it with `--ckpt-backend safe`, then a
  rollout (`rollout_engine.RolloutEngine`: another process, up for the whole run as SGLang's
  engines are) that takes most of the freed GPU memory and keeps the GPU busy for
  ``--rollout-s``, then the next `wake_up()`'s wait for the save.

Per variant: loop held, peak extra GPU (`rollout_engine.GpuPeak`: the device's bytes from NVML
less the rollout's, and torch's peak of the bytes allocated in the saving process), peak pinned
host bytes and time to durable, beside the target's write ceiling measured twice before each
round, in turn first: alone, and while a rollout runs as it does beside the asleep save. The
first ``asleep`` save is profiled, the GPU sampled throughout, no rollout beside it.

Must not: be imported by the library, or time anything but whole saves and ceilings (the
diagnostics under `diag/` take saves apart).

Needs CUDA, torch_memory_saver and Megatron's `megatron.training` (megatron-core 0.19 ships it).
Run from the repository root (it reuses the GPU tests' model setup, tests/helpers/bodies/gpu_megatron.py):
  python benchmarks/slime_loop_bench.py --targets /dev/shm/slime_loop,/tmp/slime_loop --out RESULTS_PREFIX
A run's report again from its log, anywhere: --rebuild-log LOG --out PREFIX --label LABEL
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from rollout_engine import GpuPeak, RolloutEngine  # noqa: E402
from slime_loop_report import VARIANTS, rounds_from_log, summary_line, write_report  # noqa: E402

TAG = "train"


def host_stats() -> dict:
    import torch

    return torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}


def host_held_bytes() -> int:
    """Bytes torch's pinned host allocator holds now, cached blocks included."""
    stats = host_stats()
    key = next((k for k in ("allocated_bytes.current", "reserved_bytes.current") if k in stats), None)
    return int(stats[key]) if key else 0


def pinned_start() -> dict:
    """Opens a save's window on torch's pinned host allocator (pin_memory(), non_blocking copies to
    CPU). The held bytes after less before read 0 once a path's blocks are cached, so where torch
    has peak stats the window resets them and later reads the peak of the bytes checked out."""
    import torch

    if hasattr(torch.cuda, "reset_peak_host_memory_stats") and "active_bytes.peak" in host_stats():
        torch.cuda.reset_peak_host_memory_stats()
        return {"method": "peak", "before_bytes": int(host_stats()["active_bytes.current"])}
    return {"method": "current", "before_bytes": host_held_bytes()}


def pinned_end(start: dict, pool_bytes: int) -> dict:
    """The row's pinned fields: the save's bytes from torch's allocator plus safe_ckpt's pool."""
    peak = start["method"] == "peak"
    torch_bytes = (int(host_stats()["active_bytes.peak"]) if peak else host_held_bytes()) - start["before_bytes"]
    return {"pinned_bytes": max(0, torch_bytes) + pool_bytes, "pinned_method": start["method"],
            "pinned_torch_held_bytes": host_held_bytes()}


def safe_pool_bytes() -> int:
    """Bytes safe_ckpt's process-wide pinned staging pool holds now (0 when there is none)."""
    from safe_ckpt.staging import pool

    shared = pool._shared.get("pool")
    return int(shared.stats().allocated_bytes) if shared is not None else 0


def clear_memory() -> None:
    """slime's clear_memory(): what its wake_up and sleep do around the save."""
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def write_ceiling_s(target: str, nbytes: int, source, threads: list[int]) -> dict:
    """Seconds to write ``nbytes`` of ``source`` into ``target`` with fsync: best thread count."""
    from safe_ckpt_lab.bench import ceilings

    by_threads = {t: ceilings.write_seconds(target, nbytes, t, reps=1, source=source) for t in threads}
    best = min(by_threads, key=by_threads.get)
    return {"seconds": by_threads[best], "threads": best, "by_threads": by_threads}


def body(rank, world, opts) -> dict:
    import torch

    import megatron.core  # noqa: F401  (before the first region: it sets the saver's hook mode)
    import megatron.training  # noqa: F401

    from safe_ckpt.integrations import slime_groups
    from tests.helpers.bodies import gpu_megatron as g
    from tests.helpers.bodies.gpu_slime_asleep import _memory_saver

    g.MODEL_ARGS = g.MODEL_ARGS + ["--num-layers", str(opts["layers"]), "--hidden-size", str(opts["hidden"]),
                                   "--num-attention-heads", str(opts["heads"]), "--train-iters", "1000"]
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("safe_ckpt").setLevel(logging.DEBUG)  # the resolved writers and pool, per save
    tms = _memory_saver()
    work = opts["targets"][0]
    t0 = time.monotonic()
    with tms.region(tag=TAG, enable_cpu_backup=True):
        model, optimizer, scheduler = g._setup(os.path.join(work, "unused"), "gpu", world)
        from megatron.training import get_args

        args = get_args()
        iteration = 2
        losses = g._train(model, optimizer, scheduler, 0, iteration)
    torch.cuda.synchronize()
    out = {"setup_s": time.monotonic() - t0, "losses": losses, "params": sum(p.numel() for m in model for p in m.parameters()),
           "rounds": [], "torch": torch.__version__, "megatron_core": megatron.core.__version__,
           "gpu": torch.cuda.get_device_name(0)}
    slime_groups.install_detached_support()
    group = slime_groups.create_detached_gloo(600.0)  # at install, awake
    snapshot = slime_groups.snapshot_groups()  # what the actor's sleep() records first
    args.async_save = False
    clear_memory()
    tms.pause(TAG)
    peak = GpuPeak()
    out["options"] = dict(opts)
    engine = RolloutEngine()  # up before the first save, as slime's rollout engines are
    try:
        run_rounds(opts, out, args, model, optimizer, scheduler, iteration, tms, group, snapshot, peak, engine)
    finally:
        engine.close()
    return out


def run_rounds(opts, out, args, model, optimizer, scheduler, iteration, tms, group, snapshot, peak, engine) -> None:
    """The profiled save, the one-setting saves, then every target's timed rounds, into ``out``."""
    from safe_ckpt.integrations import slime_asleep
    import safe_ckpt.megatron as safe_megatron
    from tests.helpers.bodies import gpu_megatron as g
    from tests.helpers.bodies.gpu_slime_asleep import profile_counts

    state_bytes = None
    source = None

    def tweak_source():
        nonlocal source
        if source is None:
            from safe_ckpt_lab.bench import ceilings

            source = ceilings.source_buffer(state_bytes)
        return source

    first_compare = None

    def asleep(save_dir, profiled):
        from safe_ckpt.staging import pool

        pool.release()  # whatever an awake save left: the asleep save must need none
        args.save = save_dir
        pinned = pinned_start()
        peak.start()
        done_at = {}
        start = time.monotonic()
        rng_state = slime_asleep.capture_rng_state(args, snapshot)
        starting = slime_asleep.StartingSave(lambda: slime_asleep.start_asleep_save(
            args, model, optimizer, scheduler, iteration, group, snapshot, rng_state=rng_state), iteration)
        held = time.monotonic() - start
        watcher = threading.Thread(target=lambda: (starting.wait(), done_at.setdefault("t", time.monotonic())),
                                   daemon=True)
        watcher.start()
        row = {"save_model_s": held}
        if profiled:
            watcher.join()
        else:
            row.update(engine.rollout(opts["rollout_s"], peak))
        wake = time.monotonic()
        result = starting.wait()
        safe_megatron.finalize_async_saves(blocking=True)
        row["wake_wait_s"] = time.monotonic() - wake
        watcher.join()
        row["durable_s"] = done_at["t"] - start
        row["held_s"] = row["save_model_s"] + row["wake_wait_s"]
        row["gpu_extra_bytes"] = peak.stop()
        row["torch_gpu_extra_bytes"] = peak.torch_extra_bytes
        row.update(pinned_end(pinned, safe_pool_bytes()))
        row["bytes"] = result.total_file_bytes
        row["bytes_by_residence"] = dict(result.bytes_by_residence)
        row["timings"] = {k: getattr(result.timings, k) for k in ("plan_s", "stall_s", "write_s", "commit_s", "total_s")}
        return row

    def awake(save_dir, stock):
        from safe_ckpt.staging import pool

        args.save = save_dir
        if stock:
            pool.release()
        else:  # a pool the size of the state, allocated at startup as a training job would
            budget_gib = state_bytes / 2**30 * 1.05
            args.safe_ckpt_staging_budget_gib = budget_gib
            pool.prepare(int(budget_gib * 2**30))
        pinned = pinned_start()
        peak.start()
        start = time.monotonic()
        tms.resume(TAG)  # slime's wake_up: the CPU backup copied back
        clear_memory()
        woke = time.monotonic()
        if stock:
            from megatron.training.checkpointing import save_checkpoint

            save_checkpoint(iteration, model, optimizer, scheduler, num_floating_point_operations_so_far=0)
        else:
            args.async_save = True
            safe_megatron.save_checkpoint(iteration, model, optimizer, scheduler, num_floating_point_operations_so_far=0)
            args.async_save = False
        saved = time.monotonic()
        clear_memory()  # slime's sleep
        tms.pause(TAG)
        held = time.monotonic() - start
        if not stock:
            safe_megatron.finalize_async_saves(blocking=True)
        row = {"held_s": held, "wake_up_s": woke - start, "save_call_s": saved - woke, "sleep_s": start + held - saved,
               "durable_s": time.monotonic() - start, "gpu_extra_bytes": peak.stop(),
               "torch_gpu_extra_bytes": peak.torch_extra_bytes,  # beside the asleep save's: what the brackets allocate
               **pinned_end(pinned, 0 if stock else safe_pool_bytes())}
        row["bytes"] = tree_bytes(os.path.join(save_dir, "iter_%07d" % iteration))
        return row

    for target in opts["targets"]:
        for r in range(opts["rounds"] + 1):
            profiled = r == 0
            if profiled and target != opts["targets"][0]:
                continue
            dirs = {v: os.path.join(target, f"{v}_r{r}") for v in VARIANTS}
            row = {"target": target, "round": r, "profiled": profiled}
            if profiled:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    row["asleep"] = asleep(dirs["asleep"], True)
                row["asleep_profile"] = profile_counts(prof)
                state_bytes = row["asleep"]["bytes"]
                shutil.rmtree(dirs["asleep"], ignore_errors=True)
                out["rounds"].append(row)
                print("profiled asleep save:", json.dumps(row), flush=True)
                from diag.backup_writes import tweaked_asleep_saves

                out["tweaks"] = tweaked_asleep_saves(
                    opts["tweaks"], args, lambda: asleep(dirs["asleep"], True), dirs["asleep"],
                    lambda: {**write_ceiling_s(target, state_bytes, tweak_source(), opts["threads"]),
                             "target": target, "bytes": state_bytes})
                continue
            os.sync()

            def alone():
                row["ceiling"] = write_ceiling_s(target, state_bytes, tweak_source(), opts["threads"])

            def beside_rollout(first):  # the same writes while a rollout holds the freed GPU memory and runs
                beside = engine.rollout(0.0, None, during=lambda: write_ceiling_s(
                    target, state_bytes, tweak_source(), opts["threads"]))
                row["ceiling_beside_rollout"] = {**beside.pop("during"), "rollout": beside, "first": first}

            if r % 2:  # in turn first, so that neither ceiling always meets what the other left behind
                beside_rollout(True)
                alone()
            else:
                alone()
                beside_rollout(False)
            for variant in VARIANTS:
                os.sync()
                row[variant] = asleep(dirs[variant], False) if variant == "asleep" else \
                    awake(dirs[variant], variant == "stock")
                row[variant]["ttd_over_ceiling"] = row["ceiling"]["seconds"] / row[variant]["durable_s"]
                row[variant]["ttd_over_ceiling_beside_rollout"] = (row["ceiling_beside_rollout"]["seconds"]
                                                                   / row[variant]["durable_s"])
            if first_compare is None:
                from tests.helpers.megatron_evidence import compare_contents

                it = {v: os.path.join(dirs[v], "iter_%07d" % iteration) for v in VARIANTS}
                row["compare"] = first_compare = {f"{v}_vs_stock": compare_contents(it[v], it["stock"])
                                                  for v in ("asleep", "awake")}
            for d in dirs.values():
                shutil.rmtree(d, ignore_errors=True)
            out["rounds"].append(row)
            print(summary_line(row), flush=True)
            print("row", json.dumps(row, default=str), flush=True)  # a run cut short is rebuilt from these
            # the next round saves the next state: wake, one step, sleep (as slime's train does)
            tms.resume(TAG)
            with tms.region(tag=TAG, enable_cpu_backup=True):
                out["losses"] += g._train(model, optimizer, scheduler, iteration, iteration + 1)
            iteration += 1
            clear_memory()
            tms.pause(TAG)
    out["state_bytes"] = state_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rebuild-log", help="write PREFIX.md (and .json) from a run's log instead of running")
    parser.add_argument("--targets", help="comma-separated directories (e.g. tmpfs, disk)")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per target (after one profiled save)")
    parser.add_argument("--layers", type=int, default=13)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--rollout-s", type=float, default=6.0)
    parser.add_argument("--threads", default="8,16", help="write-ceiling thread counts (best is the ceiling)")
    parser.add_argument("--tweaks", default="default,no_recheck,nosum+no_recheck,ceiling",
                        help="asleep saves with one setting changed each, after the profiled one ('' for none)")
    parser.add_argument("--label", default="slime's colocated loop on one GPU: three ways to save")
    parser.add_argument("--out", required=True, help="results prefix: PREFIX.json and PREFIX.md")
    ns = parser.parse_args()
    if ns.rebuild_log:
        write_report(rounds_from_log(ns.rebuild_log), ns.out, ns.label)
        return
    if not ns.targets:
        parser.error("--targets is required")
    from tests.helpers.mp import run_world

    opts = {"targets": ns.targets.split(","), "rounds": ns.rounds, "layers": ns.layers, "hidden": ns.hidden,
            "heads": ns.heads, "rollout_s": ns.rollout_s, "threads": [int(t) for t in ns.threads.split(",")],
            "tweaks": [t for t in ns.tweaks.split(",") if t]}
    for t in opts["targets"]:
        os.makedirs(t, exist_ok=True)
    ((status, out),) = run_world(1, body, (opts,), backend="nccl", timeout_s=3000)
    if status != "ok":
        raise SystemExit(f"the run failed: {out}")
    write_report(out, ns.out, ns.label)


if __name__ == "__main__":
    main()
