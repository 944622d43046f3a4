"""Loading the sharded part of a state dict: what a megatron-core load strategy's `load` does.

One job: given a tree whose leaves are ShardedTensors and ShardedObjects, fill every
ShardedTensor's tensor from the checkpoint (resharding as needed) and decode every
ShardedObject, and return the same tree with each leaf replaced by its value, as stock
`TorchDistLoadShardedStrategy.load` returns it. Every rank plans, then all vote; every rank
reads, then all vote: a problem on any rank (a missing key, a truncated file, a checksum
mismatch) raises the same `CheckpointError` on every rank, naming the rank, key and file.
Must not: read the common state, apply factories, or talk to other ranks except through
the coordinator's votes.
"""

from __future__ import annotations

import threading

from ..host import cpu
from ..errors import CheckpointError, RankFailure, combine, failure_from_exception
from ..options import SaveOptions
from ..staging.pool import shared_pool
from . import objects, plan
from .execute import Reader
from .report import ReadReport, log_read
from .options import LoadOptions



def vote(coord, stage: str, where: str, failure: RankFailure | None) -> None:
    """Every rank raises the same error if any rank failed ``stage``."""
    ballots = coord.exchange(f"load: {stage}", failure)
    failures = [f for f in ballots if f is not None]
    if failures:
        error = combine(stage, failures)
        message = str(error).replace("safe_ckpt: save failed during", f"safe_ckpt: load of {where} failed during", 1)
        raise type(error)(message, error.failures)


def settle(options: LoadOptions, coord) -> tuple[int, int]:
    """(reader threads, pinned pool budget): the save's defaults for this rank's share of its host,
    so that a load and a save share one pool."""
    budget = options.staging_budget_bytes
    chunk = SaveOptions.chunk_bytes if budget is None else max(4096, min(budget, SaveOptions.chunk_bytes))
    resolved = cpu.settle(SaveOptions(io_threads=options.io_threads, staging_budget_bytes=budget, chunk_bytes=chunk),
                          coord)
    return resolved.io_threads, resolved.staging_budget_bytes


def _piece_bytes(options: LoadOptions, threads: int, budget: int) -> tuple[int, int]:
    """(piece size, threads) such that every thread's two pieces fit the pool at once."""
    piece = min(options.piece_bytes, budget // (2 * threads)) // 4096 * 4096
    if piece < 64 << 10:
        threads = max(1, budget // (2 * (64 << 10)))
        piece = min(options.piece_bytes, budget // (2 * threads)) // 4096 * 4096
    return max(piece, 4096), threads


def _leaves(tree, out: list) -> list:
    if isinstance(tree, dict):
        for v in tree.values():
            _leaves(v, out)
    elif isinstance(tree, list):
        for v in tree:
            _leaves(v, out)
    else:
        out.append(tree)
    return out


def _rebuild(tree, values: dict):
    if isinstance(tree, dict):
        return {k: _rebuild(v, values) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_rebuild(v, values) for v in tree]
    return values[id(tree)]


def _objects(requested: list, source, index, safe_globals, rank: int, values: dict) -> None:
    """Decode each requested ShardedObject (its stored list holds one value per occurrence)."""
    by_key: dict = {}
    for sh_obj in requested:
        by_key.setdefault(sh_obj.unique_key, []).append(sh_obj)
    for unique_key, occurrences in by_key.items():
        item = index.objects.get(unique_key)
        if item is None:
            raise CheckpointError(f"ShardedObject {unique_key!r} is not in the checkpoint {index.where}")
        where = objects.item_where(source, item, unique_key)
        stored = objects.decode(objects.read_item(source, item), where, safe_globals)
        if not isinstance(stored, list) or len(stored) != len(occurrences):
            raise CheckpointError(f"{where}: holds {type(stored).__name__} of {len(stored) if isinstance(stored, list) else 1} "
                                  f"value(s); the state dict asks for {len(occurrences)}")
        for sh_obj, value in zip(occurrences, stored):
            values[id(sh_obj)] = value


def read_sharded(tree, source, index, options: LoadOptions, coord, where: str):
    """``tree`` with each ShardedTensor replaced by its filled tensor and each ShardedObject by its value."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    leaves = _leaves(tree, [])
    tensors = [leaf for leaf in leaves if isinstance(leaf, ShardedTensor)]
    requested_objects = [leaf for leaf in leaves if isinstance(leaf, ShardedObject)]
    threads, budget = settle(options, coord)
    piece, threads = _piece_bytes(options, threads, budget)
    failure, read_plan = None, None
    try:
        others = [leaf for leaf in leaves if not isinstance(leaf, (ShardedTensor, ShardedObject))]
        if others:
            raise CheckpointError(f"the sharded part holds a {type(others[0]).__name__}; only ShardedTensor and "
                                  f"ShardedObject leaves can be loaded")
        read_plan, problems = plan.build(tensors, index, source, rank=coord.rank, batch_bytes=options.batch_bytes,
                                         piece_bytes=piece, checksums=options.verify_checksums)
        if problems:
            failure = _first(problems)
    except Exception as exc:
        failure = failure_from_exception(coord.rank, "plan", exc)
    vote(coord, "planning", where, failure)

    values: dict = {}
    report, failure = ReadReport(0, 0, 0, 0, 0, 0, 0.0), None
    try:
        if read_plan.batches:
            pool_lock = threading.Lock()
            pools: list = []

            def pool():
                with pool_lock:
                    if not pools:
                        pools.append(shared_pool(budget))
                    return pools[0]

            reader = Reader(source, read_plan, rank=coord.rank, threads=threads, piece_bytes=piece, pool=pool,
                            algorithm=index.checksum_algorithm, timeout_s=options.collective_timeout_s,
                            progress_interval_s=options.progress_interval_s)
            report, failure = reader.run()
        if failure is None:
            _objects(requested_objects, source, index, options.safe_globals, coord.rank, values)
    except Exception as exc:
        failure = failure_from_exception(coord.rank, "read", exc)
    vote(coord, "reading", where, failure)

    for sh_ten, dest in zip(tensors, read_plan.destinations):  # one each: any problem stopped the load above
        values[id(sh_ten)] = dest.tensor
    log_read(report, where, coord.rank)
    if options.on_read is not None:
        options.on_read(report)
    return _rebuild(tree, values)


def _first(problems: list) -> RankFailure:
    """One failure per rank carries the first problems (the vote shows each rank's)."""
    head = problems[0]
    if len(problems) == 1:
        return head
    more = f" (and {len(problems) - 1} more problem(s) on this rank, e.g. " + \
        "; ".join(f"key {p.key!r}: {p.message}" for p in problems[1:4]) + ")"
    return RankFailure(head.rank, head.stage, head.kind, head.message + more, key=head.key, lineage=head.lineage)
