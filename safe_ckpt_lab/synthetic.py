"""Seeded, Megatron-shaped sharded state for demos, tests and benchmarks.

One job: build, for any rank of a TP x DP layout, the sharded state dict a GPT model
plus a `dp_reshardable` distributed optimizer would hand to checkpointing:
TP-split bf16 weights stacked along a prepended layer axis, TP-replicated layer norms,
int64 buffers, irregular 1-D optimizer-bucket shards (fp32 param / exp_avg /
exp_avg_sq, several pieces per rank, `axis_fragmentations=None`), a
ShardedTensorFactory, ShardedObjects (TP-sharded rng state, one object per rank),
non-persistent padding flags and common state. Every global tensor is a pure
function of (key, seed), so any rank can rebuild what any other rank saved and a
load under a *different* sharding can be checked bit for bit.

Must not: be imported by the save path.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from math import gcd as _gcd

import torch


@dataclass(frozen=True)
class StateSpec:
    hidden: int = 64
    ffn: int = 256
    vocab: int = 512
    layers: int = 2
    seq: int = 32
    buckets: int = 2
    bucket_numel: int = 20_000  # unpadded elements per optimizer bucket
    pieces_per_rank: int = 3
    seed: int = 1234

    @staticmethod
    def for_bytes(target_bytes: int, seed: int = 1234) -> "StateSpec":
        """A spec whose whole (global) state is about ``target_bytes``."""
        hidden = 1024
        while True:
            spec = StateSpec(hidden=hidden, ffn=4 * hidden, vocab=8 * hidden, layers=4, seq=256,
                             buckets=2, bucket_numel=hidden * hidden, seed=seed)
            if spec.global_bytes() >= target_bytes or hidden >= 16384:
                return spec
            hidden += 256

    @staticmethod
    def for_saved_bytes(target_bytes: int, tp: int, seed: int = 1234) -> "StateSpec":
        """A spec whose tensors, as a TP=``tp`` save writes them, hold ``target_bytes`` to
        within a few KiB: the weights take about half, the optimizer buckets (sized to the
        element) the rest."""
        step = 64 * tp // _gcd(64, tp)  # every TP-split axis (h, 3h, 4h, 8h) divides by tp
        hidden = step
        while 2 * _weight_bytes(hidden + step) <= target_bytes:
            hidden += step
        spec = StateSpec(hidden=hidden, ffn=4 * hidden, vocab=8 * hidden, layers=4, seq=256, buckets=2,
                         bucket_numel=1, seed=seed)
        per_element = 3 * 4 * spec.buckets * tp  # param, exp_avg, exp_avg_sq in fp32, per TP rank
        rest = target_bytes - spec.saved_bytes(tp) + per_element
        return dataclasses.replace(spec, bucket_numel=max(spec.pieces_per_rank + 1, rest // per_element))

    def saved_bytes(self, tp: int) -> int:
        """The tensor bytes a TP=``tp`` save writes (each TP rank has its own optimizer buckets)."""
        return self.global_bytes() + 3 * 4 * self.buckets * self.bucket_numel * (tp - 1)

    def weight_shapes(self) -> dict[str, tuple[tuple[int, ...], int | None]]:
        """Global shape of every weight and the axis split across TP (None: replicated)."""
        h, f, v, L = self.hidden, self.ffn, self.vocab, self.layers
        return {
            "embedding.word_embeddings.weight": ((v, h), 0),
            "decoder.layers.self_attention.linear_qkv.weight": ((L, 3 * h, h), 1),
            "decoder.layers.self_attention.linear_proj.weight": ((L, h, h), 2),
            "decoder.layers.mlp.linear_fc2.weight": ((L, h, f), 2),
            "decoder.layers.input_layernorm.weight": ((L, h), None),
            "decoder.final_layernorm.weight": ((h,), None),
            "output_layer.weight": ((v, h), 0),
        }

    def global_bytes(self) -> int:
        weights = sum(_numel(s) for s, _ in self.weight_shapes().values()) * 2
        fc1 = self.layers * 2 * self.ffn * self.hidden * 2
        optim = 3 * 4 * self.buckets * self.bucket_numel
        return weights + fc1 + optim + self.seq * 8


def _weight_bytes(hidden: int) -> int:
    """Bytes of the bf16 weights of a `for_saved_bytes` spec (layers=4, ffn=4h, vocab=8h)."""
    spec = StateSpec(hidden=hidden, ffn=4 * hidden, vocab=8 * hidden, layers=4, buckets=2, bucket_numel=0)
    return spec.global_bytes() - spec.seq * 8


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _generator(key: str, seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))


def global_tensor(key: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The reference content of a global tensor: seeded random, never zeros."""
    g = _generator(key, seed)
    if dtype == torch.int64:
        return torch.randint(-(2**62), 2**62, shape, generator=g, dtype=torch.int64)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def _optim_keys(spec: StateSpec, tp_rank: int) -> list[str]:
    keys = []
    for b in range(spec.buckets):
        prefix = f"optimizer.distributed.dp_group_idx_{tp_rank}.gbuf_idx_0.dtype_(torch.bfloat16, torch.bfloat16)"
        for name in ("param", "exp_avg", "exp_avg_sq"):
            keys.append(f"{prefix}.bucket_idx_{b}.{name}")
    return keys


