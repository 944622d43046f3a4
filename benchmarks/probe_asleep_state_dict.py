"""Probe (GPU machine): which step of Megatron's state-dict construction touches device memory
while torch_memory_saver has paused the training state.

A real GPTModel with the DistributedOptimizer (tests/helpers/bodies/gpu_megatron.py's model, `--ckpt-format
torch_dist`, dp_reshardable) is built and trained two steps inside a torch_memory_saver region with
a CPU backup, then paused, as slime's `sleep()` leaves it. Each step below then runs alone in a
fresh process (a touch of paused memory can kill the process instead of raising), under
torch.profiler, and reports its host-to-device / device-to-host copies, kernels and NCCL calls,
whether it raised (and what), and where the tensors it returned live (safe_ckpt's residence
classification, which asks the CUDA driver and reads nothing):
- ``metadata``: `_build_sharded_state_dict_metadata` (the sharding type);
- ``model``: `model[0].sharded_state_dict(metadata=...)`;
- ``optimizer``: the distributed optimizer's `sharded_state_dict(model_sd, metadata=...)` (dp_reshardable);
- ``rng``: `get_rng_state(ckpt_format, tp_group, pp_group)`;
- ``rerun``: the rerun state machine's `state_dict`;
- ``generate``: the whole `generate_state_dict` with all of the above;
- ``asleep_save``: safe_ckpt's asleep save end to end (`slime_asleep.start_asleep_save`), loaded back.
Writes `probe_asleep_state_dict.json` to $OUT (or --out) and prints it. Usage (one GPU):
  python benchmarks/probe_asleep_state_dict.py [--variant gpu|cpu_offload_pinned] [--steps model,rng]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ("metadata", "model", "optimizer", "rng", "rerun", "generate", "asleep_save")


def _residences(tree) -> dict:
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    from safe_ckpt.residence import classify as residence

    counts: dict = {}

    def add(kind, nbytes):
        entry = counts.setdefault(kind, {"tensors": 0, "bytes": 0})
        entry["tensors"] += 1
        entry["bytes"] += nbytes

    def walk(node):
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)
        elif isinstance(node, (ShardedTensor, ShardedTensorFactory)) and isinstance(node.data, torch.Tensor):
            walk(node.data)
        elif isinstance(node, ShardedObject):
            walk(node.data)
        elif isinstance(node, torch.Tensor):
            add(residence.classify(node).residence, node.numel() * node.element_size())

    walk(tree)
    return counts


def _step(rank, world, root, variant, step) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, REPO)
    from megatron.training import checkpointing as mck
    from megatron.training import get_args

    from safe_ckpt.integrations import slime_asleep, slime_groups
    from safe_ckpt.megatron import training
    from tests.helpers.bodies import gpu_megatron as g
    from tests.helpers.bodies.gpu_slime_asleep import _memory_saver, profile_counts

    # megatron.core's inference code sets torch_memory_saver's hook mode when it is first
    # imported, which fails once a region has been used: import it before the first region
    import megatron.core  # noqa: F401
    import megatron.training  # noqa: F401

    tms = _memory_saver()
    with tms.region(tag="train", enable_cpu_backup=True):
        model, optimizer, scheduler = g._setup(os.path.join(root, step), variant, world)
        g._train(model, optimizer, scheduler, 0, 2)
    torch.cuda.synchronize()
    args = get_args()
    slime_groups.install_detached_support()
    group = slime_groups.create_detached_gloo(120.0)
    snapshot = slime_groups.snapshot_groups()
    tms.pause("train")
    out: dict = {"step": step, "variant": variant}
    returned = None
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            metadata = training._sharding_metadata(mck, args, None)
            if step == "metadata":
                returned = metadata
            elif step == "model":
                returned = model[0].sharded_state_dict(metadata=metadata)
            elif step == "optimizer":
                returned = optimizer.sharded_state_dict(model[0].sharded_state_dict(metadata=metadata),
                                                        metadata=metadata)
            elif step == "rng":
                returned = training._rng_state(mck, args, {})
            elif step == "rerun":
                returned = training._rerun_state(args, None)
            elif step == "generate":
                returned = mck.generate_state_dict(
                    args, model, optimizer, scheduler, training._rng_state(mck, args, {}),
                    **training._accepted(mck.generate_state_dict, {
                        "iteration": 2, "optim_sd_kwargs": dict(metadata=metadata),
                        "model_sd_kwargs": dict(metadata=metadata),
                        "rerun_state": training._rerun_state(args, None)}))
            elif step == "asleep_save":
                args.save = os.path.join(root, step)
                handle = slime_asleep.start_asleep_save(args, model, optimizer, scheduler, 2, group, snapshot)
                out["bytes_by_residence"] = dict(handle.wait().bytes_by_residence)
            torch.cuda.synchronize()
        out["profile"] = profile_counts(prof)
        out["ok"] = True
    except BaseException as exc:  # the report says what broke
        out["ok"] = False
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-3000:]
    if returned is not None:
        out["returned_residences"] = _residences(returned)
    if step == "metadata":
        out["metadata"] = {k: str(v) for k, v in (returned or {}).items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", default="gpu", choices=("gpu", "cpu_offload_pinned", "cpu_offload_pageable_grads"))
    parser.add_argument("--steps", default=",".join(STEPS))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    opts = parser.parse_args()
    sys.path.insert(0, REPO)
    from tests.helpers.mp import run_world

    report = []
    with tempfile.TemporaryDirectory() as root:
        for step in opts.steps.split(","):
            (status, value), = run_world(1, _step, (root, opts.variant, step), backend="nccl", timeout_s=300)
            if status != "ok":  # the process died or hung: that is the finding
                value = {"step": step, "ok": False, "process": status, "detail": value}
            report.append(value)
            print(json.dumps({k: v for k, v in value.items() if k != "traceback"}), flush=True)
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "probe_asleep_state_dict.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
