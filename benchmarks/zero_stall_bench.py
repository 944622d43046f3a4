"""What a checkpoint save costs a training step, five ways, for the same state in the same process.

One process, one GPU: a real GPTModel (657 M parameters at the defaults: 13 layers, hidden 2048,
16 heads, sequence 2048; ~9.2 GB of saved state) with Megatron's DistributedOptimizer, trained by
Megatron's forward_backward_func and optimizer step in a loop whose steps each end in the loss's
`.item()`. The number of micro-batches is calibrated so forward+backward takes ``--window-s``.
After a baseline of steps without saves, each mode saves ``--saves`` times; every save is followed
by ``--post-steps`` timed steps and its completion:
- ``overlap``: this mode: the Megatron drop-in with ``--safe-ckpt-overlap-copy`` and ``--async-save``
  (`SaveOptions.return_after="planned"`): the call returns after planning, the copies start at the
  next step's ``zero_grad`` and run during its forward+backward, the optimizer step's pre-hook waits
  for what is left; the untimed save checks its checkpoint against today's async save of the same state;
- ``window_core`` (not in the default modes): the copy window alone (safe_ckpt.staging.window / window_copier / gates):
  the save call builds Megatron's state dict (as the drop-in does); the window opens at the next
  step's ``zero_grad``; the copies into the pinned pool run during forward+backward; the optimizer
  step's pre-hook is the gate; drain threads stand for the writers (no files). One more, untimed,
  save checks every chunk's bytes against a copy taken before the window;
- ``writes_beside`` (not in the default modes): the target alone: at the call, a separate process
  (zero_stall_writer.py, started and its seeded random buffer filled when the mode begins, before
  any timed step) writes as many bytes as the saved state into the save's directory, in as many
  files (two of equal size per writer thread), with the drop-in's writer threads, niceness and
  fsync; no copies, no hashing; to durable is the end of its writes. With ``window_core`` (the
  copies alone) and ``overlap`` / ``safe_async`` (both) in one run, the report sets them side by side;
- ``safe_async``: today's drop-in async save (returns once the device bytes are in the pool);
- ``dcp_async``: `dcp.async_save` with its pinned `DefaultStager`, staging waited for just before
  the optimizer step (torchtitan's pattern);
- ``megatron_async``: stock Megatron `save_checkpoint` with `--async-save`, finalized at loop tops.
The report (zero_stall_report.py) gives per mode: stall, the step containing the save against a
step without, forward+backward slowdown, time to durable and PCIe TX throughput (NVML), and the
next step's host time (the training thread's time to enqueue forward+backward and its CPU time).

Run from the repository root on the GPU machine (megatron.training importable, e.g. megatron-core
0.19 or a Megatron-LM checkout at .mlm/):
  python benchmarks/zero_stall_bench.py --variant gpu --target /dev/shm/zs --out RES/zero_stall_gpu
  python benchmarks/zero_stall_bench.py --variant cpu_offload --target /dev/shm/zs --out RES/zero_stall_offload
  python benchmarks/zero_stall_bench.py --modes window_core,writes_beside,overlap,safe_async --saves 4 \
      --target /dev/shm/zs --out RES/zero_stall_parts   (copies alone, writes alone, both)
The harness on the CPU (a small torch model and `safe_ckpt.async_save`; every mode but stock Megatron's):
  python benchmarks/zero_stall_bench.py --dry-run --target /tmp/zs_dry --out /tmp/zs_dry
Rebuild a report: --rebuild RUN.json --out PREFIX

Must not: be imported by the library.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from zero_stall_modes import MODE_CLASSES, Unavailable  # noqa: E402
from zero_stall_report import write_report  # noqa: E402
from zero_stall_trainers import make_trainer  # noqa: E402


class PcieSampler:
    """NVML's PCIe TX throughput of GPU 0 (device to host, KB/s over 20 ms), sampled every 20 ms."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self._samples: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def maybe():
        try:
            import torch

            return PcieSampler() if torch.cuda.is_available() else None
        except Exception:
            return None

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            kbs = self._nvml.nvmlDeviceGetPcieThroughput(self._handle, self._nvml.NVML_PCIE_UTIL_TX_BYTES)
            self._samples.append((time.perf_counter(), kbs))

    def mean_gbps(self, start: float, end: float):
        values = [kbs for t, kbs in list(self._samples) if start <= t <= end]
        return sum(values) / len(values) * 1e3 / 1e9 if values else None

    def close(self) -> None:
        self._stop.set()


