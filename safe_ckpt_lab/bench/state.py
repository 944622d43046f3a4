"""Benchmark state: Megatron-shaped per-rank shards from presets, placed per residence mix.

Presets:
- ``anchor``: the layout of the shared peer anchors (bf16 weights in 8 layers, fp32
  optimizer buckets x 3), scaled by ``gib``.
- ``qwen3-4b-dp8``: what one of 8 data-parallel ranks of Qwen3-4B (TP=1, 8xA100-40GB)
  saves with the distributed optimizer (`dp_reshardable`): its 1/8 row share of the
  bf16 weights and its 1/8 shard of fp32 main params / exp_avg / exp_avg_sq, cut into
  40M-parameter buckets of per-parameter pieces (~7 GB). ``gib`` rescales it (with
  ``keep_shards``, the buckets shrink with it, so the 1217 shards stay: the many-shard case
  at a size a small host holds).
Residence mixes: ``gpu`` (all on the GPU), ``opt-pinned`` / ``opt-pageable`` (weights on
the GPU, optimizer state in pinned / pageable host memory); without CUDA everything is
host memory. Data is seeded random, never zeros. Must not: measure anything.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch

QWEN3_4B = dict(hidden=2560, layers=36, q_out=4096, kv_out=1024, ffn=9728, vocab=151936)
QWEN_PARAMS = (
    QWEN3_4B["layers"] * (
        (QWEN3_4B["q_out"] + 2 * QWEN3_4B["kv_out"]) * QWEN3_4B["hidden"]
        + QWEN3_4B["hidden"] * QWEN3_4B["q_out"]
        + 3 * QWEN3_4B["ffn"] * QWEN3_4B["hidden"]
    )
    + QWEN3_4B["vocab"] * QWEN3_4B["hidden"]
)


@dataclass
class BenchState:
    make_sharded: Callable[[], dict]  # a fresh sharded state dict (savers may mutate it)
    plain: dict  # fqn -> tensor, the same memory, for DCP
    nbytes: int
    device_bytes: int
    description: str


def _fill(numel: int, dtype, device, generator) -> torch.Tensor:
    t = torch.empty(numel, dtype=dtype, device=device)
    t.normal_(generator=generator)
    return t


def _weights_spec(preset: str, scale: float, dp: int) -> list[tuple[str, int]]:
    """(key, elements this rank holds) for the bf16 weights."""
    if preset == "anchor":
        per = int(scale * 8 * (1 << 30) / 8 / 2 / 8)  # 1/8 of the bytes, bf16, 8 layers
        return [(f"decoder.layers.{i}.mlp.weight", per) for i in range(8)]
    q = QWEN3_4B
    rows = {
        "embedding.word_embeddings.weight": q["vocab"] * q["hidden"],
        "decoder.layers.self_attention.linear_qkv.weight": q["layers"] * (q["q_out"] + 2 * q["kv_out"]) * q["hidden"],
        "decoder.layers.self_attention.linear_proj.weight": q["layers"] * q["hidden"] * q["q_out"],
        "decoder.layers.mlp.linear_fc1.weight": q["layers"] * 2 * q["ffn"] * q["hidden"],
        "decoder.layers.mlp.linear_fc2.weight": q["layers"] * q["ffn"] * q["hidden"],
    }
    return [(k, int(n * scale) // dp) for k, n in rows.items()]


def _bucket_pieces(preset: str, scale: float, dp: int, keep_shards: bool = False) -> list[list[int]]:
    """Per bucket, the sizes of this rank's per-parameter pieces (fp32 elements)."""
    if preset == "anchor":
        numel = int(scale * 8 * (1 << 30) * 7 / 8 / 3 / 4)  # 7/8 of the bytes, fp32, x3 tensors
        return [[numel // 4] for _ in range(4)]
    total = int(QWEN_PARAMS * scale) // dp
    bucket = max(1, int(40_000_000 * (scale if keep_shards else 1.0)) // dp)
    g = torch.Generator().manual_seed(11)
    out = []
    for start in range(0, total, bucket):
        n = min(bucket, total - start)
        cuts = sorted(set(torch.randint(1, max(2, n), (3,), generator=g).tolist()))
        edges = [0, *[c for c in cuts if 0 < c < n], n]
        out.append([b - a for a, b in zip(edges[:-1], edges[1:])])
    return out


def build(preset: str = "anchor", gib: float | None = None, residence: str = "gpu", rank: int = 0,
          world: int = 1, seed: int = 0, keep_shards: bool = False) -> BenchState:
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    cuda = torch.cuda.is_available()
    if preset not in ("anchor", "qwen3-4b-dp8"):
        raise ValueError(f"unknown preset {preset!r}")
    natural_gib = 8.0 if preset == "anchor" else (QWEN_PARAMS * (2 + 12) / 8) / (1 << 30)
    scale = (gib or natural_gib) / (8.0 if preset == "anchor" else natural_gib)
    dp = 1 if preset == "anchor" else 8
    wdev = "cuda" if cuda else "cpu"
    odev = "cuda" if cuda and residence == "gpu" else "cpu"
    g = torch.Generator(device=wdev).manual_seed(seed * 1000 + rank)
    go = torch.Generator(device=odev).manual_seed(seed * 1000 + rank + 1)
    pieces_t: list[tuple[str, torch.Tensor, int, int]] = []  # key, tensor, global_numel, offset
    for key, n in _weights_spec(preset, scale, dp):
        pieces_t.append((key, _fill(n, torch.bfloat16, wdev, g), n * world, n * rank))
    prefix = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32)"
    for b, sizes in enumerate(_bucket_pieces(preset, scale, dp, keep_shards)):
        local = sum(sizes)
        for name in ("param", "exp_avg", "exp_avg_sq"):
            key = f"{prefix}.bucket_idx_{b}.{name}"
            off = 0
            for size in sizes:
                t = _fill(size, torch.float32, odev, go)
                if residence == "opt-pinned" and cuda:
                    t = t.pin_memory()
                pieces_t.append((key, t, local * world, local * rank + off))
                off += size
    if cuda:
        torch.cuda.synchronize()
    plain = {f"{k}@{off}": t for k, t, _, off in pieces_t}
    nbytes = sum(t.numel() * t.element_size() for _, t, _, _ in pieces_t)
    device_bytes = sum(t.numel() * t.element_size() for _, t, _, _ in pieces_t if t.is_cuda)

    template = {}
    for i, (key, t, global_numel, off) in enumerate(pieces_t):
        template[f"{key}@{off}"] = ShardedTensor(key, t, t.dtype, tuple(t.shape), (global_numel,), (off,),
                                                 axis_fragmentations=None, replica_id=0)
    template["param_groups"] = ShardedObject("optimizer.param_groups", {"lr": 1e-4, "step": 4}, (world,), (rank,))
    template["iteration"] = 4

    def make_sharded() -> dict:
        return {k: copy.copy(v) if not isinstance(v, int) else v for k, v in template.items()}

    desc = (f"{preset} x{scale:.2f}: {nbytes / 1e9:.2f} GB per rank ({device_bytes / 1e9:.2f} GB on the GPU), "
            f"{len(pieces_t)} shards, residence {residence}")
    return BenchState(make_sharded, plain, nbytes, device_bytes, desc)