def reference_tensors(spec: StateSpec, tp: int) -> dict[str, torch.Tensor]:
    """Every global tensor a TP=tp save holds, by key."""
    out = {}
    for key, (shape, _) in spec.weight_shapes().items():
        out[key] = global_tensor(key, shape, torch.bfloat16, spec.seed)
    for half in ("gate", "up"):
        key = f"decoder.layers.mlp.linear_fc1.weight.{half}"
        out[key] = global_tensor(key, (spec.layers, spec.ffn, spec.hidden), torch.bfloat16, spec.seed)
    out["embedding.position_ids"] = global_tensor("embedding.position_ids", (spec.seq,), torch.int64, spec.seed)
    for tp_rank in range(tp):
        for key in _optim_keys(spec, tp_rank):
            out[key] = global_tensor(key, (spec.bucket_numel,), torch.float32, spec.seed)
    return out


def _split_points(n: int, parts: int, salt: str, seed: int) -> list[int]:
    """Sorted cut points splitting [0, n) into ``parts`` non-empty irregular pieces."""
    if parts <= 1 or n <= parts:
        return [0, n]
    g = _generator(salt, seed)
    cuts = sorted(set(torch.randperm(n - 1, generator=g)[: parts - 1].add(1).tolist()))
    return [0, *cuts, n]


