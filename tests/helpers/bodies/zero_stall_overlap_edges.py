"""Rank bodies for the edges of `return_after="planned"` (spawned ranks, see mp.py): a window left
for its trigger, an interrupt at the opening, a pool too small for the integrity manifest's order,
what a kept handle holds. On a CPU-only torch every source is host memory, copied by the window's
simulated copy stream into the pool and content-checked."""

from __future__ import annotations

import os

import torch

N = 1 << 19  # 2 MiB per fp32 tensor: above the window's small-source size
BOUND_S = 10.0  # on the old code these waits ran out; with the fix they return at once


def _sharded(tensors: dict) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}


def _load(path: str, keys) -> dict:
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(_sharded({k: torch.empty(N) for k in keys}), path)


def _deferred(tensors: dict, path: str, opts):
    from safe_ckpt.saving import start

    return start(_sharded(tensors), path, options=opts, asynchronous=True, copy_start="deferred").in_background()


def deferred_window_opened_by_whoever_waits(rank, world, root) -> dict:
    """A save whose copies wait for the next step's trigger, and no step comes: waiting on its handle
    (or polling it) opens the window, and so does the next save's start."""
    import safe_ckpt

    w = torch.randn(N, generator=torch.Generator().manual_seed(70 + rank))
    opts = safe_ckpt.SaveOptions(return_after="planned", collective_timeout_s=BOUND_S, progress_interval_s=0)
    out = {}
    for how in ("wait", "exception", "done", "wait_window_closed"):
        handle = _deferred({"w": w}, os.path.join(root, how), opts)
        if how == "wait":
            out[how] = handle.wait(BOUND_S) is not None
        elif how == "exception":
            out[how] = handle.exception(BOUND_S) is None and handle.done()
        elif how == "done":
            handle.done()
            out[how] = handle._window.is_open or handle._window.is_settled
        else:
            out[how] = handle.wait_window_closed(BOUND_S)
        handle.wait(BOUND_S)
        out[how] = out[how] and torch.equal(_load(os.path.join(root, how), ["w"])["w"], w)
    first = _deferred({"w": w}, os.path.join(root, "first"), opts)
    try:  # the next save's start opens the earlier window instead of waiting for its slot
        safe_ckpt.save(_sharded({"w": w}), os.path.join(root, "second"),
                       options=safe_ckpt.SaveOptions(collective_timeout_s=BOUND_S, progress_interval_s=0))
        out["second"] = None
    except safe_ckpt.CheckpointError as exc:
        out["second"] = f"{type(exc).__name__}: {exc}"
    first.wait(BOUND_S)
    out["both_saved"] = all(torch.equal(_load(os.path.join(root, d), ["w"])["w"], w) for d in ("first", "second"))
    return out


def interrupt_at_the_opening(rank, world, root, copy_start: str) -> dict:
    """A KeyboardInterrupt (a Ctrl-C) in the thread that opens the copy window, injected where the
    opening orders the caller's streams: the call that opened it raises it as itself, the save
    publishes nothing, no gate is left waiting, and the next save goes through."""
    import safe_ckpt
    from safe_ckpt.staging import gates
    from safe_ckpt.staging.window import CopyWindow

    w = torch.randn(N, generator=torch.Generator().manual_seed(80 + rank))
    inner = CopyWindow.order_opening

    def interrupted(self):
        CopyWindow.order_opening = inner
        raise KeyboardInterrupt

    CopyWindow.order_opening = interrupted
    opts = safe_ckpt.SaveOptions(return_after="planned", collective_timeout_s=BOUND_S, progress_interval_s=0)
    out = {"raised_by": None, "handle_error": None}
    path = os.path.join(root, "ck")
    handle = None
    try:
        if copy_start == "now":
            safe_ckpt.async_save(_sharded({"w": w}), path, options=opts)
        else:
            handle = _deferred({"w": w}, path, opts)
            safe_ckpt.before_update()  # the trigger opens it in this thread
    except KeyboardInterrupt:
        out["raised_by"] = "the opening call"
    if handle is not None:
        try:
            handle.wait(BOUND_S)
        except BaseException as exc:
            out["handle_error"] = type(exc).__name__
    out["published"] = os.path.exists(path)
    out["open_windows"] = len(gates.open_windows())
    safe_ckpt.async_save(_sharded({"w": w}), os.path.join(root, "next"), options=opts).wait(BOUND_S)
    out["next_saved"] = torch.equal(_load(os.path.join(root, "next"), ["w"])["w"], w)
    return out


