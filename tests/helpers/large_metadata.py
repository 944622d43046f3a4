"""Large, real `.metadata` files for the reader's tests: the qwen3-4b-dp8 bench preset's layout
(1217 shards per rank: one data-parallel rank's share of Qwen3-4B's bf16 weights and its fp32
optimizer buckets cut into per-parameter pieces), each shard shrunk to a few elements so that
saving writes little, while the index keeps every chunk, key and offset width.

`planned_index(world)`: the index this library writes for the preset at full size (planning
only, nothing written). `save_stock_megatron` / `save_safe_ckpt`: a `tests.helpers.mp.run_world` target
saving the shrunk state with stock Megatron (`dist_checkpointing.save`, torch_dist) or this
library; `save_stock_dcp`: stock `torch.distributed.checkpoint.save` of the same pieces as
DTensor shards."""

from __future__ import annotations

import os

import torch

PREFIX = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32)"


def pieces(world: int = 8, shrink: int = 1) -> list[tuple[str, list[int], torch.dtype]]:
    """(key, this rank's piece sizes, dtype) of the preset, sizes divided by ``shrink`` (at least 1)."""
    from safe_ckpt_lab.bench import state as bench_state

    out = [(key, [max(1, n // shrink)], torch.bfloat16) for key, n in bench_state._weights_spec("qwen3-4b-dp8", 1.0, world)]
    for b, sizes in enumerate(bench_state._bucket_pieces("qwen3-4b-dp8", 1.0, world)):
        for name in ("param", "exp_avg", "exp_avg_sq"):
            out.append((f"{PREFIX}.bucket_idx_{b}.{name}", [max(1, n // shrink) for n in sizes], torch.float32))
    return out


def sharded_state(rank: int, world: int, shrink: int, allocate) -> dict:
    """Megatron ShardedTensors: each key split across ranks, each rank's part cut into its pieces."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    out = {}
    g = torch.Generator().manual_seed(rank)
    for key, sizes, dtype in pieces(world, shrink):
        local, off = sum(sizes), 0
        for size in sizes:
            t = allocate(size, dtype, g)
            out[f"{key}@{local * rank + off}"] = ShardedTensor(
                key, t, dtype, (size,), (local * world,), (local * rank + off,), axis_fragmentations=None,
                replica_id=0)
            off += size
    out["param_groups"] = ShardedObject("optimizer.param_groups", {"lr": 1e-4, "step": 4}, (world,), (rank,))
    return out


def _random(size, dtype, g):
    return torch.randn(size, generator=g).to(dtype)


def planned_index(world: int = 8) -> bytes:
    """The `.metadata` this library writes for the preset at full size at ``world`` ranks."""
    from safe_ckpt.encoding.layout import lay_out
    from safe_ckpt.encoding.metadata import build_metadata, metadata_bytes
    from safe_ckpt.plan import build_global_plan, collect, rank_plan

    plans = []
    for rank in range(world):
        state = sharded_state(rank, world, 1, lambda size, dtype, g: torch.empty(size, dtype=dtype))
        local = collect(state, rank)
        plans.append(rank_plan(local, ["pageable_host"] * len(local.shards), []))
    plan = build_global_plan(plans, 64 << 20)
    return metadata_bytes(build_metadata(plan, lay_out(plan), "/ckpt/iter_0000004", "planned"))


def save_stock_megatron(rank: int, world: int, path: str, shrink: int) -> int:
    """Megatron's torch_dist save as `TorchDistSaveShardedStrategy.async_save` runs it (its key
    translation, `mcore_to_pyt_state_dict`, `MCoreSavePlanner`), written by DCP's stock
    `FileSystemWriter`, whose `finish` Megatron's writer inherits to pickle the index (Megatron's
    own writer forks its workers, which hang under this test's spawned gloo ranks)."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.strategies.torch import (MCoreSavePlanner,
                                                                   _replace_state_dict_keys_with_sharded_keys,
                                                                   mcore_to_pyt_state_dict)

    if rank == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state(rank, world, shrink, _random), True)
    pyt = mcore_to_pyt_state_dict(sharded, False)
    dcp.save(pyt, storage_writer=dcp.FileSystemWriter(path, thread_count=1),
             planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False))
    if rank == 0:  # as `dist_checkpointing.save` does after the strategy
        save_config(CheckpointingConfig("torch_dist", 1), path)
    torch.distributed.barrier()
    return os.path.getsize(os.path.join(path, ".metadata"))


def save_safe_ckpt(rank: int, world: int, path: str, shrink: int) -> int:
    import safe_ckpt

    safe_ckpt.save(sharded_state(rank, world, shrink, _random), path,
                   options=safe_ckpt.SaveOptions(io_threads=1, progress_interval_s=0))
    return os.path.getsize(os.path.join(path, ".metadata"))


def save_stock_dcp(rank: int, world: int, path: str, shrink: int) -> int:
    """Each key a DTensor sharded along dim 0 over the ranks (stock DCP's own plan and index)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    state = {}
    for key, sizes, dtype in pieces(world, shrink):
        for i, size in enumerate(sizes):
            local = _random(size, dtype, g)
            state[f"{key}.piece_{i}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    dcp.save(state, checkpoint_id=path)
    torch.distributed.barrier()
    return os.path.getsize(os.path.join(path, ".metadata"))
