"""Run a function on N real processes joined by a gloo process group (FileStore).

Each rank's return value (or the exception it raised, as a plain dict) comes back to
the parent; a rank that does not finish within the timeout is killed and reported as
hung, so a test fails instead of waiting forever.
"""

from __future__ import annotations

import os
import queue as queue_mod
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def describe_exception(exc: BaseException) -> dict:
    return {
        "type": type(exc).__name__,
        "mro": [c.__name__ for c in type(exc).__mro__],
        "message": str(exc),
        "failing_ranks": list(getattr(exc, "failing_ranks", []) or []),
        "traceback": traceback.format_exc(),
    }


def _child(rank, world_size, init_file, target, args, out_queue, backend="gloo"):
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        if backend == "nccl":
            import torch

            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        try:
            value = target(rank, world_size, *args)
            out_queue.put((rank, "ok", value))
        except BaseException as exc:  # reported to the parent, which asserts on it
            out_queue.put((rank, "error", describe_exception(exc)))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:
        out_queue.put((rank, "error", describe_exception(exc)))


def run_world(world_size: int, target, args=(), timeout_s: float = 240.0,
              backend: str = "gloo") -> list[tuple[str, object]]:
    """[(status, value_or_error_dict)] in rank order; status "ok", "error" or "hung"."""
    ctx = mp.get_context("spawn")
    out_queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_child, args=(r, world_size, init_file, target, args, out_queue, backend), daemon=False)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, tuple[str, object]] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < world_size and time.monotonic() < deadline:
            try:
                rank, status, value = out_queue.get(timeout=0.5)
                results[rank] = (status, value)
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and out_queue.empty():
                    break
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()) if len(results) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
        return [results.get(r, ("hung", {"exitcode": procs[r].exitcode})) for r in range(world_size)]


def values(results) -> list:
    """The ranks' return values; fails with every rank's error if any rank did not succeed."""
    bad = [(r, s, v) for r, (s, v) in enumerate(results) if s != "ok"]
    if bad:
        lines = []
        for r, s, v in bad:
            lines.append(f"rank {r}: {s}: {v.get('type') if isinstance(v, dict) else ''} {v.get('message', v) if isinstance(v, dict) else v}")
            if isinstance(v, dict) and v.get("traceback"):
                lines.append(v["traceback"])
        raise AssertionError("\n".join(lines))
    return [v for _, v in results]
