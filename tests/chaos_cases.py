"""Processes of the chaos soak (tests/test_chaos_soak.py).

Rank processes live across many saves: each joins a gloo world and then takes commands from
the driver (save iteration N through the Megatron adapter, with a fault if one is asked for;
load iteration N back with stock Megatron and compare it bit for bit). An intruder process,
outside that world, saves the same iteration while a rank is held at a gate. Gates are
multiprocessing events: a gated rank's first data write sets `arrived` and waits for `go`.
"""

from __future__ import annotations

import os
import queue as queue_mod
import threading
import traceback
from dataclasses import replace

GATE_WAIT_S = 60.0  # a gate the driver never opens fails the save instead of hanging the soak
KEEP_LAST = 2


def spec_for(iteration: int):
    from safe_ckpt.synthetic import StateSpec
    from tests.cases import SMALL

    return replace(StateSpec(**SMALL), seed=7919 * iteration + 1)


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


class EventGatedSink:
    """A sink whose first data write announces itself (``arrived``) and waits for ``go``."""

    def __init__(self, inner, arrived, go) -> None:
        self.inner = inner
        self.root = inner.root
        self._arrived, self._go = arrived, go
        self._lock = threading.Lock()
        self._passed = False

    def _gate(self) -> None:
        with self._lock:
            if self._passed:
                return
            self._arrived.set()
            if not self._go.wait(GATE_WAIT_S):
                raise OSError(110, f"the soak's gate was not opened within {GATE_WAIT_S} s")
            self._passed = True

    def open(self, relative_path, size_bytes):
        inner = self.inner.open(relative_path, size_bytes)
        sink = self

        class File:
            def write_at(self, offset_bytes, buffers):
                sink._gate()
                inner.write_at(offset_bytes, buffers)

            def sync(self):
                inner.sync()

            def close(self):
                inner.close()

        return File()

    def write_file(self, relative_path, data):
        self.inner.write_file(relative_path, data)

    def sync_root(self):
        self.inner.sync_root()


def _describe(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc)[:2000], "traceback": traceback.format_exc()[-4000:]}


def _options(fault, gate, timeout_s):
    from safe_ckpt.sinks.faults import Fault, FaultySink
    from safe_ckpt.sinks.posix import PosixSink
    from tests.cases import small_options

    factory = None
    if fault is not None:
        f = Fault(**fault)
        factory = lambda d: FaultySink(PosixSink(d), f)  # noqa: E731
    elif gate is not None:
        factory = lambda d: EventGatedSink(PosixSink(d), *gate)  # noqa: E731
    return small_options(collective_timeout_s=timeout_s, sink_factory=factory)


def _save(rank, world, root, iteration, fault, gate, timeout_s) -> dict:
    from safe_ckpt.megatron import save_state
    from safe_ckpt.retention import Retention
    from safe_ckpt.synthetic import build_state, reference_tensors

    spec = spec_for(iteration)
    state = build_state(rank, world, tp=world, spec=spec, references=reference_tensors(spec, world))
    save_state(state, root, iter_dir(root, iteration), str(iteration), options=_options(fault, gate, timeout_s),
               retention=Retention(keep_last=KEEP_LAST))
    return {}


def _load(rank, world, root, iteration) -> dict:
    from megatron.core import dist_checkpointing

    from safe_ckpt.synthetic import build_state, reference_tensors
    from tests.cases import compare_loaded

    spec = spec_for(iteration)
    refs = reference_tensors(spec, world)
    target = build_state(rank, world, tp=world, spec=spec, layout="alt", empty=True, references=refs, saved_tp=world)
    expected = build_state(rank, world, tp=world, spec=spec, layout="alt", references=refs, saved_tp=world)
    return {"mismatches": compare_loaded(dist_checkpointing.load(target, iter_dir(root, iteration)), expected)}


def rank_main(rank, world, init_file, commands, results, arrived, go, timeout_s) -> None:
    """One rank: join the world, then run commands until told to stop."""
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    results.put((rank, "ready", {"pid": os.getpid()}))
    while True:
        try:
            cmd = commands.get(timeout=600)
        except queue_mod.Empty:
            return  # the driver is gone
        if cmd["op"] == "stop":
            break
        try:
            if cmd["op"] == "save":
                gate = (arrived, go) if cmd.get("gate") else None
                value = _save(rank, world, cmd["root"], cmd["iteration"], cmd.get("fault"), gate, timeout_s)
            else:
                value = _load(rank, world, cmd["root"], cmd["iteration"])
            results.put((rank, "ok", value))
        except BaseException as exc:  # reported to the driver, which judges it
            results.put((rank, "error", _describe(exc)))
    dist.destroy_process_group()


def intruder_main(commands, results) -> None:
    """A process outside the world (no torch.distributed) that saves a different state under
    the same iteration's name while the world's save of it is held mid-write."""
    from safe_ckpt.megatron import save_state
    from safe_ckpt.synthetic import build_state, reference_tensors
    from tests.cases import small_options

    results.put(("intruder", "ready", {"pid": os.getpid()}))
    while True:
        try:
            cmd = commands.get(timeout=600)
        except queue_mod.Empty:
            return
        if cmd["op"] == "stop":
            return
        spec = replace(spec_for(cmd["iteration"]), seed=-cmd["iteration"] - 17)
        try:
            save_state(build_state(0, 1, tp=1, spec=spec, references=reference_tensors(spec, 1)), cmd["root"],
                       iter_dir(cmd["root"], cmd["iteration"]), str(cmd["iteration"]),
                       options=small_options(collective_timeout_s=30))
            results.put(("intruder", "ok", {}))
        except BaseException as exc:
            results.put(("intruder", "error", _describe(exc)))
