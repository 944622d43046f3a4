"""CPU benchmark: where one `safe_ckpt.load` spends its fixed time (what does not shrink with more threads).

Saves the `qwen3-4b-dp8` rank (1217 shards; ``--gib`` shrinks the shards, not their number) once
into ``--target``, then, ``--reps`` rounds in one process, times each step of a load on its own
and whole loads (with and without checksums), in turn within a round so drifts hit all alike:
- ``config``: `metadata.json`; ``metadata_bytes``: reading `.metadata`; ``unpickle``: the
  restricted unpickler; ``check``: the field checks after it; ``tables``: the per-key lookups
  the planner uses; ``manifest``: the checksum manifest; ``common``: the common state;
- ``megatron``: megatron-core's steps before the read (preprocess, the data-less copies, the
  one-process validation); ``plan``: the rank's read plan (file sizes included);
- ``reads``: the reader threads alone; ``load``/``load_nosum``: `safe_ckpt.load` end to end.
Each step runs with the collector held off the heap, as a load runs. Every whole load is compared bit for bit with the saved tensors. Prints medians [min-max] in ms.
Usage: python benchmarks/diag/load_steps.py --target /dev/shm/ls [--gib 0.05] [--reps 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import torch


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="directory the checkpoint is saved into (removed after)")
    p.add_argument("--gib", type=float, default=0.05)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep", action="store_true", help="keep (and reuse) the checkpoint in --target")
    args = p.parse_args()

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.utils import extract_sharded_base, force_all_tensors_to_non_fp8
    from megatron.core.dist_checkpointing.validation import StrictHandling, validate_integrity_and_strict_load

    import safe_ckpt
    from safe_ckpt.encoding import safe_read
    from safe_ckpt.encoding.safe_read.budget import WorkBudget
    from safe_ckpt.host import gcfreeze
    from safe_ckpt.loading import index as index_mod, objects, plan
    from safe_ckpt.loading.execute import Reader
    from safe_ckpt.loading.source import DirectorySource
    from safe_ckpt.names import METADATA_FILE
    from safe_ckpt.staging.pool import shared_pool
    from safe_ckpt_lab.bench.state import build

    state = build("qwen3-4b-dp8", args.gib, "gpu", 0, 1, seed=0, keep_shards=True)
    path = os.path.join(args.target, "ckpt")
    if not (args.keep and os.path.exists(os.path.join(path, METADATA_FILE))):
        shutil.rmtree(path, ignore_errors=True)
        safe_ckpt.save(state.make_sharded(), path, options=safe_ckpt.SaveOptions(io_threads=args.threads))
    originals = {k: v.data for k, v in state.make_sharded().items() if isinstance(v, ShardedTensor)}
    templates = {k: torch.empty_like(t) for k, t in originals.items()}

    def sharded() -> dict:
        out = state.make_sharded()
        for k, v in out.items():
            if isinstance(v, ShardedTensor):
                v.data = templates[k]
        return out

    def check() -> None:
        bad = [k for k in originals if not torch.equal(templates[k].view(torch.uint8), originals[k].view(torch.uint8))]
        if bad:
            raise SystemExit(f"{len(bad)} tensors differ from what was saved, e.g. {bad[0]}")
        for t in templates.values():
            t.view(torch.uint8).fill_(0xA5)

    src = DirectorySource(path)
    where = src.describe(METADATA_FILE)
    data = src.read_whole(METADATA_FILE, safe_read.MAX_METADATA_BYTES)
    meta = safe_read.metadata_from_bytes(data, where)
    index = index_mod.read_index(src)
    pool = shared_pool(256 << 20)

    def megatron() -> list:
        sd = sharded()
        force_all_tensors_to_non_fp8(sd)
        sh, _, _ = load_preprocess(sd)
        sh, _ = extract_sharded_base(sh)
        local = [x.without_data() for x in nested_values(sh)]
        validate_integrity_and_strict_load(sh, StrictHandling.ASSUME_OK_UNEXPECTED, False, local, None, None)
        return [x for x in nested_values(sh) if isinstance(x, ShardedTensor)]

    def planned():
        s = DirectorySource(path)
        built, problems = plan.build(megatron(), index, s, rank=0, batch_bytes=safe_ckpt.LoadOptions.batch_bytes,
                                     piece_bytes=8 << 20, checksums=True)
        assert not problems, problems
        return s, built

    def plan_only():
        tensors = megatron()
        s = DirectorySource(path)
        t0 = time.perf_counter()
        plan.build(tensors, index, s, rank=0, batch_bytes=safe_ckpt.LoadOptions.batch_bytes, piece_bytes=8 << 20,
                   checksums=True)
        dt = time.perf_counter() - t0
        s.close()
        return dt

    def reads_only():
        s, built = planned()
        r = Reader(s, built, rank=0, threads=args.threads, piece_bytes=8 << 20, pool=lambda: pool,
                   algorithm=index.checksum_algorithm, timeout_s=60)
        t0 = time.perf_counter()
        _, failure = r.run()
        dt = time.perf_counter() - t0
        s.close()
        assert failure is None, failure
        check()
        return dt

    def fresh(fn):
        def run():
            s = DirectorySource(path)
            try:
                return _timed(lambda: fn(s))
            finally:
                s.close()
        return run

    def load(verify: bool):
        def run():
            opts = safe_ckpt.LoadOptions(io_threads=args.threads, verify_checksums=verify)
            dt = _timed(lambda: safe_ckpt.load(sharded(), path, opts))
            check()
            return dt
        return run

    steps = {
        "config": fresh(index_mod.read_config),
        "metadata_bytes": fresh(lambda s: s.read_whole(METADATA_FILE, safe_read.MAX_METADATA_BYTES)),
        "unpickle": lambda: _timed(lambda: safe_read.MetadataUnpickler(data, where, WorkBudget(where, len(data))).load()),
        "check": lambda: _timed(lambda: safe_read._check_shape(meta, where, WorkBudget(where, len(data)))),
        "tables": lambda: _timed(lambda: index_mod._tensors_and_objects(meta, where)),
        "manifest": fresh(index_mod.read_manifest),
        "common": fresh(lambda s: objects.read_common_state(s, index)),
        "megatron": lambda: _timed(megatron),
        "plan": plan_only,
        "reads": reads_only,
        "load_nosum": load(False),
        "load": load(True),
    }
    times: dict = {k: [] for k in steps}
    for name, fn in steps.items():  # one warm-up round
        fn()
    for _ in range(args.reps):
        for name, fn in steps.items():
            hold = gcfreeze.Hold(True)  # as a load holds the collector off the heap
            try:
                times[name].append(fn())
            finally:
                hold.release()
    print(f"{state.description}; {args.threads} threads; {args.reps} rounds; .metadata {len(data)} bytes; "
          f"ms: median [min-max]")
    for name, xs in times.items():
        xs = [x * 1e3 for x in xs]
        print(f"  {name:15s} {statistics.median(xs):8.2f} [{min(xs):.2f}-{max(xs):.2f}]")
    if not args.keep:
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
