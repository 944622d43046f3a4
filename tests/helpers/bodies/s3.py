"""Bodies of the multi-process S3 tests (see tests/targets/test_s3_object_store.py); each runs on every rank of a gloo world.

They return plain data (mismatches, error descriptions, measured seconds) for the parent to assert on.
"""

from __future__ import annotations

import os
import signal
import time

import torch

import safe_ckpt
from safe_ckpt_lab.synthetic import StateSpec, bits_equal, build_state, reference_tensors
from tests.helpers.bodies.common import SMALL, compare_common, compare_loaded, load_whole_with_dcp, small_options
from tests.helpers.hooked_sinks import OnFirstLanded
from tests.helpers.mp import describe_exception


def _state(rank, world, spec=None, refs=None):
    spec = spec or StateSpec(**SMALL)
    refs = refs if refs is not None else reference_tensors(spec, 1)
    return build_state(rank, world, tp=1, spec=spec, references=refs)


def s3_roundtrip(rank, world, bucket_spec, prefix, local_dir) -> dict:
    """Save at ``world`` ranks into the bucket, download, load with stock Megatron and DCP."""
    from megatron.core import dist_checkpointing

    from safe_ckpt.tools.copy import copy

    spec = StateSpec(**SMALL)
    refs = reference_tensors(spec, 2)
    state = build_state(rank, world, tp=1, spec=spec, references=refs)
    t0 = time.perf_counter()
    result = safe_ckpt.save(state, prefix, options=small_options(kvstore_spec=bucket_spec))
    save_s = time.perf_counter() - t0
    saved_common = {k: state[k] for k in ("iteration", "checkpoint_version", "args")}
    if rank == 0:
        copy(prefix, local_dir, src_spec=bucket_spec)
    torch.distributed.barrier()
    target = build_state(rank, world, tp=2, spec=spec, layout="alt", empty=True, references=refs, saved_tp=1)
    expected = build_state(rank, world, tp=2, spec=spec, layout="alt", references=refs, saved_tp=1)
    loaded = dist_checkpointing.load(target, local_dir)
    mismatches = compare_loaded(loaded, expected) + compare_common(loaded, saved_common)
    whole = load_whole_with_dcp(local_dir)
    saved_keys = set(reference_tensors(spec, 1))
    if set(whole) != saved_keys:
        mismatches.append(f"DCP keys differ: {sorted(set(whole) ^ saved_keys)}")
    mismatches += [f"DCP whole tensor {k} differs" for k in saved_keys & set(whole) if not bits_equal(whole[k], refs[k])]
    return {"mismatches": mismatches, "save_s": save_s, "files": sorted(os.listdir(local_dir)),
            "total_file_bytes": result.total_file_bytes}


def _usable(rank, world, after_dir) -> bool:
    """The process still saves (the failed save's threads and sinks do not stand in the way)."""
    safe_ckpt.save(_state(rank, world), after_dir, options=small_options())
    return os.path.isfile(os.path.join(after_dir, "metadata.json"))


def s3_failing_store(rank, world, bucket_spec, prefix, options_kwargs, kill_pid, after_dir) -> dict:
    """A save to a store that is unreachable (``kill_pid`` None) or whose server is killed
    once this rank's first data object landed; every rank must raise the same error in time."""
    gate = {}

    def factory(inner):
        gate["sink"] = OnFirstLanded(inner, lambda: _kill(kill_pid))
        return gate["sink"]

    opts = small_options(kvstore_spec=bucket_spec, sink_factory=factory if kill_pid else None, **options_kwargs)
    # A warm process, as in training: imports and the gloo group are in place before the clock starts.
    safe_ckpt.save(_state(rank, world), after_dir + "-warm", options=small_options())
    out = {"error": None}
    t0 = time.monotonic()
    try:
        safe_ckpt.save(_state(rank, world), prefix, options=opts)
    except BaseException as exc:
        out["error"] = describe_exception(exc)
    out["elapsed_s"] = time.monotonic() - t0
    out["small_files_written"] = gate["sink"].small_files if "sink" in gate else []
    out["first_landed"] = gate["sink"].fired.is_set() if "sink" in gate else False
    out["usable_after"] = _usable(rank, world, after_dir)
    return out


