"""Rank bodies of the tests of `async_save(..., SaveOptions(return_after="planned"))` through the
public API (spawned ranks, see mp.py). On a CPU-only torch every source is host memory, copied by
the window's simulated copy stream into the pool and content-checked, as device sources are on a GPU.

The ordering is made deterministic by a pool of one chunk and a sink whose first data write waits
for an event: the copies cannot get past the first chunk until the test lets that write go.
"""

from __future__ import annotations

import os
import threading

import torch

WAIT_S = 60.0
N = 1 << 19  # 2 MiB per fp32 tensor: above the window's small-source size, so copied in the window
CHUNKS = 4


def _adamw(seed: int):
    """A real fused AdamW (what --optimizer-cpu-offload steps on the host) with its state made,
    and the next step's gradient in place."""
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(N, generator=g))
    w.grad = torch.randn(N, generator=g)
    opt = torch.optim.AdamW([w], lr=0.1, fused=True)
    opt.step()
    w.grad = torch.randn(N, generator=g)
    return w, opt


def _sharded(tensors: dict) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}


def _load(path: str, keys) -> dict:
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(_sharded({k: torch.empty(N) for k in keys}), path)


def _held_first_write(release: threading.Event, arrived: threading.Event | None = None, fail_with=None):
    from tests.helpers.hooked_sinks import HookedSink

    class HeldFirstWrite(HookedSink):
        writes = 0

        def before_write(self):
            HeldFirstWrite.writes += 1
            if HeldFirstWrite.writes == 1:
                if arrived is not None:
                    arrived.set()
                assert release.wait(WAIT_S), "the test never released the first write"
                if fail_with is not None:
                    raise fail_with

    return HeldFirstWrite


def _options(pool_bytes: int, sink, **kw):
    import safe_ckpt

    return safe_ckpt.SaveOptions(chunk_bytes=N * 4 // CHUNKS, io_threads=1, progress_interval_s=0,
                                 staging_budget_bytes=pool_bytes, return_after="planned",
                                 sink_factory=lambda d: sink(d), collective_timeout_s=WAIT_S, **kw)


def _step_in_thread(opt):
    done, errors = threading.Event(), []

    def run():
        try:
            opt.step()
        except BaseException as exc:
            errors.append(repr(exc))
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    return done, errors


def _wait_blocked_or_done(done: threading.Event) -> bool:
    """True once a gate of an open window blocks the host; False if the step finished first."""
    from safe_ckpt.staging import gates

    for _ in range(int(WAIT_S * 100)):
        if any(window.gate_blocked.is_set() for window in gates.open_windows()):
            return True
        if done.wait(0.01):
            return False
    raise AssertionError("the step neither blocked nor finished")