def integrity_manifest_with_a_small_pool(rank, world, root) -> dict:
    """The integrity manifest (items handed on in file order) and a pool of one chunk, smaller than
    the rank's saved bytes: the save returns once staged instead (one INFO line says why), so no
    small source copied first can hold the lease an earlier item of its file needs."""
    import hashlib
    import json
    import logging

    import safe_ckpt

    g = torch.Generator().manual_seed(90 + rank)
    tensors = {}
    for i in range(2):
        tensors[f"big{i}"] = torch.randn(N, generator=g)
    for i in range(6):
        tensors[f"small{i}"] = torch.randn(1 << 16, generator=g)  # 256 KiB: copied at the opening
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logging.getLogger("safe_ckpt").addHandler(handler)
    logging.getLogger("safe_ckpt").setLevel(logging.INFO)
    path = os.path.join(root, "ck")
    opts = safe_ckpt.SaveOptions(return_after="planned", integrity_manifest=True, chunk_bytes=N, io_threads=1,
                                 staging_budget_bytes=N, collective_timeout_s=BOUND_S, progress_interval_s=0)
    handle = safe_ckpt.async_save(_sharded(tensors), path, options=opts)
    out = {"error": None}
    try:
        handle.wait(BOUND_S)
    except TimeoutError as exc:
        out["error"] = repr(exc)
        safe_ckpt.before_update()  # abandons the stuck save, so the process can end
        handle.exception(BOUND_S)
        return out
    except safe_ckpt.CheckpointError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    out["why"] = [r.getMessage() for r in records if "integrity_manifest" in r.getMessage()]
    manifest = json.load(open(os.path.join(path, "integrity.json")))["files"]
    out["digests_match"] = all(hashlib.sha256(open(os.path.join(path, name), "rb").read()).hexdigest() == digest
                               for name, digest in manifest.items())
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_sharded({k: torch.empty_like(t) for k, t in tensors.items()}), path)
    out["content_equal"] = all(torch.equal(loaded[k], t) for k, t in tensors.items())
    return out


def kept_handle_holds_no_source(rank, world, root) -> dict:
    """A handle kept after its save (a training loop keeps the last one) must not keep the saved
    tensors alive, nor the window's sums; its window's stats stay readable."""
    import gc
    import weakref

    import safe_ckpt

    out = {}
    for mode in ("planned", "staged"):
        w = torch.randn(N, generator=torch.Generator().manual_seed(95 + rank))
        handle = safe_ckpt.async_save(_sharded({"w": w}), os.path.join(root, mode),
                                      options=safe_ckpt.SaveOptions(return_after=mode, progress_interval_s=0))
        held = weakref.ref(w)  # the window may already have settled here: watch the caller's tensor
        handle.wait(BOUND_S)
        del w
        gc.collect()
        stats = handle.window_stats()
        out[mode] = {"source_alive": held() is not None, "sources_left": len(handle._window.sources),
                     "sums": handle._window.sums is not None,
                     "stats_bytes": stats.copied_bytes + stats.captured_bytes}
    return out


def sync_save_asked_to_return_after_planning(rank, world, root) -> dict:
    """`return_after="planned"` given to a synchronous save: one INFO line says it applies to
    asynchronous saves only; the save is made as usual."""
    import logging

    import safe_ckpt

    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logging.getLogger("safe_ckpt").addHandler(handler)
    logging.getLogger("safe_ckpt").setLevel(logging.INFO)
    w = torch.randn(N, generator=torch.Generator().manual_seed(97 + rank))
    path = os.path.join(root, "ck")
    safe_ckpt.save(_sharded({"w": w}), path,
                   options=safe_ckpt.SaveOptions(return_after="planned", progress_interval_s=0))
    return {"lines": [r.getMessage() for r in records if "return_after" in r.getMessage()],
            "saved": torch.equal(_load(path, ["w"])["w"], w)}
