"""One runner per saver. Each returns ``{"stall_s": ..., "total_s": ...}`` where stall is
how long training would be blocked and total is time until the checkpoint is durable
(the call, plus finalisation for asynchronous savers).

Peers: ``safe_sync``, ``safe_async``, ``safe_sync_tensorstore`` (this library; the last
through the TensorStore kvstore `file` driver), ``safe_sync_nosum`` (checksums off: what the
integrity manifest costs), ``safe_sync_hostsum`` (device checksums off: every byte hashed on
the host), ``safe_sync_integrity`` (Megatron's `integrity.json` too: what `--verify-integrity`
costs); ``megatron_sync``,
``megatron_async`` (stock megatron-core torch_dist, mcore async strategy; need CUDA);
``dcp_sync`` (FileSystemWriter, same thread count); ``dcp_async_pinned``
(`dcp.async_save` with a pinned `DefaultStager`, where the installed torch has it).
Any of them but Megatron's as ``NAME@T`` is that saver with T writer threads whatever ``--threads`` says
(`resolve`), so one run can set, say, DCP at 8 threads beside DCP
at the thread count every other saver gets.
A safe_ckpt runner given ``threads`` / ``budget_bytes`` None leaves them to the library's
per-host defaults and returns what it resolved (`RESOLVED`).
Must not: time anything outside the saver's own calls.
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import time

import torch

PEERS = ("safe_sync", "safe_async", "safe_sync_tensorstore", "megatron_sync", "megatron_async", "dcp_sync",
         "dcp_async_pinned")
EXTRA_PEERS = ("safe_sync_nosum", "safe_sync_hostsum", "safe_sync_integrity")  # run only when named


# The options a safe_ckpt save resolves from its rank's share of the host where they are left
# None (``threads`` / ``budget_bytes`` None: the library's defaults), reported per save.
RESOLVED = ("io_threads", "staging_budget_bytes", "checksum_threads")


class Unavailable(Exception):
    """The peer cannot run in this environment (reason in the message)."""


def _fresh(path: str, make: bool = False) -> str:
    """``path`` emptied for a save, the same on every rank of a run; with ``make``, also
    created (stock Megatron wants the directory to exist). Ranks of one host share the
    filesystem, so only the host's first rank (``LOCAL_RANK`` 0) removes, and every rank waits
    for it before going on: where each rank removed and created for itself, one rank could take
    away the directory another had just made, or fail to create it because another had, and
    then stop short of a collective the others were already waiting in, for ever. (Ray actors
    all have ``LOCAL_RANK`` 0: they all remove, still before the barrier, which is harmless.)"""
    ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if ranks == 1 or int(os.environ.get("LOCAL_RANK", torch.distributed.get_rank())) == 0:
        shutil.rmtree(path, ignore_errors=True)
    if ranks > 1:
        torch.distributed.barrier()
    os.makedirs(path if make else os.path.dirname(path), exist_ok=True)  # nothing is removed past the barrier
    return path


def _safe(state, target, threads, budget_bytes, use_async: bool, kvstore: bool = False, checksums: bool = True,
          device_checksums: bool = True, integrity_manifest: bool = False):
    import safe_ckpt

    opts = safe_ckpt.SaveOptions(io_threads=threads, staging_budget_bytes=budget_bytes, checksums=checksums,
                                 device_checksums=device_checksums, integrity_manifest=integrity_manifest)
    d = _fresh(target)
    if kvstore:
        d = "file://" + d  # the same target through TensorStore's kvstore `file` driver
    t0 = time.perf_counter()
    if use_async:
        handle = safe_ckpt.async_save(state.make_sharded(), d, options=opts)
        t1 = time.perf_counter()
        result = handle.wait()
    else:
        result = safe_ckpt.save(state.make_sharded(), d, options=opts)
        t1 = time.perf_counter()
    t2 = time.perf_counter()
    t = result.timings  # where the time went, for the report's breakdown of safe_ckpt rows
    return {"stall_s": t1 - t0, "total_s": t2 - t0, "pool_allocations": result.staging_pool_allocations,
            "plan_s": t.plan_s, "write_s": t.write_s, "commit_s": t.commit_s,
            **{k: result.extra.get(k) for k in RESOLVED}}  # what this rank used, defaults resolved


def safe_sync(state, target, threads, budget_bytes):
    return _safe(state, target, threads, budget_bytes, use_async=False)


def safe_async(state, target, threads, budget_bytes):
    return _safe(state, target, threads, budget_bytes, use_async=True)


def safe_sync_nosum(state, target, threads, budget_bytes):
    return _safe(state, target, threads, budget_bytes, use_async=False, checksums=False)


def safe_sync_hostsum(state, target, threads, budget_bytes):
    return _safe(state, target, threads, budget_bytes, use_async=False, device_checksums=False)


def safe_sync_integrity(state, target, threads, budget_bytes):
    return _safe(state, target, threads, budget_bytes, use_async=False, integrity_manifest=True)


def safe_sync_tensorstore(state, target, threads, budget_bytes):
    import importlib.util

    if importlib.util.find_spec("tensorstore") is None:
        raise Unavailable("safe_sync_tensorstore: tensorstore is not installed")
    return _safe(state, target, threads, budget_bytes, use_async=False, kvstore=True)


def _need_cuda(name):
    if not torch.cuda.is_available():
        raise Unavailable(f"{name}: stock Megatron saving needs CUDA (it fails in torch.cuda.synchronize())")


def megatron_sync(state, target, threads, budget_bytes):
    _need_cuda("megatron_sync")
    from megatron.core import dist_checkpointing

    d = _fresh(target, make=True)
    sd = state.make_sharded()
    t0 = time.perf_counter()
    dist_checkpointing.save(sd, d, async_sharded_save=False)
    t1 = time.perf_counter()
    return {"stall_s": t1 - t0, "total_s": t1 - t0}


def megatron_async(state, target, threads, budget_bytes):
    _need_cuda("megatron_async")
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    d = _fresh(target, make=True)
    kwargs = {}
    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        kwargs["async_strategy"] = "mcore"
    queue = AsyncCallsQueue()
    sd = state.make_sharded()
    t0 = time.perf_counter()
    request = dist_checkpointing.save(sd, d, async_sharded_save=True, **kwargs)
    queue.schedule_async_request(request)
    t1 = time.perf_counter()
    queue.maybe_finalize_async_calls(blocking=True)
    t2 = time.perf_counter()
    queue.close()
    return {"stall_s": t1 - t0, "total_s": t2 - t0}


def dcp_sync(state, target, threads, budget_bytes):
    import torch.distributed.checkpoint as dcp

    d = _fresh(target)
    t0 = time.perf_counter()
    dcp.save(state.plain, storage_writer=dcp.FileSystemWriter(d, thread_count=threads),
             no_dist=not torch.distributed.is_initialized())
    t1 = time.perf_counter()
    return {"stall_s": t1 - t0, "total_s": t1 - t0}


def dcp_async_pinned(state, target, threads, budget_bytes):
    import torch.distributed.checkpoint as dcp

    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError as exc:
        raise Unavailable(f"dcp_async_pinned: this torch has no DefaultStager ({exc})")
    if not torch.distributed.is_initialized():
        raise Unavailable("dcp_async_pinned: dcp.async_save needs an initialized process group")
    pinned = torch.cuda.is_available()
    stager = DefaultStager(StagingOptions(pinned, False, True, pinned))
    d = _fresh(target)
    t0 = time.perf_counter()
    resp = dcp.async_save(state.plain, storage_writer=dcp.FileSystemWriter(d, thread_count=threads),
                          async_stager=stager)
    if hasattr(resp, "staging_completion"):
        resp.staging_completion.result()
        t1 = time.perf_counter()
        resp.upload_completion.result()
    else:
        t1 = time.perf_counter()
        resp.result()
    t2 = time.perf_counter()
    stager.close()
    return {"stall_s": t1 - t0, "total_s": t2 - t0}


RUNNERS = {name: globals()[name] for name in PEERS + EXTRA_PEERS}


THREADLESS = ("megatron_sync", "megatron_async")  # stock Megatron sets its own writers: no NAME@T


def resolve(peer: str):
    """The runner of ``peer``, a name of RUNNERS or ``NAME@T`` (that runner, T threads, for
    a saver that takes a thread count); ValueError naming the peer otherwise."""
    name, at, threads = peer.partition("@")
    if name not in RUNNERS:
        raise ValueError(f"unknown peer {peer!r} (peers: {', '.join(RUNNERS)}, each also as NAME@THREADS)")
    if not at:
        return RUNNERS[name]
    if name in THREADLESS:
        raise ValueError(f"peer {peer!r}: {name} takes no thread count")
    if not re.fullmatch(r"[1-9][0-9]*", threads):  # one spelling per count: @8, not @08 or @８
        raise ValueError(f"peer {peer!r}: the thread count after '@' must be a whole number >= 1")
    return lambda state, target, _threads, budget_bytes: RUNNERS[name](state, target, int(threads), budget_bytes)
