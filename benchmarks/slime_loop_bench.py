"""Saving in slime's colocated loop, three ways, side by side for the same training state.

One process, one GPU: a real GPTModel with Megatron's DistributedOptimizer whose whole training
state lives in a torch_memory_saver region with a CPU backup (as slime's `--offload-train`), put
to sleep after training. Each round checkpoints that same asleep state three ways:

- ``stock``: slime's own path: wake up (`resume()`, clear memory), Megatron's `save_checkpoint`
  (torch_dist, synchronous, as slime saves without `--async-save`), sleep (clear, `pause()`);
- ``awake``: the same bracket with safe_ckpt's `save_checkpoint`, asynchronous, its pool as
  large as the state (so the loop is held for the copy out of the device only);
- ``asleep``: safe_ckpt's asleep save as slime's actor runs it with `--ckpt-backend safe`
  (`slime_asleep.capture_rng_state` + `StartingSave`), then a rollout stand-in that takes most
  of the freed GPU memory and keeps the GPU busy for ``--rollout-s``, then the next `wake_up()`'s
  wait for the save.

Per variant: the time the loop is held (save_model's call until the next step may start: for
``asleep``, save_model's own time plus what `wake_up()` waited after the rollout), peak extra GPU
memory during the save (NVML's used bytes above the asleep baseline, less the rollout
stand-in's own allocation), pinned host bytes the save allocated (torch's pinned allocator and
safe_ckpt's pool), and time until durable; beside them, the write ceiling of the same bytes to
the same target, measured before every round. The first ``asleep`` save of a run is profiled
(no rollout beside it): host-to-device copies, kernels and NCCL calls. The three checkpoints of
the first round are compared byte for byte through torch.distributed.checkpoint.

Needs CUDA, torch_memory_saver and Megatron's `megatron.training` (megatron-core 0.19 ships it).
Run from the repository root (it reuses the GPU tests' model setup, tests/gpu_megatron_cases.py):
  python benchmarks/slime_loop_bench.py --targets /dev/shm/slime_loop,/tmp/slime_loop --out RESULTS_PREFIX
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import statistics
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

TAG = "train"
VARIANTS = ("asleep", "awake", "stock")


class GpuPeak:
    """Device memory in use, sampled every millisecond by NVML in a thread (ctypes drops the
    GIL, so the sampler barely competes with the save's Python threads)."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)  # the one GPU of the machine
        self.discount_bytes = 0  # the rollout stand-in's own allocation, not the save's
        self.paused = False  # while the rollout stand-in allocates (before its discount is known)
        self._stop = threading.Event()
        self._thread = None
        self.baseline_bytes = self.peak_bytes = 0

    def used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def start(self) -> "GpuPeak":
        self.baseline_bytes = self.peak_bytes = self.used()
        self.discount_bytes = 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="gpu-peak")
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            used = self.used()  # read, then check the pause, then the discount: no allocation slips past
            if not self.paused:
                self.peak_bytes = max(self.peak_bytes, used - self.discount_bytes)
            self._stop.wait(0.001)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(0, self.peak_bytes - self.baseline_bytes)


def host_pinned_bytes() -> int:
    """Bytes torch's pinned host allocator holds now (pin_memory(), non_blocking copies to CPU)."""
    import torch

    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    for key in ("allocated_bytes.current", "reserved_bytes.current", "allocated_bytes.all.current"):
        if key in stats:
            return int(stats[key])
    return 0


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
    from safe_ckpt.bench import ceilings

    by_threads = {t: ceilings.write_seconds(target, nbytes, t, reps=1, source=source) for t in threads}
    best = min(by_threads, key=by_threads.get)
    return {"seconds": by_threads[best], "threads": best, "by_threads": by_threads}


# The rollout stand-in runs in its own process, as SGLang's engines do: the training process's
# own kernels cannot run while its state (cuBLAS's workspace included) is paused.
ROLLOUT_CHILD = r"""
import sys, time, torch
share, seconds = float(sys.argv[1]), float(sys.argv[2])
filler = torch.empty(int(torch.cuda.mem_get_info()[0] * share), dtype=torch.uint8, device="cuda")
filler.fill_(0xA5)
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
b = torch.empty_like(a)
torch.matmul(a, a, out=b)
torch.cuda.synchronize()
print("ready", filler.numel(), flush=True)
end, steps = time.monotonic() + seconds, 0
while time.monotonic() < end:
    torch.matmul(a, a, out=b)
    torch.tanh(b, out=a)
    steps += 1
    if steps % 16 == 0:
        torch.cuda.synchronize()
torch.cuda.synchronize()
print("done", steps, flush=True)
"""


