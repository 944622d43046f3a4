"""The demo: save a Megatron-shaped state at N ranks, load it back with stock Megatron.

One job: show the whole path on any machine (CPU and gloo are enough): N processes
each build their shards of a seeded GPT-like state (TP-split weights, irregular
distributed-optimizer shards, objects, common state), `safe_ckpt.save` writes them as
one torch_dist checkpoint, and stock `megatron.core.dist_checkpointing.load` reads it
back under a different sharding; every tensor is compared bit for bit.
Must not: be imported by the library.
"""

from __future__ import annotations

import logging
import os
import queue as queue_mod
import shutil
import tempfile
import time

log = logging.getLogger("safe_ckpt.demo")


def _rank_main(rank: int, world_size: int, init_file: str, out_dir: str, size_mb: int, io_threads: int, results):
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(megatron|torch)\..*")
    import torch
    import torch.distributed as dist

    import safe_ckpt
    from megatron.core import dist_checkpointing
    from safe_ckpt import commit
    from safe_ckpt.synthetic import StateSpec, bits_equal, build_state, reference_tensors

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        spec = StateSpec.for_bytes(size_mb * 2**20)
        refs = reference_tensors(spec, world_size)
        state = build_state(rank, world_size, tp=world_size, spec=spec, references=refs)
        ckpt = os.path.join(out_dir, "iter_0000042")
        dist.barrier()
        result = safe_ckpt.save(state, ckpt, options=safe_ckpt.SaveOptions(io_threads=io_threads))
        if rank == 0:
            commit.write_tracker(out_dir, 42)
        del state

        # Stock Megatron load, with every TP-split weight split along a different axis
        # and the optimizer buckets cut at different points.
        t0 = time.perf_counter()
        target = build_state(rank, world_size, tp=world_size, spec=spec, layout="alt", empty=True,
                             references=refs, saved_tp=world_size)
        loaded = dist_checkpointing.load(target, ckpt)
        load_s = time.perf_counter() - t0
        expected = build_state(rank, world_size, tp=world_size, spec=spec, layout="alt", references=refs,
                               saved_tp=world_size)
        checked, bad = _compare(loaded, expected, bits_equal)
        results.put((rank, {
            "bytes": result.total_file_bytes, "save_s": result.timings.total_s, "load_s": load_s,
            "checked": checked, "bad": bad, "files": sorted(os.listdir(ckpt)),
            "residence": result.bytes_by_residence,
        }))
    except BaseException as exc:
        results.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))
        raise
    finally:
        dist.destroy_process_group()


def _compare(loaded, expected, bits_equal) -> tuple[int, list[str]]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    checked, bad = 0, []

    def walk(a, e, path):
        nonlocal checked
        if isinstance(e, dict):
            for k, v in e.items():
                if k in a:
                    walk(a[k], v, f"{path}.{k}")
        elif isinstance(e, list):
            for i, (x, y) in enumerate(zip(a, e)):
                walk(x, y, f"{path}[{i}]")
        elif isinstance(e, (ShardedTensor, ShardedTensorFactory)):
            checked += 1
            if not bits_equal(a, e.data):
                bad.append(path)
        elif isinstance(e, ShardedObject):
            checked += 1
            if a != e.data:
                bad.append(path)

    walk(loaded, expected, "")
    return checked, bad


def main(world_size: int = 2, size_mb: int = 384, out: str | None = None, keep: bool = False,
         io_threads: int = 4) -> int:
    import torch.multiprocessing as mp

    out_dir = out or tempfile.mkdtemp(prefix="safe_ckpt_demo_")
    os.makedirs(out_dir, exist_ok=True)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, init_file, out_dir, size_mb, io_threads, results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        per_rank = {}
        while len(per_rank) < world_size:
            try:
                rank, value = results.get(timeout=5)
                per_rank[rank] = value
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs):
                    break
        for p in procs:
            p.join()
    errors = {r: v["error"] for r, v in per_rank.items() if "error" in v}
    if errors or len(per_rank) < world_size:
        print(f"demo FAILED: {errors or 'a rank died'}")
        return 1
    r0 = per_rank[0]
    save_s = max(v["save_s"] for v in per_rank.values())
    checked = sum(v["checked"] for v in per_rank.values())
    bad = [b for v in per_rank.values() for b in v["bad"]]
    print(f"safe_ckpt demo: {world_size} ranks saved {r0['bytes'] / 1e6:.0f} MB of Megatron-shaped state "
          f"to {out_dir}/iter_0000042 in {save_s:.2f} s -> {r0['bytes'] / save_s / 1e9:.2f} GB/s")
    print(f"  files: {', '.join(r0['files'])}")
    print(f"  stock megatron.core.dist_checkpointing.load under a different sharding: {checked} tensors/objects, "
          f"{'all bit-exact' if not bad else f'{len(bad)} DIFFER: {bad[:5]}'} "
          f"(load {max(v['load_s'] for v in per_rank.values()):.2f} s)")
    if not keep and out is None:
        shutil.rmtree(out_dir, ignore_errors=True)
    return 0 if not bad else 1