def _kill(pid) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # the other rank killed it first
        pass


def s3_rank_dies(rank, world, bucket_spec, prefix) -> dict:
    """Rank 0 dies (SIGKILL) once its first data object landed: a killed save of ``prefix``."""
    def factory(inner):
        return OnFirstLanded(inner, lambda: os.kill(os.getpid(), signal.SIGKILL)) if rank == 0 else inner

    opts = small_options(kvstore_spec=bucket_spec, sink_factory=factory, collective_timeout_s=20)
    try:
        safe_ckpt.save(_state(rank, world), prefix, options=opts)
        return {"error": None}
    except BaseException as exc:
        return {"error": describe_exception(exc)}


def s3_save(rank, world, bucket_spec, prefix, seed_spec=None) -> dict:
    """A plain save of the small state (``seed_spec``: StateSpec kwargs, for other values)."""
    spec = StateSpec(**(seed_spec or SMALL))
    result = safe_ckpt.save(_state(rank, world, spec, reference_tensors(spec, 1)), prefix,
                            options=small_options(kvstore_spec=bucket_spec))
    return {"files": result.files}


def expected_whole(seed_spec=None) -> dict:
    spec = StateSpec(**(seed_spec or SMALL))
    return reference_tensors(spec, 1)


class AmbiguousMarker:
    """The real kvstore sink, except that the commit's last write (`metadata.json`) is not confirmed:
    ``landed``: it reaches the store, then the client reports a timeout (the usual ambiguous S3 failure);
    ``unknown``: the same, and reading it back times out too; ``lost``: the timeout comes before it
    reaches the store."""

    def __init__(self, inner, mode: str) -> None:
        self.inner, self.mode, self.root = inner, mode, inner.root

    def __getattr__(self, name):  # open, list, delete, one_item_per_file, ...
        return getattr(self.inner, name)

    def _timeout(self, name):
        from safe_ckpt.errors import WriteError

        return WriteError(f"{self.root}{name}: the store did not answer within 5.0 s (injected)")

    def write_file(self, relative_path, data):
        if relative_path != "metadata.json":
            return self.inner.write_file(relative_path, data)
        if self.mode in ("landed", "unknown"):
            self.inner.write_file(relative_path, data)
        raise self._timeout(relative_path)

    def read(self, relative_path):
        if self.mode == "unknown" and relative_path == "metadata.json":
            raise self._timeout(relative_path)
        return self.inner.read(relative_path)


AMBIGUOUS_MODES = {2: "landed", 3: "unknown", 4: "lost"}  # iteration -> how its last write fails on rank 0


def seeded(iteration: int) -> dict:
    return {**SMALL, "seed": 1000 + iteration}


def s3_ambiguous_commits(rank, world, bucket_spec) -> dict:
    """Iteration 1 saved cleanly through the Megatron adapter, then iterations 2-4 with rank 0's
    last commit write made ambiguous (`AMBIGUOUS_MODES`)."""
    from safe_ckpt.megatron import save_state

    out = {}
    for iteration in (1, *AMBIGUOUS_MODES):
        mode = AMBIGUOUS_MODES.get(iteration)
        spec = StateSpec(**seeded(iteration))
        factory = (lambda inner, mode=mode: AmbiguousMarker(inner, mode)) if rank == 0 and mode else None
        try:
            save_state(_state(rank, world, spec, reference_tensors(spec, 1)), "run", f"run/iter_{iteration:07d}",
                       str(iteration), options=small_options(kvstore_spec=bucket_spec, sink_factory=factory))
            out[iteration] = None
        except BaseException as exc:
            out[iteration] = describe_exception(exc)
        torch.distributed.barrier()
    return out
