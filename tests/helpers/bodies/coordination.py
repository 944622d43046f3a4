"""Rank bodies for tests/coord/test_saves_never_cross_pair_or_hang.py (each runs on every rank of a gloo world, see mp.py)."""

from __future__ import annotations

import errno
import os
import signal
import threading
import time

import torch

import safe_ckpt
from safe_ckpt_lab.synthetic import bits_equal
from tests.helpers.hooked_sinks import HookedSink
from tests.helpers.mp import describe_exception

ROWS, COLS = 64, 64  # each rank's shard: 16 KiB of float32
GATE_S = 60.0  # bound on every gate: a test whose gate never opens fails instead of hanging


def options(**kw) -> safe_ckpt.SaveOptions:
    base = dict(chunk_bytes=16 * 1024, io_threads=1, staging_budget_bytes=1 << 20, progress_interval_s=0,
                collective_timeout_s=300.0, fsync=False)
    base.update(kw)
    return safe_ckpt.SaveOptions(**base)


def full(seed: int, world: int) -> torch.Tensor:
    return torch.randn(ROWS * world, COLS, generator=torch.Generator().manual_seed(seed))


def state(tensor: torch.Tensor, rank: int, world: int) -> dict:
    """{"w": this rank's rows of ``tensor``}, as a Megatron sharded state dict."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    data = tensor[rank * ROWS:(rank + 1) * ROWS]
    return {"w": ShardedTensor("w", data, data.dtype, tuple(data.shape), tuple(tensor.shape), (rank * ROWS, 0),
                               axis_fragmentations=None)}


def loads_as(path: str, tensor: torch.Tensor, rank: int, world: int) -> bool:
    """Stock Megatron loads this rank's rows of ``path`` bit-exact equal to ``tensor``'s."""
    from megatron.core import dist_checkpointing

    target = state(torch.empty_like(tensor), rank, world)
    loaded = dist_checkpointing.load(target, path)
    return bits_equal(loaded["w"], tensor[rank * ROWS:(rank + 1) * ROWS])


def leftovers(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if ".safe_ckpt-" in n)


def live_save_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate()
                  if t.name.startswith(("safe_ckpt-stage", "safe_ckpt-write", "safe_ckpt-sum", "safe_ckpt-staged")))


def attempt(fn) -> dict:
    t0 = time.monotonic()
    try:
        fn()
        return {"error": None, "elapsed_s": time.monotonic() - t0}
    except BaseException as exc:
        return {"error": describe_exception(exc), "elapsed_s": time.monotonic() - t0}


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


class GatedSink(HookedSink):
    """Holds its first item write until ``gate`` is set (bounded); ``reached`` tells it got there."""

    def __init__(self, root, gate: threading.Event, reached: threading.Event | None = None) -> None:
        super().__init__(root)
        self.gate, self.reached, self._first = gate, reached or threading.Event(), True

    def before_write(self) -> None:
        if self._first:
            self._first = False
            self.reached.set()
            self.gate.wait(GATE_S)


# ------------------------------------------------------------------ two saves at once in a process


def concurrent_saves(rank, world, root, mirrored: bool) -> dict:
    """Two threads each save `model` (A) and `ema` (B) at once. With ``mirrored``, rank 0 starts
    `model` first and every other rank `ema` first; the first save's writes are held until the
    second one has been planned (or is waiting for it)."""
    import safe_ckpt.coord.dist as sdist

    a, b = full(1, world), full(2, world)
    first, second = ("ema", "model") if mirrored and rank != 0 else ("model", "ema")
    tensors = {"model": a, "ema": b}
    second_planned, second_entered, first_planning = threading.Event(), threading.Event(), threading.Event()
    real_coordinator = sdist.coordinator

    def coordinator(*args, **kw):  # the first save is in its planning: the second may start
        if threading.current_thread().name == "first":
            first_planning.set()
        return real_coordinator(*args, **kw)

    sdist.coordinator = coordinator
    # Mirrored: hold the first save's writes until the second has planned (old code: both saves
    # are then cross-paired for sure). Same order: until the second has entered `save`.
    first_gate = second_planned if mirrored else second_entered

    def sink_for(name):
        def factory(directory):
            if name == second:
                second_planned.set()
                return HookedSink(directory)
            return GatedSink(directory, first_gate)
        return factory

    out = {}

    def run(name, wait_for=None):
        if wait_for is not None:
            wait_for.wait(GATE_S)
            second_entered.set()
        out[name] = attempt(lambda: safe_ckpt.save(state(tensors[name], rank, world), os.path.join(root, name),
                                                   options=options(sink_factory=sink_for(name))))

    threads = [threading.Thread(target=run, args=(first,), name="first"),
               threading.Thread(target=run, args=(second, first_planning), name="second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * GATE_S)
    sdist.coordinator = real_coordinator
    out["threads_alive"] = [t.name for t in threads if t.is_alive()]
    barrier()
    out["published"] = sorted(n for n in ("model", "ema") if os.path.exists(os.path.join(root, n)))
    out["loads"] = {n: loads_as(os.path.join(root, n), tensors[n], rank, world) for n in out["published"]}
    barrier()
    out["leftovers"] = leftovers(root)
    barrier()  # every rank has looked before the next save creates its staging directory
    # The group is in step: one more save on it succeeds and loads bit-exact.
    c = full(3, world)
    after = os.path.join(root, "after")
    out["after"] = attempt(lambda: safe_ckpt.save(state(c, rank, world), after, options=options()))
    out["after_loads"] = out["after"]["error"] is None and loads_as(after, c, rank, world)
    return out


# ------------------------------------------------------------------ a rank-local failure after planning


def local_failure_then_save(rank, world, root) -> dict:
    """The sink factory raises on rank 1 only; then the post-commit step raises on rank 1 only;
    then a plain save on the same group."""
    from safe_ckpt import saving

    a = full(4, world)

    def factory(directory):
        if rank == 1:
            raise RuntimeError("injected: cannot build the sink")
        return HookedSink(directory)

    safe_ckpt.save(state(a, rank, world), os.path.join(root, "warm"), options=options())  # imports, group
    barrier()
    out = {"factory": attempt(lambda: safe_ckpt.save(state(a, rank, world), os.path.join(root, "broken"),
                                                     options=options(sink_factory=factory)))}
    out["broken_exists"] = os.path.exists(os.path.join(root, "broken"))
    barrier()
    out["leftovers_after_factory"] = leftovers(root)

    def hook(coord):
        if coord.rank == 1:
            raise ValueError("injected: post-commit step failed")

    barrier()
    out["hook"] = attempt(lambda: saving.start(state(a, rank, world), os.path.join(root, "hooked"),
                                               options=options(), post_commit=hook).finish())
    good = os.path.join(root, "good")
    out["good"] = attempt(lambda: safe_ckpt.save(state(a, rank, world), good, options=options()))
    out["good_loads"] = out["good"]["error"] is None and loads_as(good, a, rank, world)
    barrier()
    out["leftovers"] = leftovers(root)
    return out


# ------------------------------------------------------------------ interrupts


def interrupts(rank, world, root) -> dict:
    """Rank 1 is interrupted twice: a sink raising KeyboardInterrupt in a writer thread, then a
    SIGINT to its main thread while its only writer is held at a gate; then a plain save."""
    from safe_ckpt.write import pipeline

    a = full(5, world)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # a test run started in the background (`cmd &` in a script) inherits SIGINT ignored,
        # and Python then leaves it so: give this rank the handler an interactive run has
        signal.signal(signal.SIGINT, signal.default_int_handler)
    out = {"sigint_handler_is_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler}

    class InterruptingSink(HookedSink):
        def before_write(self):
            raise KeyboardInterrupt("injected in a writer thread")

    factory = (lambda d: InterruptingSink(d)) if rank == 1 else None
    out["writer"] = attempt(lambda: safe_ckpt.save(state(a, rank, world), os.path.join(root, "writer"),
                                                   options=options(sink_factory=factory)))
    out["writer_threads_after"] = live_save_threads()

    joining, cancelled = threading.Event(), threading.Event()
    real_join, real_cancel = pipeline.RankWriter.join, pipeline.RankWriter.cancel

    def join(self):
        joining.set()
        return real_join(self)

    def cancel(self):
        cancelled.set()
        return real_cancel(self)

    pipeline.RankWriter.join, pipeline.RankWriter.cancel = join, cancel
    main = threading.main_thread().ident

    class SignallingSink(HookedSink):
        first = True

        def before_write(self):
            if SignallingSink.first:
                SignallingSink.first = False
                joining.wait(GATE_S)  # the main thread waits for the writers
                signal.pthread_kill(main, signal.SIGINT)
                cancelled.wait(GATE_S)  # held until the save stops its writers

    factory = (lambda d: SignallingSink(d)) if rank == 1 else None
    out["main"] = attempt(lambda: safe_ckpt.save(state(a, rank, world), os.path.join(root, "main"),
                                                 options=options(sink_factory=factory)))
    out["main_threads_after"] = live_save_threads()
    pipeline.RankWriter.join, pipeline.RankWriter.cancel = real_join, real_cancel
    barrier()
    out["published"] = sorted(n for n in ("writer", "main") if os.path.exists(os.path.join(root, n)))
    out["leftovers"] = leftovers(root)
    barrier()
    good = os.path.join(root, "good")
    out["good"] = attempt(lambda: safe_ckpt.save(state(a, rank, world), good, options=options()))
    out["good_loads"] = out["good"]["error"] is None and loads_as(good, a, rank, world)
    return out


# ------------------------------------------------------------------ torn async host sources


def changed_through_data(rank, world, root) -> dict:
    """An async save of a host parameter; on rank 1 its only write is held at a gate while the
    training step changes the parameter through `.data` (the version counter does not move)."""
    w = torch.nn.Parameter(full(6, world)[rank * ROWS:(rank + 1) * ROWS].clone())
    shape = (ROWS * world, COLS)

    def st(tensor):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        return {"w": ShardedTensor("w", tensor, tensor.dtype, tuple(tensor.shape), shape, (rank * ROWS, 0),
                                   axis_fragmentations=None)}

    gate, reached = threading.Event(), threading.Event()
    factory = (lambda d: GatedSink(d, gate, reached)) if rank == 1 else None
    path = os.path.join(root, "torn")
    version = w._version
    handle = safe_ckpt.async_save(st(w), path, options=options(sink_factory=factory))
    if rank == 1:
        reached.wait(GATE_S)
        w.data.fill_(7.0)  # the training step runs on
        gate.set()
    out = {"torn": attempt(lambda: handle.wait(timeout=3 * GATE_S)), "version_moved": w._version != version}
    barrier()
    out["torn_exists"] = os.path.exists(path)
    out["leftovers"] = leftovers(root)
    barrier()
    kept = w.detach().clone()
    good = os.path.join(root, "good")
    out["good"] = attempt(lambda: safe_ckpt.async_save(st(w), good, options=options()).wait(timeout=3 * GATE_S))
    if out["good"]["error"] is None:
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(st(torch.empty_like(kept)), good)
        out["good_loads"] = bits_equal(loaded["w"], kept)
    return out


# ------------------------------------------------------------------ the store's arrival keys


def store_keys(rank, world, root) -> dict:
    """Six saves, the third failing on rank 1: the store's key count after each."""
    import torch.distributed as dist
    from safe_ckpt.sinks.faults import Fault, FaultySink
    from safe_ckpt.sinks.posix import PosixSink

    store = dist.distributed_c10d._get_default_store()
    a = full(7, world)
    counts, errors = [], []
    for i in range(6):
        bad = i == 2 and rank == 1
        factory = (lambda d: FaultySink(PosixSink(d, False), Fault(on="open", errno=errno.ENOSPC))) if bad else None
        r = attempt(lambda: safe_ckpt.save(state(a, rank, world), os.path.join(root, f"s{i}"),
                                           options=options(sink_factory=factory)))
        errors.append(r["error"]["type"] if r["error"] else None)
        barrier()
        counts.append(store.num_keys())
        barrier()
    last = os.path.join(root, "s5")
    return {"counts": counts, "errors": errors, "last_loads": loads_as(last, a, rank, world)}