def step_right_after_the_call(rank, world, root, pool_chunks: int) -> dict:
    """The next training step's fused AdamW right after `async_save` returns, with a pool of
    ``pool_chunks`` chunks and the first write held. Returns whether the step was held, what the
    live tensors were while it was, and what stock `dist_checkpointing.load` reads back."""
    import safe_ckpt

    w, opt = _adamw(4242 + rank)
    m = opt.state[w]["exp_avg"]
    pre = {"w": w.detach().clone(), "m": m.clone()}
    release = threading.Event()
    path = os.path.join(root, "ck")
    opts = _options(pool_chunks * N * 4 // CHUNKS, _held_first_write(release))
    handle = safe_ckpt.async_save(_sharded({"w": w.detach(), "m": m}), path, options=opts)
    out = {"stall_s": handle.stall_s}
    if pool_chunks * N * 4 // CHUNKS >= 2 * N * 4:  # the pool holds the state: every copy lands unheld
        out["window_closed_before_step"] = handle.wait_window_closed(WAIT_S)
    done, errors = _step_in_thread(opt)
    out["step_blocked"] = _wait_blocked_or_done(done)
    out["unchanged_while_held"] = torch.equal(w.detach(), pre["w"]) and torch.equal(m, pre["m"])
    release.set()
    assert done.wait(WAIT_S), "the optimizer step never ran"
    out["step_errors"] = errors
    result = handle.wait(timeout=WAIT_S)
    out["files"] = len(result.files)
    stats = handle.window_stats()
    out["window"] = {"gates": stats.gates, "blocked_gates": stats.blocked_gates, "pending_bytes": stats.pending_bytes}
    loaded = _load(path, ("w", "m"))
    out["checkpoint_is_pre_step"] = [torch.equal(loaded["w"], pre["w"]), torch.equal(loaded["m"], pre["m"])]
    out["live_is_post_step"] = not torch.equal(w.detach(), pre["w"]) and not torch.equal(m, pre["m"])
    return out


def uncovered_write_right_after_the_call(rank, world, root) -> dict:
    """A checkpoint of iteration 1 with its tracker, then an overlapped save of iteration 2 and a
    write through ``.data`` right after the call, before the copies (first write held, pool of one
    chunk): the save must fail naming the key and rank, publish nothing, and leave iteration 1 and
    the tracker as they were."""
    import safe_ckpt
    from safe_ckpt.megatron import save_state
    from safe_ckpt.staging import gates

    w, opt = _adamw(99 + rank)
    m = opt.state[w]["exp_avg"]
    first = {"w": w.detach().clone(), "m": m.clone()}
    save_state(_sharded({"w": w.detach(), "m": m}), root, os.path.join(root, "iter_0000001"), "1",
               options=safe_ckpt.SaveOptions(chunk_bytes=N * 4 // CHUNKS, io_threads=1, progress_interval_s=0))
    opt.step()
    release = threading.Event()
    handle = save_state(_sharded({"w": w.detach(), "m": m}), root, os.path.join(root, "iter_0000002"), "2",
                        options=_options(N * 4 // CHUNKS, _held_first_write(release)), async_save=True)
    w.data.copy_(torch.full_like(w, 7.0))  # no gate orders it; no version counter moves
    release.set()
    out = {"versions": w._version}
    try:
        handle.wait(timeout=WAIT_S)
        out["error"] = None
    except safe_ckpt.CheckpointError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["error_types"] = [c.__name__ for c in type(exc).__mro__]
    out["published"] = os.path.exists(os.path.join(root, "iter_0000002"))
    out["tracker"] = open(os.path.join(root, "latest_checkpointed_iteration.txt")).read().strip()
    loaded = _load(os.path.join(root, "iter_0000001"), ("w", "m"))
    out["first_intact"] = [torch.equal(loaded["w"], first["w"]), torch.equal(loaded["m"], first["m"])]
    out["open_windows"] = len(gates.open_windows())
    return out


def write_fault_on_one_rank(rank, world, root, faulty_rank: int) -> dict:
    """Every rank saves with a pool of one chunk and its first write held, its next step waiting at
    the gate; then ``faulty_rank``'s held write fails. Every rank's step must go on and every
    rank's save fail; nothing is published."""
    import errno

    import safe_ckpt
    from safe_ckpt.staging import gates

    w, opt = _adamw(7 + rank)
    m = opt.state[w]["exp_avg"]
    release = threading.Event()
    fault = OSError(errno.EIO, "injected: the device went away") if rank == faulty_rank else None
    path = os.path.join(root, "ck")
    handle = safe_ckpt.async_save(_sharded({f"w{rank}": w.detach(), f"m{rank}": m}), path,
                                  options=_options(N * 4 // CHUNKS, _held_first_write(release, fail_with=fault)))
    done, errors = _step_in_thread(opt)
    blocked = _wait_blocked_or_done(done)
    release.set()
    out = {"blocked": blocked, "stepped": done.wait(WAIT_S), "step_errors": errors}
    try:
        handle.wait(timeout=WAIT_S)
        out["error"] = None
    except safe_ckpt.CheckpointError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["published"] = os.path.exists(path)
    out["open_windows"] = len(gates.open_windows())
    return out


def slime_restore_waits_for_the_window(rank, world, root) -> dict:
    """slime's weight switch (`TensorBackuper.restore`, mirror of slime 624b824a) right after an
    overlapped save of the actor weights, with the copies held: once slime's install guarded it, the
    restore waits at the gate and the checkpoint holds the actor weights, not the restored ones.
    Also: the install guards torch_memory_saver's pause (stand-in) where the module is imported."""
    import sys

    import safe_ckpt
    from safe_ckpt.integrations.slime import _guard_writers_of_saved_tensors
    from tests.helpers.paths import STAND_INS_TMS

    sys.path.insert(0, STAND_INS_TMS)
    import torch_memory_saver
    from tests.slime_mirror.utils.tensor_backper import TensorBackuper

    _guard_writers_of_saved_tensors("tests.slime_mirror.utils.tensor_backper")
    _guard_writers_of_saved_tensors("tests.slime_mirror.utils.tensor_backper")  # twice: wrapped once
    g = torch.Generator().manual_seed(31 + rank)
    p = torch.randn(N, generator=g)
    backuper = TensorBackuper.create(source_getter=lambda: iter([("p", p)]), single_tag=None)
    backuper.backup("ref")  # the reference model's weights
    p.copy_(torch.randn(N, generator=g))  # the actor's weights, trained since
    actor = p.clone()
    release = threading.Event()
    path = os.path.join(root, "ck")
    handle = safe_ckpt.async_save(_sharded({"p": p}), path, options=_options(N * 4 // CHUNKS, _held_first_write(release)))
    done, errors = threading.Event(), []

    def switch():
        try:
            backuper.restore("ref")  # slime's _switch_model("ref")
        except BaseException as exc:
            errors.append(repr(exc))
        finally:
            done.set()

    threading.Thread(target=switch, daemon=True).start()
    out = {"restore_blocked": _wait_blocked_or_done(done), "unchanged_while_held": torch.equal(p, actor)}
    release.set()
    out["restored"] = done.wait(WAIT_S) and not errors and torch.equal(p, backuper.get("ref")["p"])
    handle.wait(timeout=WAIT_S)
    out["checkpoint_is_actor"] = torch.equal(_load(path, ("p",))["p"], actor)
    out["pause_guarded"] = bool(torch_memory_saver.torch_memory_saver.__dict__.get("_safe_ckpt_pause_guarded"))
    return out


def integrity_manifest_with_small_sources_first(rank, world, root) -> dict:
    """Large and small tensors side by side in the files, Megatron's integrity manifest on: the
    window copies the small sources first, yet the writers must hash every file front to back.
    Returns each data file's SHA-256 against the manifest's, and whether stock load reads it all."""
    import hashlib
    import json

    import safe_ckpt
    from megatron.core import dist_checkpointing

    g = torch.Generator().manual_seed(3 + rank)
    tensors = {}
    for i in range(6):
        tensors[f"big{i}"] = torch.randn(N, generator=g)  # 2 MiB: above the small-source size
        tensors[f"small{i}"] = torch.randn(1 << 12, generator=g)
    path = os.path.join(root, "ck")
    opts = safe_ckpt.SaveOptions(io_threads=1, progress_interval_s=0, return_after="planned", integrity_manifest=True,
                                 chunk_bytes=N)
    handle = safe_ckpt.async_save(_sharded(tensors), path, options=opts)
    out = {"error": None}
    try:
        handle.wait(timeout=WAIT_S)
    except safe_ckpt.CheckpointError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    manifest = json.load(open(os.path.join(path, "integrity.json")))["files"]
    out["digests_match"] = {name: hashlib.sha256(open(os.path.join(path, name), "rb").read()).hexdigest() == digest
                            for name, digest in manifest.items()}
    loaded = dist_checkpointing.load(_sharded({k: torch.empty_like(t) for k, t in tensors.items()}), path)
    out["content_equal"] = all(torch.equal(loaded[k], t) for k, t in tensors.items())
    return out


def before_update_past_the_timeout(rank, world, root) -> dict:
    """`SaveHandle.before_update()` right after the call while the copies cannot go on (pool of one
    chunk, the first write held until the gate returned), `collective_timeout_s` 1 s: the gate returns
    after it, the save is abandoned with `StagingTimeoutError` naming the remedy, nothing published."""
    import time

    import safe_ckpt

    w, opt = _adamw(55 + rank)
    release = threading.Event()
    path = os.path.join(root, "ck")
    opts = safe_ckpt.SaveOptions(chunk_bytes=N * 4 // CHUNKS, io_threads=1, progress_interval_s=0,
                                 staging_budget_bytes=N * 4 // CHUNKS, return_after="planned",
                                 sink_factory=lambda d: _held_first_write(release)(d), collective_timeout_s=1.0)
    handle = safe_ckpt.async_save(_sharded({"w": w.detach(), "m": opt.state[w]["exp_avg"]}), path, options=opts)
    t0 = time.monotonic()
    handle.before_update()  # blocks until the save is abandoned
    out = {"gate_s": time.monotonic() - t0, "blocked_gates": handle.window_stats().blocked_gates}
    release.set()
    try:
        handle.wait(timeout=WAIT_S)
        out["error"] = None
    except safe_ckpt.CheckpointError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["published"] = os.path.exists(path)
    out["window_closed"] = handle.window_closed()
    return out


def big_chunks_get_grid_sums_in_the_window(rank, world, root) -> dict:
    """A planned save whose chunks are large enough for grid sums: the window enqueues them on the
    (here simulated) copy stream, so the writers fold sums instead of hashing payloads on the host.
    Returns the manifest's algorithms per key, whether both loaders read it back equal with every
    checksum verified, and the error `safe_ckpt.load` raises once a payload byte is flipped."""
    import safe_ckpt
    from safe_ckpt.integrity import Manifest
    from safe_ckpt.names import MANIFEST_FILE

    g = torch.Generator().manual_seed(11 + rank)
    tensors = {"big": torch.randn(5 << 20, generator=g), "small": torch.randn(1 << 12, generator=g)}
    path = os.path.join(root, "ck")
    opts = safe_ckpt.SaveOptions(io_threads=1, progress_interval_s=0, return_after="planned", chunk_bytes=10 << 20)
    safe_ckpt.async_save(_sharded(tensors), path, options=opts).wait(timeout=WAIT_S)
    manifest = Manifest.parse(open(os.path.join(path, MANIFEST_FILE), "rb").read())
    out = {"algorithms": {it.fqn: it.algorithm or manifest.algorithm for it in manifest.items}}
    reports = []
    loaded = safe_ckpt.load(_sharded({k: torch.empty_like(t) for k, t in tensors.items()}), path,
                            options=safe_ckpt.LoadOptions(on_read=reports.append))
    out["equal"] = all(torch.equal(loaded[k], t) for k, t in tensors.items())
    out["verified"], out["items"] = reports[-1].verified, reports[-1].items
    from megatron.core import dist_checkpointing

    stock = dist_checkpointing.load(_sharded({k: torch.empty_like(t) for k, t in tensors.items()}), path)
    out["stock_equal"] = all(torch.equal(stock[k], t) for k, t in tensors.items())
    data = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
    with open(os.path.join(path, data[0]), "r+b") as f:  # a byte in the middle of the big payload
        f.seek(os.path.getsize(os.path.join(path, data[0])) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    try:
        safe_ckpt.load(_sharded({k: torch.empty_like(t) for k, t in tensors.items()}), path)
        out["after_flip"] = None
    except safe_ckpt.CheckpointError as exc:
        out["after_flip"] = f"{type(exc).__name__}: {exc}"
    return out
