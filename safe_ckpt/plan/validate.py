"""Global validation of the exchanged rank plans.

One job: given every rank's shard and object records, find everything that would make
the checkpoint wrong (disagreeing dtypes or shapes, out-of-bounds or overlapping
shards, gaps, duplicate main replicas, objects that do not tile their grid). It is a
pure function of the gathered records, so every rank reaches the same verdict without
another round of communication.

Must not: touch tensors, devices or files.
"""

from __future__ import annotations

from collections import defaultdict

from .records import Box, ObjectRef, Problem, RankPlan, ShardRef, volume

_V = "ValidationError"


def _ranks(items) -> tuple[int, ...]:
    return tuple(sorted({i.rank for i in items}))


def _group_by_value(shards: list[ShardRef], attr: str) -> str:
    groups: dict = defaultdict(set)
    for s in shards:
        groups[getattr(s, attr)].add(s.rank)
    return "; ".join(f"{value} on rank(s) {sorted(ranks)}" for value, ranks in groups.items())


def _overlap(a: Box, b: Box) -> bool:
    return all(a.offsets[i] < b.end(i) and b.offsets[i] < a.end(i) for i in range(len(a.sizes)))


def _overlapping_pairs(shards: list[ShardRef], limit: int = 5) -> list[tuple[ShardRef, ShardRef]]:
    """Pairs of non-empty boxes that overlap; sweep along axis 0 to stay near n log n."""
    live = sorted((s for s in shards if s.box.numel > 0), key=lambda s: (s.box.offsets, s.rank))
    if not live:
        return []
    if not live[0].box.sizes:
        # 0-dim tensors: every main shard covers the single element.
        return [(live[0], other) for other in live[1:limit + 1]]
    found = []
    for i, a in enumerate(live):
        for b in live[i + 1:]:
            if b.box.offsets[0] >= a.box.end(0):
                break
            if _overlap(a.box, b.box):
                found.append((a, b))
                if len(found) >= limit:
                    return found
    return found


def _describe(s: ShardRef) -> str:
    return f"rank {s.rank} offsets {s.box.offsets} sizes {s.box.sizes}"


def _validate_tensor_key(key: str, shards: list[ShardRef]) -> list[Problem]:
    problems = []
    if len({s.dtype for s in shards}) > 1:
        return [Problem(_V, key, _ranks(shards), f"ranks disagree on dtype: {_group_by_value(shards, 'dtype')}")]
    if len({s.global_shape for s in shards}) > 1:
        msg = f"ranks disagree on global shape: {_group_by_value(shards, 'global_shape')}"
        return [Problem(_V, key, _ranks(shards), msg)]
    shape = shards[0].global_shape
    shape_negative = any(d < 0 for d in shape)
    for s in shards:  # plain loops: at 8 ranks of 1217 shards this runs 10k times in every rank's plan
        out = shape_negative
        for o, n, d in zip(s.box.offsets, s.box.sizes, shape):
            if o < 0 or o + n > d:
                out = True
                break
        if out:
            msg = f"shard out of bounds of global shape {shape}: {_describe(s)}"
            problems.append(Problem(_V, key, (s.rank,), msg))
    if problems:
        return problems
    mains = [s for s in shards if s.is_main]
    if not mains:
        return [Problem(_V, key, _ranks(shards), "no rank holds a main replica (replica_id 0) of this tensor")]
    for a, b in _overlapping_pairs(mains):
        what = "two main replicas of one shard" if a.box == b.box else "main-replica shards overlap"
        problems.append(Problem(_V, key, _ranks([a, b]), f"{what}: {_describe(a)} and {_describe(b)}"))
    if problems:
        return problems
    covered = sum(s.box.numel for s in mains)
    total = volume(shape)
    if covered != total:
        msg = (
            f"main-replica shards cover {covered} of {total} elements of global shape {shape} "
            f"(a gap); shards: {', '.join(_describe(s) for s in mains[:8])}"
        )
        problems.append(Problem(_V, key, _ranks(mains), msg))
    return problems


def _validate_object_key(key: str, objects: list[ObjectRef]) -> list[Problem]:
    if len({o.global_shape for o in objects}) > 1:
        shapes = "; ".join(f"{o.global_shape} on rank {o.rank}" for o in objects[:8])
        return [Problem(_V, key, _ranks(objects), f"ranks disagree on ShardedObject global shape: {shapes}")]
    shape = objects[0].global_shape
    problems = []
    for o in objects:
        if len(o.offsets) != len(shape) or any(not 0 <= o.offsets[i] < shape[i] for i in range(len(shape))):
            problems.append(Problem(_V, key, (o.rank,), f"offset {o.offsets} outside global shape {shape}"))
    by_fqn: dict[str, list[ObjectRef]] = defaultdict(list)
    for o in objects:
        if o.is_main:
            by_fqn[o.fqn].append(o)
    for fqn, owners in by_fqn.items():
        if len(owners) > 1:
            problems.append(Problem(_V, key, _ranks(owners), f"two main replicas of ShardedObject {fqn!r}"))
    if not problems and len(by_fqn) != volume(shape):
        msg = f"main replicas hold {len(by_fqn)} of the {volume(shape)} shards of global shape {shape}"
        problems.append(Problem(_V, key, _ranks(objects), msg))
    return problems


def validate(plans: list[RankPlan]) -> list[Problem]:
    """Every problem of the exchanged plans, local ones first, in a rank-independent order."""
    problems = [p for plan in plans for p in plan.problems]
    tensors: dict[str, list[ShardRef]] = defaultdict(list)
    objects: dict[str, list[ObjectRef]] = defaultdict(list)
    for plan in plans:
        for s in plan.shards:
            tensors[s.key].append(s)
        for o in plan.objects:
            objects[o.key].append(o)
    for key in tensors.keys() & objects.keys():
        ranks = _ranks(tensors[key] + objects[key])
        problems.append(Problem(_V, key, ranks, "used both as a ShardedTensor and a ShardedObject key"))
    fqns_of_objects = {o.fqn for objs in objects.values() for o in objs}
    for fqn in fqns_of_objects & tensors.keys():
        problems.append(Problem(_V, fqn, _ranks(tensors[fqn]), "a tensor key equals a ShardedObject's stored name"))
    # A key already refused on some rank lacks that rank's shard; checking its coverage
    # would only blame the innocent ranks for the gap.
    refused = {p.key for p in problems}
    for key in sorted(tensors.keys() - refused):
        problems += _validate_tensor_key(key, tensors[key])
    for key in sorted(objects.keys() - refused):
        problems += _validate_object_key(key, objects[key])
    return problems
