"""The per-step checkpoint cost slime users pay, in slime's two ways of freeing the GPU for rollout,
for the same model (the GPU run).

slime's own actor code (`--slime-src`, an export made by scripts/export_slime.sh) on a real GPTModel
with Megatron's DistributedOptimizer (tests/helpers/bodies/gpu_megatron.py's, enlarged: 13 layers of 2048 by
default, 9.2 GB of state), one process per mode, one GPU:

- ``offload`` (`--offload-train --colocate`): the process runs as slime starts a train actor
  (torch_memory_saver preloaded, `TMS_INIT_ENABLE=1`, `TMS_INIT_ENABLE_CPU_BACKUP=1`), its Megatron
  is scripts/slime_megatron_patch.py's copy (the DDP buffers without backup) and its args are slime's
  (tests/helpers/bodies/gpu_slime_shipped.py). Each round is one train step as slime's `train()` runs it
  (wake_up, a step, the weights backed up, sleep), then `save_model`, alternately:
  ``stock``: slime's wake-up path with stock Megatron's save_checkpoint (wake_up, save, sleep);
  ``asleep``: with `--ckpt-backend safe`: save_model returns without waking, the writes go on during a
  rollout stand-in (`--rollout-s` of idle GPU), and the next train step's wake_up waits for what is left.
  Loop held: save_model's own time plus that wait. GPU bytes added: the device's free memory before
  save_model less its lowest value until the save is durable (sampled every 5 ms). Pinned bytes
  added: torch's pinned host allocator's peak over the save plus safe_ckpt's staging pool.
- ``release`` (`--release-train`: the actors are killed after every step and recreated from
  `--save`): per step, slime's `save_model(force_sync=True)`, then a load of that checkpoint, then
  one train step: stock Megatron's save and load (``stock``), safe_ckpt's save and stock load
  (``safe``), or safe_ckpt's save and `safe_ckpt.megatron.load_checkpoint` (``safe_load``, what
  `--ckpt-backend safe` does by default); per step cost = save + load. Each step's load and save
  run in the same process here (a new actor is a new process in slime); safe_ckpt's staging pool is released after each save, so every
  save pays its allocation as a new actor's first save would.

Every checkpoint goes to `--target` (default tmpfs) and is removed once the next one is written.
Writes PREFIX.json (every row) and PREFIX.md (the table, medians over rounds).

Run from the repository root (GPU machine):
  python benchmarks/slime_modes_bench.py --slime-src .slime --out RESULTS_PREFIX [--modes offload,release]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))


class FreeSampler:
    """The device's lowest free memory while running (cudaMemGetInfo every ``period_s``)."""

    def __init__(self, period_s: float = 0.005) -> None:
        import torch

        self.start_free = torch.cuda.mem_get_info()[0]
        self.lowest = self.start_free
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)
        self._thread.start()

    def _run(self, period_s: float) -> None:
        import torch

        while not self._stop.is_set():
            self.lowest = min(self.lowest, torch.cuda.mem_get_info()[0])
            self._stop.wait(period_s)

    def added_bytes(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(0, self.start_free - self.lowest)


def _model_args(opts) -> list:
    return ["--num-layers", str(opts["layers"]), "--hidden-size", str(opts["hidden"]),
            "--num-attention-heads", str(opts["heads"]), "--train-iters", "1000"]


def _state_bytes(model, optimizer) -> int:
    """Bytes a checkpoint of this rank holds: the bf16 weights and every optimizer tensor."""
    import torch

    total = sum(p.numel() * p.element_size() for m in model for p in m.parameters())
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                total += p.numel() * p.element_size()
                total += sum(t.numel() * t.element_size() for t in opt.optimizer.state.get(p, {}).values()
                             if isinstance(t, torch.Tensor) and t.dim() > 0)
    return total


def offload_mode(rank, world, opts) -> dict:
    from tests.helpers.bodies.gpu_slime_shipped import patched_megatron_first

    patched_megatron_first()  # a spawned rank keeps its parent's sys.path: the patched copy goes first here
    import torch

    from slime_loop_bench import pinned_end, pinned_start, safe_pool_bytes
    from tests.helpers.bodies import gpu_megatron as g
    from tests.helpers.bodies import gpu_slime_shipped as s
    from tests.gpu import test_real_slime_source as t

    g.MODEL_ARGS = g.MODEL_ARGS + _model_args(opts)
    slime = t.import_slime(opts["slime_src"])
    from datetime import timedelta

    from slime.utils import distributed_utils, reloadable_process_group as rpg

    rpg.monkey_patch_torch_dist()
    distributed_utils.init_gloo_group()
    rpg.register_default_process_group(timeout=timedelta(minutes=10))
    save_dir = os.path.join(opts["target"], "offload")
    model, optimizer, scheduler = s.setup(save_dir, world, s.slime_offload_colocate)
    it = 0
    g._train(model, optimizer, scheduler, it, it + 1)
    it += 1
    from megatron.training import get_args
    from megatron.training.checkpointing import save_checkpoint as stock_save_checkpoint

    from safe_ckpt.integrations import slime as integration
    from safe_ckpt.integrations.slime_asleep import installed

    args = get_args()
    t.slime_actor_args(args, save_dir)
    args.safe_ckpt_io_threads = opts["threads"]
    actor = t.hand_built_actor(slime["actor"], args, model, optimizer, scheduler)
    integration.install(args)
    saves = installed(slime["actor"].MegatronTrainRayActor)
    model_module = slime["model"]
    routed = model_module.save_checkpoint
    out = {"state_bytes": _state_bytes(model, optimizer), "rows": []}
    actor.sleep()
    out["layout"] = s.layout(model, optimizer)  # asleep: what torch_memory_saver keeps a backup of
    previous = None
    for r in range(opts["rounds"]):
        for variant in ("stock", "asleep"):
            actor.wake_up()  # slime's train(): wake_up (waits for an asleep save still writing), a step, sleep
            if previous is not None:
                previous["wake_wait_s"] = saves.last_wake_wait_s
                previous["loop_held_s"] = previous["hold_s"] + previous["wake_wait_s"]
            g._train(model, optimizer, scheduler, it, it + 1)
            actor.weights_backuper.backup("actor")
            actor.sleep()
            torch.cuda.synchronize()
            pinned, sampler, start = pinned_start(), FreeSampler(), time.monotonic()
            row = {"mode": "offload", "variant": variant, "round": r, "iteration": it}
            if variant == "stock":
                model_module.save_checkpoint, args.safe_ckpt_save_awake = stock_save_checkpoint, True
                try:
                    actor.save_model(it)
                finally:
                    model_module.save_checkpoint, args.safe_ckpt_save_awake = routed, False
                row["hold_s"] = row["durable_s"] = row["loop_held_s"] = time.monotonic() - start
                row["wake_wait_s"] = 0.0
                previous = None
            else:
                actor.save_model(it)
                row["hold_s"] = time.monotonic() - start
                inflight, done = saves.inflight, {}
                watcher = threading.Thread(target=_durable_at, args=(inflight, done))
                watcher.start()
                time.sleep(opts["rollout_s"])  # the rollout stand-in: the GPU idle, the writes go on
                watcher.join()
                row["durable_s"] = done["s"] - start
                previous = row
            row["gpu_added_bytes"] = sampler.added_bytes()
            row.update(pinned_end(pinned, 0 if variant == "stock" else safe_pool_bytes()))
            out["rows"].append(row)
            print("row", json.dumps(row), flush=True)
            it += 1
            _keep_only(save_dir, it - 1)
    actor.wake_up()
    if previous is not None:
        previous["wake_wait_s"] = saves.last_wake_wait_s
        previous["loop_held_s"] = previous["hold_s"] + previous["wake_wait_s"]
    return out


def release_mode(rank, world, opts) -> dict:
    from tests.helpers.bodies.gpu_slime_shipped import patched_megatron_first

    patched_megatron_first()  # a spawned rank keeps its parent's sys.path: the patched copy goes first here
    import torch

    from safe_ckpt.staging import pool
    from tests.helpers.bodies import gpu_megatron as g
    from tests.helpers.bodies import gpu_slime_shipped as s
    from tests.gpu import test_real_slime_source as t

    g.MODEL_ARGS = g.MODEL_ARGS + _model_args(opts)
    slime = t.import_slime(opts["slime_src"])
    save_dir = os.path.join(opts["target"], "release")
    model, optimizer, scheduler = s.setup(save_dir, world, s.slime_release_train)
    from megatron.training import get_args
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint as stock_save_checkpoint

    from safe_ckpt.integrations import slime as integration
    from safe_ckpt.megatron import load_checkpoint as safe_load_checkpoint
    from tests.helpers.megatron_evidence import restore_adam_steps

    args = get_args()
    t.slime_actor_args(args, save_dir)
    args.offload_train, args.release_train, args.safe_ckpt_io_threads = False, True, opts["threads"]
    actor = t.hand_built_actor(slime["actor"], args, model, optimizer, scheduler)
    integration.install(args)
    model_module = slime["model"]
    routed = model_module.save_checkpoint
    it = 0
    g._train(model, optimizer, scheduler, it, it + 1)
    it += 1
    out = {"state_bytes": _state_bytes(model, optimizer), "rows": []}
    for r in range(opts["rounds"]):
        for variant in ("stock", "safe", "safe_load"):
            model_module.save_checkpoint = stock_save_checkpoint if variant == "stock" else routed
            try:
                start = time.monotonic()
                actor.save_model(it, force_sync=True)
                torch.cuda.synchronize()
                save_s = time.monotonic() - start
            finally:
                model_module.save_checkpoint = routed
            pool.release()  # the next actor is a new process: its first save allocates the pool again
            args.load = save_dir
            start = time.monotonic()
            load = safe_load_checkpoint if variant == "safe_load" else load_checkpoint
            args.iteration, args.num_floating_point_operations_so_far = load(model, optimizer, scheduler)
            torch.cuda.synchronize()
            load_s = time.monotonic() - start
            restore_adam_steps(optimizer)
            row = {"mode": "release", "variant": variant, "round": r, "iteration": it, "save_s": save_s,
                   "load_s": load_s, "step_cost_s": save_s + load_s}
            out["rows"].append(row)
            print("row", json.dumps(row), flush=True)
            g._train(model, optimizer, scheduler, it, it + 1)
            it += 1
            _keep_only(save_dir, it - 1)
    return out


def _patch_script():
    """scripts/slime_megatron_patch.py (scripts/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("slime_megatron_patch",
                                                  os.path.join(REPO, "scripts", "slime_megatron_patch.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _durable_at(inflight, done: dict) -> None:
    inflight.wait(600)
    done["s"] = time.monotonic()


def _keep_only(save_dir: str, iteration: int) -> None:
    """Remove every iteration directory but ``iteration``'s (tmpfs holds a few states at most)."""
    keep = f"iter_{iteration:07d}"
    for name in os.listdir(save_dir) if os.path.isdir(save_dir) else []:
        if name.startswith("iter_") and name != keep:
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def table(results: dict) -> str:
    lines = ["| mode | variant | rounds | loop held s | save s | durable s | load s | per-step cost s | "
             "GPU bytes added | pinned bytes added |", "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, res in results.items():
        rows = res.get("rows", [])
        for variant in dict.fromkeys(r["variant"] for r in rows):
            mine = [r for r in rows if r["variant"] == variant]

            def med(key, fmt="{:.2f}"):
                vals = [r[key] for r in mine if r.get(key) is not None]
                return fmt.format(statistics.median(vals)) if vals else "-"

            cost = "step_cost_s" if mode == "release" else "loop_held_s"
            lines.append(f"| {mode} | {variant} | {len(mine)} | {med('loop_held_s')} | "
                         f"{med('save_s') if mode == 'release' else med('hold_s')} | {med('durable_s')} | "
                         f"{med('load_s')} | {med(cost)} | {med('gpu_added_bytes', '{:.0f}')} | "
                         f"{med('pinned_bytes', '{:.0f}')} |")
    states = {mode: res.get("state_bytes") for mode, res in results.items()}
    lines.append("")
    lines.append(f"State per checkpoint (bytes): {states}. offload: 'save s' is save_model's own time; loop held "
                 "adds the next wake_up's wait. release: per-step cost = save + load; stock Megatron's load "
                 "but for safe_load, which loads through safe_ckpt.megatron.load_checkpoint.")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slime-src", default=os.environ.get("SLIME_SRC", ".slime"))
    parser.add_argument("--modes", default="offload,release")
    parser.add_argument("--target", default="/dev/shm/slime_modes")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=13)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--threads", type=int, default=8, help="safe_ckpt writer threads")
    parser.add_argument("--rollout-s", type=float, default=6.0)
    parser.add_argument("--megatron-patch", default=None, help="slime's megatron.patch (else the port)")
    parser.add_argument("--dry-run", action="store_true", help="check arguments and the patched Megatron only")
    parser.add_argument("--out", required=True, help="results prefix: PREFIX.json and PREFIX.md")
    cli = parser.parse_args(argv)
    opts = {k: getattr(cli, k) for k in ("slime_src", "target", "rounds", "layers", "hidden", "heads", "threads",
                                          "rollout_s")}
    opts["slime_src"] = os.path.abspath(cli.slime_src)
    modes = [m for m in cli.modes.split(",") if m]
    unknown = set(modes) - {"offload", "release"}
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}")
    megatron_dir = tempfile.mkdtemp(prefix="slime_megatron_")
    how = _patch_script().make(megatron_dir, cli.megatron_patch)
    print(f"slime megatron patch: {how} ({megatron_dir})", flush=True)
    if cli.dry_run:
        print("dry run: modes", modes, "opts", json.dumps(opts))
        return
    from tests.helpers.bodies import gpu_slime_shipped as s
    from tests.helpers.mp import run_world, values

    results = {}
    for mode in modes:
        saved = dict(os.environ)
        os.environ["PYTHONPATH"] = os.pathsep.join([megatron_dir, REPO, os.environ.get("PYTHONPATH", "")])
        os.environ["SLIME_MEGATRON"] = megatron_dir
        if mode == "offload":
            os.environ.update(s.preload_env())
        try:
            fn = offload_mode if mode == "offload" else release_mode
            (results[mode],) = values(run_world(1, fn, (opts,), backend="nccl", timeout_s=900))
        finally:
            os.environ.clear()
            os.environ.update(saved)
        shutil.rmtree(os.path.join(cli.target, mode), ignore_errors=True)
    with open(cli.out + ".json", "w") as f:
        json.dump({"opts": opts, "megatron_patch": how, "results": results}, f, indent=1, default=str)
    report = table(results)
    with open(cli.out + ".md", "w") as f:
        f.write(f"# slime's per-step checkpoint cost, two modes\n\n{report}\n")
    print(report)


if __name__ == "__main__":
    main()