def rollout_stand_in(seconds: float, peak: GpuPeak | None) -> dict:
    """Another process takes 80 % of the free GPU memory (as SGLang's KV cache would) and keeps
    the GPU busy for ``seconds``. Its memory is discounted from the save's GPU peak; while it
    starts (before its size is known) the sampler pauses."""
    import subprocess

    if peak is not None:
        peak.paused = True
    before = peak.used() if peak is not None else 0
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", ROLLOUT_CHILD, "0.8", str(seconds)], stdout=subprocess.PIPE,
                            text=True)
    ready = proc.stdout.readline().split()
    if peak is not None:
        peak.discount_bytes = peak.used() - before
        peak.paused = False
    done = proc.stdout.read().split()
    proc.wait(timeout=seconds + 300)
    if peak is not None:
        peak.discount_bytes = 0
    if proc.returncode != 0 or not ready or ready[0] != "ready":
        raise RuntimeError(f"the rollout stand-in failed (exit {proc.returncode}): {ready} {done}")
    return {"rollout_bytes": int(ready[1]), "matmuls": int(done[1]) if len(done) > 1 else 0,
            "rollout_s": time.monotonic() - start}


def body(rank, world, opts) -> dict:
    import torch

    import megatron.core  # noqa: F401  (before the first region: it sets the saver's hook mode)
    import megatron.training  # noqa: F401

    from safe_ckpt.integrations import slime_asleep, slime_groups
    import safe_ckpt.megatron as safe_megatron
    from tests import gpu_megatron_cases as g
    from tests.gpu_slime_asleep_cases import _memory_saver, profile_counts

    g.MODEL_ARGS = g.MODEL_ARGS + ["--num-layers", str(opts["layers"]), "--hidden-size", str(opts["hidden"]),
                                   "--num-attention-heads", str(opts["heads"]), "--train-iters", "1000"]
    import logging

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
    state_bytes = None
    source = None
    first_compare = None

    def asleep(save_dir, profiled):
        from safe_ckpt.staging import pool

        pool.release()  # whatever an awake save left: the asleep save must need none
        args.save = save_dir
        host0 = host_pinned_bytes()
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
            row.update(rollout_stand_in(opts["rollout_s"], peak))
        wake = time.monotonic()
        result = starting.wait()
        safe_megatron.finalize_async_saves(blocking=True)
        row["wake_wait_s"] = time.monotonic() - wake
        watcher.join()
        row["durable_s"] = done_at["t"] - start
        row["held_s"] = row["save_model_s"] + row["wake_wait_s"]
        row["gpu_extra_bytes"] = peak.stop()
        row["pinned_bytes"] = (host_pinned_bytes() - host0) + safe_pool_bytes()
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
        host0 = host_pinned_bytes()
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
               "pinned_bytes": (host_pinned_bytes() - host0) + (0 if stock else safe_pool_bytes())}
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
                out["tweaks"] = tweaked_asleep_saves(opts["tweaks"], args, lambda: asleep(dirs["asleep"], True),
                                                     dirs["asleep"])
                continue
            if source is None:
                from safe_ckpt.bench import ceilings

                source = ceilings.source_buffer(state_bytes)
            os.sync()
            row["ceiling"] = write_ceiling_s(target, state_bytes, source, opts["threads"])
            for variant in VARIANTS:
                os.sync()
                row[variant] = asleep(dirs[variant], False) if variant == "asleep" else \
                    awake(dirs[variant], variant == "stock")
                row[variant]["ttd_over_ceiling"] = row["ceiling"]["seconds"] / row[variant]["durable_s"]
            if first_compare is None:
                from tests.megatron_evidence import compare_contents

                first_compare = {
                    "asleep_vs_stock": compare_contents(os.path.join(dirs["asleep"], "iter_%07d" % iteration),
                                                        os.path.join(dirs["stock"], "iter_%07d" % iteration)),
                    "awake_vs_stock": compare_contents(os.path.join(dirs["awake"], "iter_%07d" % iteration),
                                                       os.path.join(dirs["stock"], "iter_%07d" % iteration)),
                }
                row["compare"] = first_compare
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
    return out


