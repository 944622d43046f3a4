"""The ceilings every rank of a run measures at once, and the collectives they share with the loop.

One job: the aggregate write ceiling (`_ceiling_rate`), the same beside every rank's
device-to-host copy (`_ceiling_beside_d2h`) and every rank's share of device-to-host
bandwidth (`_d2h_share`), each reaching the same collectives on every rank whatever fails on
one of them; and the gathers the loop uses (`_everyone`, `_max_over_ranks`). Must not: run a
saver, or keep a copy buffer past the call that made it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import ceilings, node


def _everyone(mine, group) -> list:
    """Every rank's ``mine``, in rank order, the same list on every rank."""
    if group is None:
        return [mine]
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return gathered


def _max_over_ranks(values: dict, group) -> dict:
    if group is None:
        return values
    gathered = _everyone(values, group)
    out = {}
    for k in values:
        vals = [g[k] for g in gathered if isinstance(g.get(k), (int, float))]
        out[k] = max(vals) if vals else values[k]
    return out


def _empty_caches() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch._C._host_emptyCache()


def _copier_everywhere(state, rank, group):
    """This rank's device-to-host copier (None where it has no GPU bytes or making it failed)
    and what every rank reported (`_gathered`): collective, whatever fails on one rank."""
    copy, note = None, None
    try:
        copy = ceilings.device_to_host_copier(state.plain.values())
    except Exception as exc:
        note = f"failed on rank {rank}: {type(exc).__name__}: {exc}"[:300]
    try:
        return copy, _gathered(note, copy is not None, group)
    except BaseException:
        if copy is not None:
            copy.close()
        raise


def _d2h_share(residence, state, meta, rank, group) -> None:
    """Every rank's share of device-to-host bandwidth while all copy at once (`node.d2h_share`)
    into ``meta["d2h_shares"][residence]``, and the first residence's as ``meta["d2h_share_gbps"]``
    (by rank); None, with the reason, where no rank has GPU bytes or a copy buffer failed."""
    copy, ready = _copier_everywhere(state, rank, group)
    try:
        if ready.note or not ready.gpu:
            meta.setdefault("d2h_shares", {})[residence] = None
            meta.setdefault("ceiling_notes", {})[f"d2h_share[{residence}]"] = (
                ready.note or "not measured: no GPU bytes in this state")
        else:
            share = node.d2h_share(copy, state.device_bytes, lambda mine: _everyone(mine, group), dist.barrier)
            meta.setdefault("d2h_shares", {})[residence] = share
            if rank == 0:
                print(f"device-to-host share per rank ({residence}), all at once: "
                      f"{[None if g is None else round(g, 2) for g in share['gbps']]} GB/s", flush=True)
        meta.setdefault("d2h_share_gbps", (meta["d2h_shares"][residence] or {}).get("gbps"))
    finally:
        if copy is not None:
            copy.close()
        del copy
        _empty_caches()


def _ceiling_rate(target, state, threads, reps, source, rank, world, group) -> float:
    """Aggregate write-ceiling rate (GB/s) of every rank writing its share at once, as the saves do.
    Once per round of runs (``--ceiling-each-rep``), it shows drift of the target beside the best.
    Every repetition starts on every rank together and counts at its slowest rank; the best such
    repetition is the ceiling (each rank's own best would pair runs that did not overlap)."""
    slowest, note = None, None
    for _ in range(reps):
        dist.barrier()
        seconds = 0.0
        if note is None:
            try:
                seconds = ceilings.write_seconds(os.path.join(target, f"rank{rank}"), state.nbytes, threads, 1, source)
            except Exception as exc:  # every rank goes on through the same collectives, then all raise
                note = f"the write ceiling failed on rank {rank}: {type(exc).__name__}: {exc}"[:300]
        rep = _max_over_ranks({"s": seconds}, group)["s"]
        slowest = rep if slowest is None else min(slowest, rep)
        done = _gathered(note, True, group)
        if done.note:  # the other ranks learn at once, not after their remaining repetitions
            raise RuntimeError(done.note)
    return state.nbytes // threads * threads * world / slowest / 1e9


def _ceiling_beside_d2h(key, target, state, meta, source, rank, world, group) -> None:
    """The write ceiling with this rank's GPU bytes copied device-to-host beside it (best of 3),
    every rank at once (a rank without GPU bytes writes only); recorded under ``key``, or, where
    it cannot run, why (``ceiling_notes``). Every rank reaches the same collectives whatever
    fails on one of them; only strings outlive a failure, so the buffer is freed at once."""
    threads = meta["ceiling_threads"][target]
    copy, ready = _copier_everywhere(state, rank, group)
    try:
        if ready.note or not ready.gpu:
            meta.setdefault("ceiling_notes", {})[key] = ready.note or "not measured: no GPU bytes in this state"
            return
        # As in `_ceiling_rate`: repetitions start together (so the N copies overlap, as in a
        # save) and count at their slowest rank; the best repetition is the ceiling.
        best, note, slowest = None, None, None
        for _ in range(3):
            dist.barrier()
            run = None
            if note is None:
                try:
                    run = ceilings.write_beside_copy(os.path.join(target, f"rank{rank}"), state.nbytes, threads,
                                                     copy or (lambda: None), 1, source)
                except Exception as exc:  # a ceiling that cannot be measured must not cost the run its rows
                    note = f"failed on rank {rank}: {type(exc).__name__}: {exc}"[:300]
            rep = _max_over_ranks({"s": run.seconds if run else 0.0}, group)["s"]
            if run is not None and (slowest is None or rep < slowest):
                slowest, best = rep, run  # this rank's own run of the repetition that counts
            if _gathered(note, True, group).note:
                break  # every rank sees the same note, so every rank leaves here
        done = _gathered(note, True, group)
        if done.note:
            meta.setdefault("ceiling_notes", {})[key] = done.note
            return
        meta["ceilings"][key] = state.nbytes // threads * threads * world / slowest / 1e9
        meta.setdefault("beside_d2h", {})[key] = {"write_s": best.write_s, "copy_s": best.copy_s, "rank": rank,
                                                 "device_bytes": state.device_bytes}
    finally:
        if copy is not None:
            copy.close()
        del copy
        _empty_caches()


@dataclass(frozen=True)
class _Gathered:
    note: str | None  # the first rank's failure, if any
    gpu: bool  # some rank has GPU bytes


def _gathered(note: str | None, gpu: bool, group) -> _Gathered:
    """Every rank's failure note and GPU flag, the same answer on every rank."""
    everyone = _everyone({"note": note, "gpu": gpu}, group)
    notes = [e["note"] for e in everyone if e["note"]]
    return _Gathered(notes[0] if notes else None, any(e["gpu"] for e in everyone))
