"""Processes of the chaos soak (tests/soak/test_chaos_soak.py).

Rank processes live across many saves: each joins a gloo world and then takes commands from
the driver (save iteration N through the Megatron adapter, with a fault if one is asked for;
load iteration N back with stock Megatron and compare it bit for bit). An intruder process,
outside that world, saves the same iteration while a rank is held at a gate. Gates are
multiprocessing events: a gated rank's first data write sets `arrived` and waits for `go`.

Faults at the publish (`PublishFault`, rank 0, which publishes): each call `commit.publish`
makes to `fsync_path`, `_exchange` or `os.rename` is a step; at the chosen step a
`KeyboardInterrupt` is raised before or after the call, a SIGINT is sent, or EIO replaces the
call. On an object store (`KvFault`): EIO on a data write, SIGKILL, or the commit's last write
(`metadata.json`) unconfirmed: landed, landed but the store cannot be asked, or lost.
"""

from __future__ import annotations

import errno
import os
import queue as queue_mod
import signal
import traceback
from dataclasses import replace

GATE_WAIT_S = 60.0  # a gate the driver never opens fails the save instead of hanging the soak
KEEP_LAST = 2


def spec_for(iteration: int, version: int = 0):
    """The state saved as ``iteration``; ``version`` counts re-saves of that iteration."""
    from safe_ckpt_lab.synthetic import StateSpec
    from tests.helpers.bodies.common import SMALL

    return replace(StateSpec(**SMALL), seed=7919 * iteration + 1 + 104729 * version)


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}") if "://" not in root else f"{root}/iter_{iteration:07d}"


class PublishFault:
    """While active, the ``step``-th call `commit.publish` makes to `fsync_path`, `_exchange` or
    `os.rename` meets ``kind``: "interrupt" (raised ``when`` "before" or "after" the call),
    "sigint" (sent to this process before the call) or "eio" (instead of the call);
    ``no_exchange``: as where the filesystem has no renameat2."""

    def __init__(self, step: int, kind: str, when: str = "before", no_exchange: bool = False) -> None:
        self.step, self.kind, self.when, self.no_exchange = step, kind, when, no_exchange
        self.calls = 0
        self.fired = False
        self._inside = False

    def _wrap(self, real):
        def call(*args, **kwargs):
            if not self._inside or self.fired:
                return real(*args, **kwargs)
            self.calls += 1
            if self.calls - 1 != self.step:
                return real(*args, **kwargs)
            self.fired = True
            if self.kind == "eio":
                raise OSError(errno.EIO, "injected EIO in the publish")
            if self.kind == "sigint":
                os.kill(os.getpid(), signal.SIGINT)
                return real(*args, **kwargs)
            if self.when == "after":
                real(*args, **kwargs)
            raise KeyboardInterrupt("injected in the publish")
        return call

    def __enter__(self):
        from safe_ckpt.targets.directory import publish as commit

        self._saved = (commit.publish, commit.fsync_path, commit._exchange, os.rename)
        real_publish = commit.publish

        def publish(*args, **kwargs):
            self._inside = True
            try:
                return real_publish(*args, **kwargs)
            finally:
                self._inside = False

        commit.publish = publish
        commit.fsync_path = self._wrap(commit.fsync_path)
        # without renameat2 (NFS, Lustre) a replace is two renames
        commit._exchange = self._wrap((lambda a, b: False) if self.no_exchange else commit._exchange)
        os.rename = self._wrap(os.rename)
        return self

    def __exit__(self, *exc):
        from safe_ckpt.targets.directory import publish as commit

        commit.publish, commit.fsync_path, commit._exchange, os.rename = self._saved
        return False