def tweaked_asleep_saves(names: list, args, save, save_dir) -> list:
    """The asleep save again with one setting changed each (not profiled, no rollout beside it):
    where its time to durable goes. ``threads16``: 16 writers; ``nice0``: writers at the caller's
    priority; ``no_recheck``: backup bytes hashed once, not again after their write."""
    from safe_ckpt import pipeline

    rows = []
    for name in names:
        saved = (getattr(args, "safe_ckpt_io_threads", None), getattr(args, "safe_ckpt_writer_nice", None),
                 pipeline.HOST_RESIDENCES)
        if name == "threads16":
            args.safe_ckpt_io_threads = 16
        elif name == "nice0":
            args.safe_ckpt_writer_nice = 0
        elif name == "no_recheck":
            pipeline.HOST_RESIDENCES = tuple(r for r in saved[2] if r != "offload_backup")
        elif name != "default":
            raise SystemExit(f"unknown tweak {name}")
        try:
            row = save()
        finally:
            args.safe_ckpt_io_threads, args.safe_ckpt_writer_nice, pipeline.HOST_RESIDENCES = saved
        shutil.rmtree(save_dir, ignore_errors=True)
        rows.append({"tweak": name, "durable_s": row["durable_s"], "timings": row["timings"]})
        print("tweak", json.dumps(rows[-1]), flush=True)
    return rows


def summary_line(row) -> str:
    parts = [f"{row['target']} r{row['round']} ceiling {row['ceiling']['seconds']:.2f}s"]
    for v in VARIANTS:
        x = row[v]
        parts.append(f"{v}: held {x['held_s']:.3f}s durable {x['durable_s']:.2f}s ({x['ttd_over_ceiling']:.2f} of "
                     f"ceiling) gpu+{x['gpu_extra_bytes'] / 2**30:.2f}GiB pinned {x['pinned_bytes'] / 2**30:.2f}GiB")
    return " | ".join(parts)


SUMMARY_VARIANT = re.compile(r"(\w+): held ([\d.]+)s durable ([\d.]+)s \(([\d.]+) of ceiling\) "
                             r"gpu\+([\d.]+)GiB pinned ([\d.]+)GiB")


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
                                   "pinned_bytes": float(m.group(6)) * 2**30}
            out["rounds"].append(row)
    return out