def run_steps(trainer, n: int, hooks=None, sampler=None) -> list[dict]:
    rows = []
    for _ in range(n):
        t0 = time.perf_counter()
        row = trainer.step(hooks)
        row["iter_s"] = time.perf_counter() - t0
        if sampler is not None:
            row["pcie_tx_gbps"] = sampler.mean_gbps(t0, t0 + row["iter_s"])
        rows.append(row)
    return rows


# "MODE:KEY=V+KEY=V": a mode with some safe_ckpt settings changed, as Megatron flags would
OVERRIDES = {"io": "safe_ckpt_io_threads", "nice": "safe_ckpt_writer_nice"}


class StallProfile:
    """cProfile of the training thread's time in one save's call and in the window's opening
    (`gates.open_deferred`), written to PREFIX_profile_MODE.txt, the top entries by cumulative time."""

    def __init__(self, prefix: str, mode: str) -> None:
        import cProfile

        from safe_ckpt.staging import gates

        self.path = f"{prefix}_profile_{mode.replace(':', '_')}.txt"
        self.profile, self.gates = cProfile.Profile(), gates
        self.inner = gates.open_deferred
        self.active = False

        def opening() -> None:
            if self.active:  # inside the profiled call (it also polls the trigger): already counted
                self.inner()
                return
            self.profile.enable()
            try:
                self.inner()
            finally:
                self.profile.disable()

        gates.open_deferred = opening

    def __enter__(self):
        self.profile.enable()
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        self.profile.disable()

    def close(self) -> None:
        import io
        import pstats

        self.gates.open_deferred = self.inner
        text = io.StringIO()
        stats = pstats.Stats(self.profile, stream=text)
        stats.sort_stats("cumulative").print_stats(60)
        stats.sort_stats("tottime").print_stats(40)
        with open(self.path, "w") as f:
            f.write(text.getvalue())


def run_mode(name: str, trainer, opts: dict, sampler) -> list[dict]:
    base, _, spec = name.partition(":")
    trainer.overrides = {OVERRIDES[k]: int(v) for k, v in (p.split("=") for p in spec.split("+") if p)}
    mode = MODE_CLASSES[base](trainer, opts)
    saves = opts["saves_per_mode"].get(name, opts["saves_per_mode"].get(base, opts["saves"]))
    rows = []
    try:
        for k in range(saves + (1 if mode.verifies else 0)):
            untimed = k == saves  # the last, untimed save checks the bytes
            run_steps(trainer, 1)  # a plain step between saves
            directory = os.path.join(opts["target"], f"{name}_{k}")
            shutil.rmtree(directory, ignore_errors=True)
            # the last timed save alone, profiled if asked: its timings are in the row, marked
            profile = StallProfile(opts["profile"], name) if opts.get("profile") and k == saves - 1 else None
            t0 = time.perf_counter()
            if profile is not None:
                with profile:
                    mode.save(directory, verify=untimed)
            else:
                mode.save(directory, verify=untimed)
            call_s = time.perf_counter() - t0
            try:
                steps = run_steps(trainer, opts["post_steps"], mode.hooks(), sampler)
            finally:
                if profile is not None:
                    profile.close()
            done = mode.finish()
            # the deferred window's opening runs in the next step's zero_grad, in the training thread
            opening_s = steps[0].get("zero_grad_s", 0.0) if getattr(mode, "opens_at_zero_grad", False) else 0.0
            row = {"call_s": call_s, "next": steps[0], "after": steps[1:], **done, "opening_s": opening_s,
                   "stall_s": call_s + done.get("gate_s", 0.0) + opening_s, "untimed": untimed,
                   "profiled": profile is not None}
            rows.append(row)
            print(f"{name} save {k}{' (verify)' if untimed else ''}: call {call_s:.4f}s gate "
                  f"{done.get('gate_s', 0):.4f}s next step {steps[0]['iter_s']:.3f}s ttd {done.get('ttd_s')} "
                  f"verified {done.get('verified')}", flush=True)
            print("row", json.dumps({"mode": name, **row}, default=str), flush=True)
            shutil.rmtree(directory, ignore_errors=True)
            for extra in done.get("cleanup", []):
                shutil.rmtree(extra, ignore_errors=True)
    finally:
        mode.close()
        trainer.overrides = {}
    return rows


