"""Rank bodies for the crash / hang / read-only tests (see mp.py)."""

from __future__ import annotations

import os
import signal
import time


import safe_ckpt
from safe_ckpt_lab.synthetic import StateSpec, build_state, reference_tensors
from tests.helpers.bodies.common import SMALL, compare_loaded, small_options
from tests.helpers.mp import describe_exception


def _spec():
    return StateSpec(**SMALL)


def _tracker(root):
    path = os.path.join(root, "latest_checkpointed_iteration.txt")
    return open(path).read() if os.path.exists(path) else None


def good_then_faulty(rank, world, root, fault_kw, timeout_s) -> dict:
    """Iteration 1 saves cleanly; iteration 2's sink misbehaves on the last rank."""
    from safe_ckpt.megatron import save_state
    from safe_ckpt.sinks.faults import Fault, FaultySink
    from safe_ckpt.sinks.posix import PosixSink

    spec = _spec()
    refs = reference_tensors(spec, world)
    opts = small_options(collective_timeout_s=timeout_s)
    save_state(build_state(rank, world, tp=world, spec=spec, references=refs), root,
               os.path.join(root, "iter_0000001"), "1", options=opts)
    fault = Fault(**fault_kw)
    bad = small_options(collective_timeout_s=timeout_s,
                        sink_factory=(lambda d: FaultySink(PosixSink(d), fault)) if rank == world - 1 else None)
    t0 = time.monotonic()
    out = {}
    try:
        save_state(build_state(rank, world, tp=world, spec=_changed(spec), references=None), root,
                   os.path.join(root, "iter_0000002"), "2", options=bad)
        out["error"] = None
    except BaseException as exc:
        out["error"] = describe_exception(exc)
    out["elapsed_s"] = time.monotonic() - t0
    out["tracker"] = _tracker(root)
    out["iter2_exists"] = os.path.exists(os.path.join(root, "iter_0000002"))
    return out


def _changed(spec):
    from dataclasses import replace

    return replace(spec, seed=spec.seed + 1)


def load_iteration_1(rank, world, root) -> dict:
    from megatron.core import dist_checkpointing

    spec = _spec()
    refs = reference_tensors(spec, world)
    path = os.path.join(root, "iter_0000001")
    target = build_state(rank, world, tp=world, spec=spec, layout="alt", empty=True, references=refs, saved_tp=world)
    expected = build_state(rank, world, tp=world, spec=spec, layout="alt", references=refs, saved_tp=world)
    return {"mismatches": compare_loaded(dist_checkpointing.load(target, path), expected),
            "leftovers": sorted(n for n in os.listdir(root) if ".safe_ckpt-" in n)}


def read_only_target(rank, world, root) -> dict:
    spec = _spec()
    try:
        safe_ckpt.save(build_state(rank, world, tp=world, spec=spec), root, options=small_options())
        return {"error": None}
    except BaseException as exc:
        return {"error": describe_exception(exc)}


KILL = {"after_bytes": 20_000, "kill_signal": signal.SIGKILL}
STALL = {"after_bytes": 20_000, "stall_s": 15.0}  # well past the tests' 6 s timeout, which the survivor must hit