def report(out: dict, label: str) -> str:
    model = (f"GPTModel of {out['params'] / 1e6:.0f} M parameters" if "params" in out else "GPTModel")
    lines = [f"# {label}", "",
             (f"{out['gpu']}, torch {out['torch']}, megatron-core {out['megatron_core']}; " if "gpu" in out else "") +
             f"{model} with the distributed optimizer (bf16, fp32 main parameters and Adam moments): "
             f"{out['state_bytes'] / 1e9:.2f} GB per checkpoint, the whole training state in one "
             "torch_memory_saver region with a CPU backup.", ""]
    lines += ["- `stock`: slime's own path: `wake_up` (torch_memory_saver `resume()`, clear memory), Megatron's "
              "`save_checkpoint` (synchronous, as slime saves without `--async-save`), `sleep` (clear memory, `pause()`);",
              "- `awake`: the same bracket with safe_ckpt's `save_checkpoint`, asynchronous, its pinned pool as large as "
              "the state (allocated before the round, as at startup);",
              "- `asleep`: what slime's actor does with `--ckpt-backend safe`: the RNG state taken, the state dict built "
              "and written in the background from the CPU backup, while a rollout stand-in (another process) fills 80 % "
              "of the freed GPU memory and runs matmuls; then the next `wake_up`'s wait for the save.",
              "", "Loop held: from `save_model`'s call until the next step may start (for `asleep`: `save_model`'s own "
              "time plus what `wake_up` waited after the rollout). Neither bracket includes slime's process-group "
              "teardown and rebuild, which only add to `stock` and `awake`. Peak extra GPU: NVML's used bytes above "
              "the asleep state's, less the rollout stand-in's. Pinned host: torch's pinned allocator and "
              "safe_ckpt's pool. Write ceiling: the same bytes written by 8 and by 16 threads with fsync into the "
              "same target before each round, the faster. Command: `python benchmarks/slime_loop_bench.py --targets "
              "/dev/shm/...,/tmp/... --rounds 2` (`bash benchmarks/gpu_suite.sh slimeloop`).", ""]
    if out.get("from_log"):
        lines += [f"Rebuilt from the run's log, `{out['from_log']}` (the run was stopped before it wrote its "
                  "JSON; rounds it did not finish are left out).", ""]
    prof = next((r for r in out["rounds"] if r["profiled"]), None)
    if prof:
        p = prof["asleep_profile"]
        lines += [f"Profiled asleep save (no rollout beside it): {p['HtoD']} host-to-device copies, {p['kernels']} "
                  f"kernels, {p['nccl']} NCCL calls, {p['DtoH']} device-to-host copies; bytes by residence "
                  f"{prof['asleep']['bytes_by_residence']}.", ""]
    if out.get("tweaks"):
        lines += ["Asleep saves with one setting changed (no rollout beside them, one each, same target as the "
                  "profiled save):", "", "| setting | time to durable (s) | planning (s) | writing (s) |", "|---|---|---|---|"]
        lines += [f"| {t['tweak']} | {t['durable_s']:.2f} | {t['timings']['plan_s']:.3f} | {t['timings']['write_s']:.2f} |"
                  for t in out["tweaks"]]
        lines.append("")
    for target in dict.fromkeys(r["target"] for r in out["rounds"] if not r["profiled"]):
        rows = [r for r in out["rounds"] if r["target"] == target and not r["profiled"] and all(v in r for v in VARIANTS)]
        if not rows:
            continue
        med = lambda v, k: statistics.median(r[v][k] for r in rows)  # noqa: E731
        has = lambda v, k: all(k in r[v] for r in rows)  # noqa: E731
        ceiling = statistics.median(r["ceiling"]["seconds"] for r in rows)
        lines += [f"## {target} ({len(rows)} rounds, medians; write ceiling {ceiling:.2f} s = "
                  f"{out['state_bytes'] / ceiling / 1e9:.2f} GB/s)", "",
                  "| variant | loop held (s) | save_model (s) | wake_up waited (s) | peak extra GPU (GiB, most) "
                  "| pinned host (GiB, most) | time to durable (s) | ceiling / durable |",
                  "|---|---|---|---|---|---|---|---|"]
        for v in VARIANTS:
            sm = f"{med(v, 'save_model_s'):.3f}" if v == "asleep" and has(v, "save_model_s") else "-"
            ww = f"{med(v, 'wake_wait_s'):.3f}" if v == "asleep" and has(v, "wake_wait_s") else "-"
            most = lambda k: max(r[v][k] for r in rows) / 2**30  # noqa: E731
            lines.append(f"| {v} | {med(v, 'held_s'):.3f} | {sm} | {ww} | {most('gpu_extra_bytes'):.2f} | "
                         f"{most('pinned_bytes'):.2f} | {med(v, 'durable_s'):.2f} | "
                         f"{statistics.median(r[v]['ttd_over_ceiling'] for r in rows):.2f} |")
        a = rows[0]["asleep"]
        lines += [""]
        if "rollout_bytes" in a:
            lines += [f"Rollout stand-in beside the asleep save: {a['rollout_bytes'] / 2**30:.1f} GiB of the freed "
                      "GPU memory, matmuls for the rollout time.", ""]
    compare = next((r["compare"] for r in out["rounds"] if "compare" in r), None)
    if compare:
        for name, c in compare.items():
            lines.append(f"- {name}: {c.get('tensors')} tensors and {c.get('objects')} objects compared, "
                         f"differ {c.get('differ')}, only in one {c.get('only_ours')} {c.get('only_stock')}")
    return "\n".join(lines) + "\n"


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
    parser.add_argument("--tweaks", default="default,threads16,nice0,no_recheck",
                        help="asleep saves with one setting changed each, after the profiled one ('' for none)")
    parser.add_argument("--label", default="slime's colocated loop on one GPU: three ways to save")
    parser.add_argument("--out", required=True, help="results prefix: PREFIX.json and PREFIX.md")
    ns = parser.parse_args()
    if ns.rebuild_log:
        write_report(rounds_from_log(ns.rebuild_log), ns.out, ns.label)
        return
    if not ns.targets:
        parser.error("--targets is required")
    from tests.mp import run_world

    opts = {"targets": ns.targets.split(","), "rounds": ns.rounds, "layers": ns.layers, "hidden": ns.hidden,
            "heads": ns.heads, "rollout_s": ns.rollout_s, "threads": [int(t) for t in ns.threads.split(",")],
            "tweaks": [t for t in ns.tweaks.split(",") if t]}
    for t in opts["targets"]:
        os.makedirs(t, exist_ok=True)
    ((status, out),) = run_world(1, body, (opts,), backend="nccl", timeout_s=3000)
    if status != "ok":
        raise SystemExit(f"the run failed: {out}")
    write_report(out, ns.out, ns.label)


def write_report(out: dict, prefix: str, label: str) -> None:
    with open(prefix + ".json", "w") as f:
        json.dump(out, f, indent=1, default=str)
    text = report(out, label)
    with open(prefix + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
