"""GPU rank bodies for safe_ckpt's load path: a real GPTModel with Megatron's DistributedOptimizer
resumed through `safe_ckpt.megatron.load_checkpoint` (from safe_ckpt's checkpoint and from stock
Megatron's), to train on beside a stock resume; and synthetic state loaded into GPU templates.
Needs CUDA, and Megatron-LM's `megatron.training` for the real model (see tests/helpers/bodies/gpu_megatron.py)."""

from __future__ import annotations

import os

from tests.helpers.bodies import gpu_megatron as g
from tests.helpers.megatron_evidence import evidence, opt_digest, restore_adam_steps


def resume_through_safe_ckpt(rank, world, root, variant, which) -> dict:
    """As gpu_megatron_cases.run's resume, with `safe_ckpt.megatron.load_checkpoint` as the loader of
    ``which`` checkpoint ("safe": safe_ckpt's, "stock": stock Megatron's), installed the way a
    user installs it: in place of megatron.training's own."""
    from megatron.training import checkpointing as mck
    from megatron.training import get_args

    import safe_ckpt.megatron as safe_megatron

    save_dir = os.path.join(root, which)
    model, optimizer, scheduler = g._setup(save_dir, variant, world)
    args = get_args()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):  # see gpu_megatron_cases.run
        init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
        if init is not None:
            init()
    args.load = save_dir
    stock_loader = mck.load_checkpoint
    mck.load_checkpoint = safe_megatron.load_checkpoint
    try:
        args.iteration, args.num_floating_point_operations_so_far = mck.load_checkpoint(model, optimizer, scheduler)
    finally:
        mck.load_checkpoint = stock_loader
    loaded = safe_megatron.loaded_checkpoint()
    out = {"start_iteration": args.iteration, "loaded": (loaded.save_root, loaded.iteration) if loaded else None,
           "opt_digest_as_loaded": evidence(opt_digest, optimizer, scheduler)}
    if os.environ.get("SAFE_CKPT_TEST_NO_STEP_REPAIR") != "1":
        out["adam_step_repair"] = restore_adam_steps(optimizer)
    out["opt_digest"] = evidence(opt_digest, optimizer, scheduler)
    out["losses"] = g._train(model, optimizer, scheduler, args.iteration, args.iteration + g.SECOND)
    return out
