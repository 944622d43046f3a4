"""Rank bodies for the remembered tensor plan (spawned ranks, see mp.py): saves of one model in
one process, the later ones planned from the memo, each loaded back through stock Megatron."""

from __future__ import annotations

import torch


def saves_of_one_state_load_back_as_saved(rank, world, root) -> dict:
    """Three saves of the same sharded layout (values and an object's size change between them;
    the last one returns right after planning); each checkpoint holds its own save's values."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    import safe_ckpt
    from safe_ckpt.plan import process_memo

    gen = torch.Generator().manual_seed(40 + rank)
    weights = [torch.randn(300, 257, generator=gen), torch.randn(4099, generator=gen).to(torch.bfloat16)]

    def state(step, like=None):
        tensors = weights if like is None else [torch.empty_like(w) for w in weights]
        sd = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", t, (0, rank, world)) for i, t in enumerate(tensors)}
        sd["meta"] = ShardedObject("meta", None if like else {"step": step, "pad": "x" * step}, (world,), (rank,))
        return sd

    process_memo.clear()
    hits, saved = [], {}
    for step in (1, 12, 30):
        for w in weights:
            w.add_(torch.randn(w.shape, generator=gen).to(w.dtype))
        saved[step] = [w.clone() for w in weights]
        before = process_memo._last
        path = f"{root}/s{step}"
        if step == 30:
            handle = safe_ckpt.async_save(state(step), path, options=safe_ckpt.SaveOptions(return_after="planned"))
            handle.wait()
        else:
            safe_ckpt.save(state(step), path)
        hits.append(before is not None and process_memo._last is before)
    torch.distributed.barrier()
    equal = {}
    for step, values in saved.items():
        loaded = dist_checkpointing.load(state(step, like=True), f"{root}/s{step}")
        equal[step] = all(torch.equal(loaded[f"w{i}"], want) for i, want in enumerate(values)) and \
            loaded["meta"] == {"step": step, "pad": "x" * step}
    return {"hits": hits, "equal": equal}
