"""Rank bodies of the Megatron `load_checkpoint` tests (see mp.py): iterations saved by
`safe_ckpt.megatron.save_checkpoint`, then resumed by stock `load_checkpoint` (the
megatron.training stand-in, core_v0.19.0's load path) and by `safe_ckpt.megatron.load_checkpoint`
under each resume flag; what the model, optimizer, scheduler and RNGs received must be equal."""

from __future__ import annotations

import functools
import os
import random
import sys
from argparse import Namespace

import numpy as np
import torch

from safe_ckpt_lab.synthetic import StateSpec, bits_equal, build_state, reference_tensors
from tests.helpers.bodies.common import SMALL
from tests.helpers.paths import REPO

STAND_INS = os.path.join(REPO, "tests", "stand_ins")


class Model:
    """A model whose sharded state dict is the synthetic one; records what a load hands it."""

    def __init__(self, state):
        self.state = state
        self.received = None

    def sharded_state_dict(self, metadata=None, **kwargs):
        return self.state["model"]

    def load_state_dict(self, state_dict, strict=True):
        self.received = {k: [t.clone() for t in v] if isinstance(v, list) else v.clone() for k, v in state_dict.items()}


class Optimizer:
    is_stub_optimizer = False
    param_groups: list = []

    def __init__(self, state):
        self.state = state
        self.received = None
        self.reloaded = 0

    def sharded_state_dict(self, model_state_dict, metadata=None, is_loading=False, **kwargs):
        return self.state["optimizer"]

    def load_state_dict(self, state_dict):
        self.received = {k: [p["tensor"].clone() for p in v] for k, v in state_dict["distributed"].items()}

    def reload_model_params(self, state_dict=None):
        self.reloaded += 1


class Scheduler:
    def __init__(self, steps):
        self.steps = steps
        self.received = None

    def state_dict(self):
        return {"max_lr": 1e-4, "num_steps": self.steps}

    def load_state_dict(self, state_dict):
        self.received = dict(state_dict)


def _args(root, world, **flags):
    base = dict(save=root, load=root, ckpt_format="torch_dist", use_distributed_optimizer=True, no_save_optim=False,
                no_save_rng=False, no_load_optim=False, no_load_rng=False, finetune=False, ckpt_step=None,
                tensor_model_parallel_size=world, pipeline_model_parallel_size=1, world_size=world,
                data_parallel_size=1, async_save=False, ckpt_fully_parallel_load=True,
                ckpt_assume_constant_structure=False, ckpt_load_validate_sharding_integrity=True,
                dist_ckpt_strictness="assume_ok_unexpected", verify_integrity=False, data_parallel_random_init=False,
                bf16=True, fp16=False, pretrained_checkpoint=None, consumed_train_samples=0, hidden_size=64,
                safe_ckpt_io_threads=2, safe_ckpt_timeout_s=60)
    base.update(flags)
    return Namespace(**base)


def _seed_rngs(value):
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


def _rng_draws():
    return (random.random(), float(np.random.rand()), float(torch.rand(1)))


def _spec(iteration):
    return StateSpec(**{**SMALL, "seed": iteration})


def save_iterations(rank, world, root, iterations=(5, 7)) -> dict:
    if STAND_INS not in sys.path:
        sys.path.insert(0, STAND_INS)
    from megatron.core import mpu
    from megatron.training.global_vars import set_args

    import safe_ckpt.megatron as safe_megatron

    mpu.initialize_model_parallel(world, 1)
    draws = {}
    for it in iterations:
        set_args(_args(root, world, consumed_train_samples=100 * it))
        state = build_state(rank, world, tp=world, spec=_spec(it), references=reference_tensors(_spec(it), world))
        _seed_rngs(1000 + it)
        safe_megatron.save_checkpoint(it, [Model(state)], Optimizer(state), Scheduler(10 * it),
                                      num_floating_point_operations_so_far=3 * it)
        draws[it] = _rng_draws()  # what a resume of this iteration draws next
    return draws


def _fresh(rank, world, it):
    spec = _spec(it)
    state = build_state(rank, world, tp=world, spec=spec, layout="alt", empty=True,
                        references=reference_tensors(spec, world))
    return [Model(state)], Optimizer(state), Scheduler(0)


def _resume(load_checkpoint, rank, world, root, flags, expect_it) -> dict:
    from megatron.training.global_vars import set_args

    args = _args(root, world, **flags)
    set_args(args)
    model, optimizer, scheduler = _fresh(rank, world, expect_it)
    _seed_rngs(12345)
    iteration, flops = load_checkpoint(model, optimizer, scheduler)
    return {"iteration": iteration, "flops": flops, "model": model[0].received, "optimizer": optimizer.received,
            "reloaded": optimizer.reloaded, "scheduler": scheduler.received, "draws": _rng_draws(),
            "consumed": args.consumed_train_samples}


