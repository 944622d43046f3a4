"""Mirror of slime's `slime/backends/megatron_utils/checkpoint.py` (THUDM/slime 624b824a): the
re-export of Megatron's `save_checkpoint`, and `load_checkpoint`, which calls the module-level name
`_load_checkpoint_megatron` (Megatron's `load_checkpoint`, bound at import) for a Megatron
checkpoint, line for line. Left out: slime's import-time patch of torch's `ShardedTensor`
validation (a speed-up with the same results, not on the path safe_ckpt replaces) and the
HuggingFace path's body (`_load_checkpoint_hf` needs slime's `hf_to_megatron` and an HF checkpoint:
it raises NotImplementedError here)."""

import logging
import os
import re
from pathlib import Path

from megatron.training.checkpointing import load_checkpoint as _load_checkpoint_megatron
from megatron.training.checkpointing import save_checkpoint  # as slime: a plain re-export
from megatron.training.global_vars import get_args

logger = logging.getLogger(__name__)

__all__ = ["save_checkpoint"]


def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, checkpointing_context, skip_load_to_model_and_opt):
    # ref: how megatron `load_checkpoint` gets directory
    args = get_args()
    load_path = args.load

    assert Path(load_path).exists() and _is_dir_nonempty(
        load_path
    ), f"{args.load=} does not exist or is an empty directory. Did you specify the wrong folder?"

    if _is_megatron_checkpoint(load_path):
        return _load_checkpoint_megatron(
            ddp_model=ddp_model,
            optimizer=optimizer,
            opt_param_scheduler=opt_param_scheduler,
            checkpointing_context=checkpointing_context,
            skip_load_to_model_and_opt=skip_load_to_model_and_opt,
        )
    else:
        return _load_checkpoint_hf(
            ddp_model=ddp_model,
            optimizer=optimizer,
            args=args,
            load_path=load_path,
        )


def _is_megatron_checkpoint(path: str | Path) -> bool:
    return (Path(path) / "latest_checkpointed_iteration.txt").is_file() or bool(
        re.fullmatch(r"iter_\d{7}", Path(path).name)
    )


def _load_checkpoint_hf(ddp_model, optimizer, args, load_path: str):
    raise NotImplementedError(f"the slime mirror has no HuggingFace load (slime's load_hf_weights); "
                              f"{load_path} is not a Megatron checkpoint")


def _is_dir_nonempty(path):
    with os.scandir(path) as it:
        return any(it)