def dp_ranges(numel: int, dp: int) -> list[range]:
    """Each DP rank's contiguous range of a bucket (equal local size, last one truncated)."""
    local = -(-numel // dp)
    return [range(min(r * local, numel), min((r + 1) * local, numel)) for r in range(dp)]


def build_state(rank: int, world_size: int, *, tp: int, spec: StateSpec, layout: str = "save",
                device: str | torch.device = "cpu", optimizer_device: str | torch.device | None = None,
                pin_optimizer: bool = False, empty: bool = False, references: dict | None = None,
                saved_tp: int | None = None) -> dict:
    """The sharded state dict of ``rank``.

    layout "save" splits TP weights along their model-parallel axis and optimizer
    buckets into ``pieces_per_rank`` irregular pieces; layout "alt" (for loading) splits
    weights along another axis and the buckets at different points. ``empty`` gives
    uninitialised tensors to load into. ``references`` (from `reference_tensors`) avoids
    regenerating global tensors. ``saved_tp`` (loading) leaves out what a checkpoint saved
    at that TP size cannot provide, as Megatron does: optimizer buckets of TP ranks it did
    not have, and the TP-sharded rng state when TP changed.
    """
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject, ShardedObject, ShardedTensor, ShardedTensorFactory,
    )

    if world_size % tp:
        raise ValueError(f"tp={tp} does not divide world_size={world_size}")
    dp = world_size // tp
    tp_rank, dp_rank = rank % tp, rank // tp
    ref = references if references is not None else reference_tensors(spec, tp)
    optimizer_device = device if optimizer_device is None else optimizer_device

    def materialize(block: torch.Tensor, dev, pin=False) -> torch.Tensor:
        t = torch.empty_like(block) if empty else block.clone()
        t = t.to(dev)
        return t.pin_memory() if pin and t.device.type == "cpu" else t

    state: dict = {"model": {}, "optimizer": {"distributed": {}}}
    for key, (shape, axis) in spec.weight_shapes().items():
        full = ref[key]
        prepend = 1 if key.startswith("decoder.layers.") else 0
        split_axis = axis
        if layout == "alt" and axis is not None:
            split_axis = 1 + prepend if axis == prepend else prepend  # the other non-layer axis
            if shape[split_axis] % tp:
                split_axis = axis
        entries = []
        for layer in range(shape[0] if prepend else 1):
            block = full[layer] if prepend else full
            if split_axis is None:
                local, offsets, replica = block, (), (0, tp_rank, dp_rank)
            else:
                local_axis = split_axis - prepend
                size = block.shape[local_axis] // tp
                local = block.narrow(local_axis, tp_rank * size, size)
                offsets = ((split_axis, tp_rank, tp),)
                replica = (0, 0, dp_rank)
            prepend_offsets = ((0, layer, shape[0]),) if prepend else ()
            entries.append(ShardedTensor.from_rank_offsets(
                key, materialize(local, device), *prepend_offsets, *offsets,
                replica_id=replica, prepend_axis_num=prepend,
            ))
        state["model"][key] = entries if prepend else entries[0]

    state["model"]["decoder.layers.mlp.linear_fc1.weight"] = _fc1_factory(
        ref, spec, tp_rank, tp, dp_rank, materialize, device, ShardedTensor, ShardedTensorFactory
    )
    pos = "embedding.position_ids"
    state["model"][pos] = ShardedTensor.from_rank_offsets(
        pos, materialize(ref[pos], device), replica_id=(0, tp_rank, dp_rank)
    )

    salt = "alt" if layout == "alt" else "save"
    for key in _optim_keys(spec, tp_rank) if saved_tp is None or tp_rank < saved_tp else []:
        rng = dp_ranges(spec.bucket_numel, dp)[dp_rank]
        cuts = _split_points(len(rng), spec.pieces_per_rank + (1 if layout == "alt" else 0), f"{key}/{salt}/{dp_rank}",
                             spec.seed)
        pieces = []
        for a, b in zip(cuts[:-1], cuts[1:]):
            start = rng.start + a
            data = materialize(ref[key][start:rng.start + b], optimizer_device, pin_optimizer)
            pieces.append({
                "tensor": ShardedTensor(key, data, data.dtype, tuple(data.shape), (spec.bucket_numel,), (start,),
                                        axis_fragmentations=None, replica_id=(0, 0, 0)),
                "padding": LocalNonpersistentObject(False),
            })
        state["optimizer"]["distributed"][key] = pieces

    if saved_tp is None or saved_tp == tp:
        state["rng_state"] = ShardedObject(
            "rng_state", {"seed": spec.seed, "tp_rank": tp_rank}, (1, tp), (0, tp_rank), replica_id=dp_rank
        )
    state["rank_info"] = ShardedObject(
        "rank_info", {"rank": rank, "note": f"rank {rank} of {world_size}"}, (world_size,), (rank,)
    )
    state["iteration"] = 42
    state["checkpoint_version"] = 3.0
    state["args"] = {"tp": tp, "dp": dp, "hidden": spec.hidden, "seed": spec.seed}
    return state


def _fc1_factory(ref, spec, tp_rank, tp, dp_rank, materialize, device, ShardedTensor, ShardedTensorFactory):
    """A fused [gate; up] fc1 weight stored as two keys, the way Megatron's GLU factory does."""
    key = "decoder.layers.mlp.linear_fc1.weight"
    size = spec.ffn // tp
    fused = torch.cat(
        [ref[f"{key}.{half}"].narrow(1, tp_rank * size, size) for half in ("gate", "up")], dim=1
    )
    fused = materialize(fused, device)

    def build(k, t, replica_id, flattened_range):
        gate, up = torch.chunk(t, 2, dim=1)
        return {
            half: ShardedTensor.from_rank_offsets(f"{k}.{half}", part, (1, tp_rank, tp), replica_id=replica_id)
            for half, part in (("gate", gate), ("up", up))
        }

    def merge(sub):
        return torch.cat([sub["gate"], sub["up"]], dim=1)

    return ShardedTensorFactory(key, fused, build, merge, replica_id=(0, 0, dp_rank))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads and signed zeros included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a = a.detach().cpu().contiguous().reshape(-1)
    b = b.detach().cpu().contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