def _differences(ours, stock) -> list[str]:
    out = [k for k in ("iteration", "flops", "reloaded", "scheduler", "draws", "consumed") if ours[k] != stock[k]]
    for part in ("model", "optimizer"):
        a, b = ours[part], stock[part]
        if (a is None) != (b is None) or (a is not None and a.keys() != b.keys()):
            out.append(f"{part}: keys differ")
            continue
        for key in (a or {}):
            x, y = a[key], b[key]
            pairs = zip(x, y) if isinstance(x, list) else [(x, y)]
            if isinstance(x, list) and len(x) != len(y) or not all(bits_equal(p, q) for p, q in pairs):
                out.append(f"{part}.{key}: differs")
    return out


def _model_matches(received, rank, world, it) -> list[str]:
    spec = _spec(it)
    expected = build_state(rank, world, tp=world, spec=spec, layout="alt", references=reference_tensors(spec, world))
    out = []
    for key, value in expected["model"].items():
        if key not in received:
            out.append(f"{key}: not received")
            continue
        ref = [v.data for v in value] if isinstance(value, list) else [getattr(value, "data", None)]
        got = received[key] if isinstance(received[key], list) else [received[key]]
        if ref[0] is None:  # a factory: its merged tensor
            continue
        if not all(bits_equal(a, b) for a, b in zip(got, ref)):
            out.append(f"{key}: differs")
    return out


CASES = {  # name: (flags, iteration loaded)
    "latest": ({}, 7),
    "ckpt_step": ({"ckpt_step": 5}, 5),
    "no_load_optim": ({"no_load_optim": True}, 7),
    "no_load_rng": ({"no_load_rng": True}, 7),
    "finetune": ({"finetune": True}, 7),
}


def resume_every_way(rank, world, root) -> dict:
    if STAND_INS not in sys.path:
        sys.path.insert(0, STAND_INS)
    from megatron.core import mpu
    from megatron.training import checkpointing as stock

    import safe_ckpt.megatron as safe_megatron
    from safe_ckpt.megatron import resume

    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(world, 1)
    out = {}
    for name, (flags, it) in CASES.items():
        resume.forget()
        ours = _resume(safe_megatron.load_checkpoint, rank, world, root, flags, it)
        loaded = safe_megatron.loaded_checkpoint()
        protected = sorted(resume.protected(root))  # what retention keeps for this load
        theirs = _resume(stock.load_checkpoint, rank, world, root, flags, it)
        out[name] = {"differences": _differences(ours, theirs), "iteration": ours["iteration"],
                     "model": _model_matches(ours["model"], rank, world, it), "draws": ours["draws"],
                     "optimizer_loaded": ours["optimizer"] is not None, "reloaded": ours["reloaded"],
                     "scheduler": ours["scheduler"], "flops": ours["flops"], "consumed": ours["consumed"],
                     "loaded": (loaded.save_root, loaded.iteration) if loaded else None, "protected": protected,
                     "module_restored": stock.dist_checkpointing.__name__ == "megatron.core.dist_checkpointing"}
    return out


def save_and_resume(rank, world, root) -> dict:
    return {"draws": save_iterations(rank, world, root), "resumes": resume_every_way(rank, world, root)}


def installed_in_place(rank, world, root) -> dict:
    """`checkpointing.load_checkpoint = safe_ckpt.megatron.load_checkpoint`, as the docs say to
    install it, then a resume through the module's attribute: it must read through safe_ckpt and
    return what stock's resume returns (it once called itself and waited on its own lock)."""
    if STAND_INS not in sys.path:
        sys.path.insert(0, STAND_INS)
    from megatron.core import mpu
    from megatron.training import checkpointing as mck

    import safe_ckpt.megatron as safe_megatron
    from safe_ckpt.megatron import resume

    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(world, 1)
    flags, it = CASES["latest"]
    stock_fn = mck.load_checkpoint
    theirs = _resume(stock_fn, rank, world, root, flags, it)
    mck.load_checkpoint = safe_megatron.load_checkpoint
    try:
        ours = _resume(mck.load_checkpoint, rank, world, root, flags, it)
    finally:
        mck.load_checkpoint = stock_fn
    loaded = safe_megatron.loaded_checkpoint()

    @functools.wraps(stock_fn)  # a user's logging wrapper: Megatron's name and module, safe_ckpt's loader
    def logged(*a, **k):
        return safe_megatron.load_checkpoint(*a, **k)

    mck.load_checkpoint = logged
    try:
        wrapped = _resume(mck.load_checkpoint, rank, world, root, flags, it)
    finally:
        mck.load_checkpoint = stock_fn
    return {"differences": _differences(ours, theirs), "iteration": ours["iteration"],
            "wrapped_differences": _differences(wrapped, theirs),
            "loaded": (loaded.save_root, loaded.iteration) if loaded else None}


def save_and_install_in_place(rank, world, root) -> dict:
    save_iterations(rank, world, root)
    return installed_in_place(rank, world, root)
