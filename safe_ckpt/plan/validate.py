"""Global validation of the exchanged rank plans.

One job: given every rank's shard and object records, find everything that would make
the checkpoint wrong (disagreeing dtypes or shapes, out-of-bounds or overlapping
shards, gaps, duplicate main replicas, objects that do not tile their grid). It is a
pure function of the gathered records, so every rank reaches the same verdict without
another round of communication (only the wording of a refusal takes one: `agreement`).

Must not: touch tensors, devices or files.
"""

from __future__ import annotations

from collections import defaultdict

from ..errors import ValidationError
from .records import Box, ObjectRef, Problem, RankPlan, ShardRef, volume

_V = ValidationError


def _ranks(items) -> tuple[int, ...]:
    return tuple(sorted({i.rank for i in items}))


def _rank_list(ranks) -> str:
    """'rank 3', 'ranks 0, 2' or 'ranks 0-7': runs of consecutive ranks shortened."""
    ranks = sorted(set(ranks))
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _places(items, limit: int = 4) -> str:
    """Where in the callers' dicts some records sit: "state['a'] on ranks 0-3, state['b'] on rank 1"."""
    by_path: dict[str, set[int]] = defaultdict(set)
    for i in items:
        by_path[i.path].add(i.rank)
    shown = [f"{path} on {_rank_list(ranks)}" for path, ranks in sorted(by_path.items())[:limit]]
    more = f" and {len(by_path) - limit} more places" if len(by_path) > limit else ""
    return ", ".join(shown) + more


def _paths(items, limit: int = 4) -> str:
    paths = sorted({i.path for i in items})
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return ", ".join(paths[:limit]) + more


def _disagreement(key: str, shards: list[ShardRef], attr: str, what: str) -> Problem:
    groups: dict = defaultdict(list)
    for s in shards:
        groups[getattr(s, attr)].append(s)
    ranks = _ranks(shards)
    if len(ranks) == 1:  # one rank contradicts itself: name its places, not "ranks disagree"
        where = "; ".join(f"{value} at {_paths(group)}" for value, group in groups.items())
        msg = f"rank {ranks[0]} gives key {key!r} with {len(groups)} different {what}s: {where}"
    else:
        where = "; ".join(f"{value} at {_places(group)}" for value, group in groups.items())
        msg = f"ranks disagree on {what}: {where}"
    return Problem(_V, key, ranks, msg)


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
    return f"rank {s.rank} offsets {s.box.offsets} sizes {s.box.sizes} at {s.path}"


def _clash(key: str, a: ShardRef, b: ShardRef) -> str:
    box = f"offsets {a.box.offsets} sizes {a.box.sizes}"
    if a.rank == b.rank:  # one rank passed the key twice: the places in its dict are the news
        if a.box == b.box:
            return f"rank {a.rank} gives key {key!r} twice: at {a.path} and {b.path} (both {box})"
        return (f"rank {a.rank} gives overlapping shards of key {key!r}: {box} at {a.path} and "
                f"offsets {b.box.offsets} sizes {b.box.sizes} at {b.path}")
    if a.box == b.box:
        return (f"two main replicas of one shard ({box}): rank {a.rank} at {a.path} and rank {b.rank} at {b.path}; "
                "a shard held by several ranks needs a replica_id that is 0 (the main replica) on one of them only")
    return f"main-replica shards overlap: {_describe(a)} and {_describe(b)}"


def _validate_tensor_key(key: str, shards: list[ShardRef]) -> list[Problem]:
    problems = []
    if len({s.dtype for s in shards}) > 1:
        return [_disagreement(key, shards, "dtype", "dtype")]
    if len({s.global_shape for s in shards}) > 1:
        return [_disagreement(key, shards, "global_shape", "global shape")]
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
        msg = f"no rank holds a main replica (replica_id 0) of this tensor; it is at {_places(shards)}"
        return [Problem(_V, key, _ranks(shards), msg)]
    for a, b in _overlapping_pairs(mains):
        problems.append(Problem(_V, key, _ranks([a, b]), _clash(key, a, b)))
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
        return [_disagreement(key, objects, "global_shape", "ShardedObject global shape")]
    shape = objects[0].global_shape
    problems = []
    for o in objects:
        if len(o.offsets) != len(shape) or any(not 0 <= o.offsets[i] < shape[i] for i in range(len(shape))):
            msg = f"offset {o.offsets} outside global shape {shape} (at {o.path})"
            problems.append(Problem(_V, key, (o.rank,), msg))
    by_fqn: dict[str, list[ObjectRef]] = defaultdict(list)
    for o in objects:
        if o.is_main:
            by_fqn[o.fqn].append(o)
    for fqn, owners in by_fqn.items():
        if len(owners) > 1:
            msg = f"two main replicas of ShardedObject {fqn!r}: at {_places(owners)}"
            problems.append(Problem(_V, key, _ranks(owners), msg))
    if not problems and len(by_fqn) != volume(shape):
        msg = f"main replicas hold {len(by_fqn)} of the {volume(shape)} shards of global shape {shape}"
        problems.append(Problem(_V, key, _ranks(objects), msg))
    return problems


def validate(plans: list[RankPlan], tensor_keys_checked: bool = False) -> list[Problem]:
    """Every problem of the exchanged plans, local ones first, in a rank-independent order.
    ``tensor_keys_checked``: these shards passed the per-key checks before (`memo`)."""
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
        msg = (f"used both as a ShardedTensor key (at {_places(tensors[key])}) and a ShardedObject key "
               f"(at {_places(objects[key])})")
        problems.append(Problem(_V, key, ranks, msg))
    fqns_of_objects = {o.fqn for objs in objects.values() for o in objs}
    for fqn in fqns_of_objects & tensors.keys():
        msg = f"a tensor key (at {_places(tensors[fqn])}) equals a ShardedObject's stored name"
        problems.append(Problem(_V, fqn, _ranks(tensors[fqn]), msg))
    # A key already refused on some rank lacks that rank's shard; checking its coverage
    # would only blame the innocent ranks for the gap.
    refused = {p.key for p in problems}
    for key in [] if tensor_keys_checked else sorted(tensors.keys() - refused):
        problems += _validate_tensor_key(key, tensors[key])
    for key in sorted(objects.keys() - refused):
        problems += _validate_object_key(key, objects[key])
    return problems