class KvFault:
    """The kvstore sink with one fault: "data_eio" (the first data write fails), "kill" (SIGKILL at
    the first data write), or the commit's last write unconfirmed: "ambiguous_landed" (it reached
    the store), "ambiguous_unknown" (it did, and reading it back fails too), "ambiguous_lost" (it did not)."""

    def __init__(self, inner, kind: str) -> None:
        self.inner, self.kind, self.root = inner, kind, inner.root

    def __getattr__(self, name):  # list, read, delete, one_item_per_file, deadlines, ...
        return getattr(self.inner, name)

    def open(self, relative_path, size_bytes):
        inner, kind = self.inner.open(relative_path, size_bytes), self.kind

        class File:
            def write_at(self, offset_bytes, buffers):
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if kind == "data_eio":
                    raise OSError(errno.EIO, f"injected EIO writing {relative_path}")
                inner.write_at(offset_bytes, buffers)

            def sync(self):
                inner.sync()

            def close(self):
                inner.close()

        return File()

    def _timeout(self, name):
        from safe_ckpt.errors import WriteError

        return WriteError(f"{self.root}{name}: the store did not answer within 5.0 s (injected)")

    def write_file(self, relative_path, data):
        if relative_path != "metadata.json" or not self.kind.startswith("ambiguous"):
            return self.inner.write_file(relative_path, data)
        if self.kind != "ambiguous_lost":
            self.inner.write_file(relative_path, data)
        raise self._timeout(relative_path)

    def read(self, relative_path):
        if self.kind == "ambiguous_unknown" and relative_path == "metadata.json":
            raise self._timeout(relative_path)
        return self.inner.read(relative_path)

    def sync_root(self):
        self.inner.sync_root()


def _describe(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc)[:2000], "traceback": traceback.format_exc()[-4000:]}


def _options(fault, gate, timeout_s, kv: bool):
    from safe_ckpt.sinks.faults import Fault, FaultySink
    from safe_ckpt.sinks.posix import PosixSink
    from tests.helpers.bodies.common import small_options
    from tests.helpers.hooked_sinks import EventGate

    factory = None
    if fault is not None and "kv" in fault:
        factory = lambda sink: KvFault(sink, fault["kv"])  # noqa: E731
    elif fault is not None and "publish" not in fault:
        f = Fault(**fault)
        factory = lambda d: FaultySink(PosixSink(d), f)  # noqa: E731
    elif gate is not None:
        factory = (lambda sink: EventGate(sink, *gate, GATE_WAIT_S)) if kv else \
            (lambda d: EventGate(PosixSink(d), *gate, GATE_WAIT_S))  # noqa: E731
    return small_options(collective_timeout_s=timeout_s, sink_factory=factory,
                         **({"kvstore_request_timeout_s": 10.0} if kv else {}))


def _save(rank, world, root, iteration, fault, gate, timeout_s, version=0) -> dict:
    import contextlib

    from safe_ckpt.megatron import save_state
    from safe_ckpt.targets.retention import Retention
    from safe_ckpt_lab.synthetic import build_state, reference_tensors

    spec = spec_for(iteration, version)
    state = build_state(rank, world, tp=world, spec=spec, references=reference_tensors(spec, world))
    injected = PublishFault(**fault["publish"]) if fault and "publish" in fault else contextlib.nullcontext()
    with injected:
        save_state(state, root, iter_dir(root, iteration), str(iteration),
                   options=_options(fault, gate, timeout_s, "://" in root), retention=Retention(keep_last=KEEP_LAST))
    return {"publish_fault_fired": getattr(injected, "fired", None)}


def _load(rank, world, directory, iteration, version=0) -> dict:
    from megatron.core import dist_checkpointing

    from safe_ckpt_lab.synthetic import build_state, reference_tensors
    from tests.helpers.bodies.common import compare_loaded

    spec = spec_for(iteration, version)
    refs = reference_tensors(spec, world)
    target = build_state(rank, world, tp=world, spec=spec, layout="alt", empty=True, references=refs, saved_tp=world)
    expected = build_state(rank, world, tp=world, spec=spec, layout="alt", references=refs, saved_tp=world)
    return {"mismatches": compare_loaded(dist_checkpointing.load(target, directory), expected)}


def rank_main(rank, world, init_file, commands, results, arrived, go, timeout_s) -> None:
    """One rank: join the world, then run commands until told to stop."""
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # a soak started in the background inherits it ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)
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
                value = _save(rank, world, cmd["root"], cmd["iteration"], cmd.get("fault"), gate, timeout_s,
                              cmd.get("version", 0))
            else:
                value = _load(rank, world, cmd["dir"], cmd["iteration"], cmd.get("version", 0))
            results.put((rank, "ok", value))
        except BaseException as exc:  # reported to the driver, which judges it
            results.put((rank, "error", _describe(exc)))
    dist.destroy_process_group()


def intruder_main(commands, results) -> None:
    """A process outside the world (no torch.distributed) that saves a different state under
    the same iteration's name while the world's save of it is held mid-write."""
    from safe_ckpt.megatron import save_state
    from safe_ckpt_lab.synthetic import build_state, reference_tensors
    from tests.helpers.bodies.common import small_options

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