def body(rank, world, opts) -> dict:
    import torch

    trainer = make_trainer(opts, world)
    microbatches = trainer.calibrate(opts["window_s"])
    trainer.measure_state()
    out = {"variant": opts["variant"], "torch": torch.__version__, "target": opts["target"], "modes": {},
           "notes": [], "microbatches": microbatches, **trainer.describe()}
    print("calibrated:", microbatches, "micro-batches;", trainer.describe(), flush=True)
    t0 = time.perf_counter()
    trainer.prepare_pool()
    out["pool_prepare_s"] = time.perf_counter() - t0
    sampler = PcieSampler.maybe()
    try:
        out["baseline"] = run_steps(trainer, opts["baseline_steps"], sampler=sampler)
        print("baseline iter_s", [round(r["iter_s"], 4) for r in out["baseline"]], flush=True)
        for name in opts["modes"]:
            try:
                out["modes"][name] = run_mode(name, trainer, opts, sampler)
            except Unavailable as exc:
                out["modes"][name] = {"skipped": str(exc)}
                print(f"{name}: skipped ({exc})", flush=True)
            except Exception as exc:  # one mode's failure leaves the others' rows
                import traceback

                traceback.print_exc()
                out["modes"][name] = {"skipped": f"failed: {type(exc).__name__}: {str(exc)[:300]}"}
        out["baseline_after"] = run_steps(trainer, max(2, opts["baseline_steps"] // 2), sampler=sampler)
    finally:
        if sampler is not None:
            sampler.close()
    out["losses_finite"] = trainer.losses_finite()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=("gpu", "cpu_offload"), default="gpu")
    parser.add_argument("--target", help="directory for the checkpoints (tmpfs: /dev/shm/...)")
    parser.add_argument("--out", required=True, help="results prefix: PREFIX.json and PREFIX.md")
    parser.add_argument("--modes", default="overlap,safe_async,dcp_async,megatron_async",
                        help="comma-separated, from: window_core,writes_beside,overlap,safe_async,dcp_async,"
                             "megatron_async; MODE:io=N+nice=K changes the safe_ckpt writer threads / niceness of "
                             "that run (writes_beside: of its writer process)")
    parser.add_argument("--saves", type=int, default=3, help="timed saves per mode")
    parser.add_argument("--saves-per-mode", default="dcp_async=2,megatron_async=1",
                        help="MODE=N,...: other counts (stock Megatron's cold save alone takes ~40 s)")
    parser.add_argument("--post-steps", type=int, default=2)
    parser.add_argument("--baseline-steps", type=int, default=8)
    parser.add_argument("--window-s", type=float, default=0.5, help="forward+backward time to calibrate to")
    parser.add_argument("--threads", type=int, default=16, help="writer threads of every saver")
    parser.add_argument("--layers", type=int, default=13)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--profile", help="PREFIX: cProfile each mode's last timed save (its call and the window's "
                        "opening) into PREFIX_profile_MODE.txt; that save's row is marked profiled")
    parser.add_argument("--dry-run", action="store_true", help="a small CPU model: exercise the harness")
    parser.add_argument("--rebuild", help="write the report from a run's JSON instead of running")
    parser.add_argument("--label", default="Training step cost of a checkpoint save (one GPU)")
    ns = parser.parse_args()
    if ns.rebuild:
        write_report(json.load(open(ns.rebuild)), ns.out, ns.label)
        return
    if not ns.target:
        parser.error("--target is required")
    modes = [m for m in ns.modes.split(",") if m]
    for m in modes:
        base, _, spec = m.partition(":")
        keys = [p.partition("=")[0] for p in spec.split("+") if p]
        if base not in MODE_CLASSES or any(k not in OVERRIDES for k in keys):
            parser.error(f"--modes: {m!r} is not MODE or MODE:KEY=N+KEY=N with MODE one of {', '.join(MODE_CLASSES)} "
                         f"and KEY one of {', '.join(OVERRIDES)}")
    os.makedirs(ns.target, exist_ok=True)
    opts = {"variant": ns.variant, "target": ns.target, "modes": modes,
            "saves": ns.saves,
            "saves_per_mode": {k: int(v) for k, v in (p.split("=") for p in ns.saves_per_mode.split(",") if p)},
            "post_steps": max(1, ns.post_steps), "baseline_steps": ns.baseline_steps,
            "window_s": ns.window_s, "threads": ns.threads, "layers": ns.layers, "hidden": ns.hidden,
            "heads": ns.heads, "seq_length": ns.seq_length, "dry_run": ns.dry_run, "profile": ns.profile}
    from tests.helpers.mp import run_world

    backend = "gloo" if ns.dry_run else "nccl"
    ((status, out),) = run_world(1, body, (opts,), backend=backend, timeout_s=1800)
    if status != "ok":
        raise SystemExit(f"the run failed: {out}")
    write_report(out, ns.out, ns.label + (" (CPU dry run)" if ns.dry_run else ""))
    print(open(ns.out + ".md").read())


if __name__ == "__main__":
    main()
