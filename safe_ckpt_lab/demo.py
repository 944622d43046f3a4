"""The demo: save a Megatron-shaped state at N ranks, load it back with stock Megatron,
and set the save's speed beside two measured in the same run on the same target.

One job: show the whole path on any machine (CPU and gloo are enough): N processes
each build their shards of a seeded GPT-like state (TP-split weights, irregular
distributed-optimizer shards, objects, common state), `safe_ckpt.save` writes them as
one torch_dist checkpoint, and stock `megatron.core.dist_checkpointing.load` reads it
back under a different sharding; every tensor is compared bit for bit. Beside each save,
in the same rounds (each round in another order): the target's write ceiling (each rank writes as many bytes as its
files hold, with as many threads, then fsyncs: `bench.ceilings.write_seconds`) and stock
DCP (`torch.distributed.checkpoint.save`) of the same tensors with as many threads.
Every figure is a median with its spread over the rounds, the target's filesystem is named,
and the line against DCP claims only what every round showed. The size asked for is the size
saved. Sizes are in MiB (2**20 bytes) everywhere, as in the README.
Must not: be imported by the library; leave anything in the target but the checkpoint
and its tracker file.
"""

from __future__ import annotations

import logging
import os
import queue as queue_mod
import shutil
import tempfile
import time

from safe_ckpt.names import TRACKER_FILE, iteration_dir

log = logging.getLogger("safe_ckpt.demo")

MiB = 1 << 20
ITERATION = 42


def _dcp_tensors(state: dict, rank: int) -> dict:
    """The tensors this rank's safe_ckpt save writes (main replicas, factories applied as
    Megatron applies them), keyed so that no two ranks' pieces share a key."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, is_main_replica

    out: dict = {}

    def walk(v):
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, ShardedTensorFactory):
            walk(v.build_fn(v.key, v.data, v.replica_id, getattr(v, "flattened_range", None)))
        elif isinstance(v, ShardedTensor) and is_main_replica(v.replica_id):
            out[f"{v.key}/{'.'.join(map(str, v.global_offset))}/rank{rank}"] = v.data

    walk(state)
    return out


def _rank_main(rank: int, world_size: int, init_file: str, out_dir: str, size_mb: int, io_threads: int,
               rounds: int, results):
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(megatron|torch)\..*")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import safe_ckpt
    from megatron.core import dist_checkpointing
    from safe_ckpt.targets.directory import root as dir_root
    from safe_ckpt_lab.bench import ceilings
    from safe_ckpt_lab.synthetic import StateSpec, bits_equal, build_state, reference_tensors

    # The demo prints its own summary; the library's per-save log lines would repeat it.
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        spec = StateSpec.for_saved_bytes(size_mb * MiB, tp=world_size)
        refs = reference_tensors(spec, world_size)
        state = build_state(rank, world_size, tp=world_size, spec=spec, references=refs)
        plain = _dcp_tensors(state, rank)
        ckpt = os.path.join(out_dir, iteration_dir(ITERATION))
        ceiling_dir = os.path.join(out_dir, f".demo_write_ceiling_rank{rank}")
        dcp_dir = os.path.join(out_dir, ".demo_dcp")
        options = safe_ckpt.SaveOptions(io_threads=io_threads)
        times: dict[str, list[float]] = {"safe_ckpt": [], "ceiling": [], "dcp": []}

        def timed(name, fn):
            """Seconds of ``fn`` on this rank, all ranks starting together; ``fn`` may
            return its own, narrower measurement (the ceiling leaves out its clean-up)."""
            dist.barrier()
            t0 = time.perf_counter()
            own = fn()
            times[name].append(own if own is not None else time.perf_counter() - t0)

        # Interleaved rounds, each measurement in another position each round: on a disk
        # whose writes slow down right after blocks were freed (a replaced checkpoint, a
        # removed DCP directory), whatever runs next would otherwise always pay for it.
        box: dict = {}

        def save_safe():
            box["result"] = safe_ckpt.save(state, ckpt, options=options)

        def after_safe():
            box["rank_bytes"] = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)
                                    if f.startswith(f"__{rank}_"))

        def before_ceiling():
            if "source" not in box:
                box["source"] = ceilings.source_buffer(box["rank_bytes"])
            os.makedirs(ceiling_dir, exist_ok=True)

        def write_ceiling():
            return ceilings.write_seconds(ceiling_dir, box["rank_bytes"], io_threads, reps=1, source=box["source"])

        def save_dcp():
            dcp.save(plain, storage_writer=dcp.FileSystemWriter(dcp_dir, thread_count=io_threads))

        def after_dcp():
            dist.barrier()
            if rank == 0:
                shutil.rmtree(dcp_dir, ignore_errors=True)

        steps = [("safe_ckpt", None, save_safe, after_safe),
                 ("ceiling", before_ceiling, write_ceiling, lambda: shutil.rmtree(ceiling_dir, ignore_errors=True)),
                 ("dcp", None, save_dcp, after_dcp)]
        for i in range(rounds):
            for name, before, fn, after in steps[i % 3:] + steps[:i % 3]:
                if before:
                    before()
                timed(name, fn)
                after()
        result, rank_bytes = box["result"], box["rank_bytes"]
        box.clear()
        if rank == 0:
            dir_root.write_tracker(out_dir, ITERATION)
        del state, plain

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
            "bytes": result.total_file_bytes, "rank_bytes": rank_bytes, "times": times, "load_s": load_s,
            "checked": checked, "bad": bad, "files": sorted(os.listdir(ckpt)),
        }))
    except BaseException as exc:
        results.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))
        raise
    finally:
        dist.destroy_process_group()


def _rank_quietly(*args) -> None:
    """A rank's process: an interrupt ends it without a traceback (the parent reports it once)."""
    try:
        _rank_main(*args)
    except KeyboardInterrupt:
        pass


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


def _rounds(per_rank: dict, name: str) -> list[float]:
    """Seconds of ``name`` in every round, a round lasting as long as its slowest rank."""
    rounds = len(next(iter(per_rank.values()))["times"][name])
    return [max(v["times"][name][i] for v in per_rank.values()) for i in range(rounds)]


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _spread(xs: list[float], fmt: str, unit: str = "") -> str:
    """``median unit (rounds: min-max unit)``, each number in ``fmt``; one round: the number alone."""
    if len(xs) == 1:
        return f"{format(xs[0], fmt)}{unit}"
    return f"{format(_median(xs), fmt)}{unit} (rounds: {format(min(xs), fmt)}-{format(max(xs), fmt)}{unit})"


def filesystem_line(path: str) -> str:
    """Name the filesystem a demo writes to, and what its ceiling therefore measures."""
    from .bench.machine import fs_type

    fs = fs_type(os.path.realpath(path))
    if fs in ("tmpfs", "ramfs"):
        kind = "memory: the write ceiling is a memory copy, no disk is involved"
    elif fs.startswith(("nfs", "cifs", "smb", "lustre", "fuse", "9p", "virtiofs")):
        kind = "a network or user-space filesystem"
    elif fs in ("?", "overlay"):
        kind = "whatever lies under it (disk or memory)"
    else:
        kind = "a disk-backed filesystem (--out DIR on a tmpfs such as /dev/shm measures memory instead)"
    return f"target: {path} on {fs}, {kind}"


def dcp_verdict(safe_s: list[float], dcp_s: list[float]) -> str:
    """What the rounds show about safe_ckpt against DCP: faster or slower only when it was so
    in every round (each round's pair measured back to back), else as fast."""
    ratios = [d / s for s, d in zip(safe_s, dcp_s)]
    if min(ratios) > 1:
        claim = "faster than stock DCP in every round"
    elif max(ratios) < 1:
        claim = "slower than stock DCP in every round"
    else:
        claim = "as fast as stock DCP, here (neither was faster in every round)"
    return f"safe_ckpt {claim}: DCP took {_spread(ratios, '.2f', 'x')} as long"


def ceiling_line(of_ceiling: list[float]) -> str:
    """The save's rate as a share of the write ceiling's, round by round; where a round passes
    100 %, why it can: the ceiling is a separate run, a reference rather than a bound."""
    line = (f"safe_ckpt at {_spread(of_ceiling, '.0f', ' %')} of the write ceiling (its MiB/s over the "
            f"ceiling's, each round against its own)")
    if max(of_ceiling) > 100:
        line += ("; over 100 %: the ceiling is a separate run of plain writes, and page-cache writeback and "
                 "other load move each run, so it is a reference, not a bound")
    return line


def noise_line(ceiling_s: list[float], limit: float = 1.5) -> str:
    """A warning when the target's own speed moved more than ``limit``x between rounds (a busy
    machine or a throttled disk): then a single ratio says little."""
    if len(ceiling_s) < 2 or max(ceiling_s) <= limit * min(ceiling_s):
        return ""
    return (f"the target's own speed varied {max(ceiling_s) / min(ceiling_s):.1f}x between rounds (write ceiling "
            f"{min(ceiling_s):.2f}-{max(ceiling_s):.2f} s): the machine or its disk was busy, so read the ranges, "
            "not the medians; more rounds or a quieter machine narrow them")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def dispose(out_dir: str, keep: bool) -> str:
    """Keep the demo's checkpoint or remove its directory; the line that says which."""
    ckpt = os.path.join(out_dir, iteration_dir(ITERATION))
    if keep:
        return (f"checkpoint kept: {ckpt} (tracker {os.path.join(out_dir, TRACKER_FILE)}); "
                f"check it with: safe-ckpt verify {ckpt}")
    shutil.rmtree(out_dir, ignore_errors=True)
    return f"checkpoint removed with its temporary directory {out_dir}; pass --keep (or --out DIR) to keep it"


def _stop(procs, grace_s: float = 10.0) -> None:
    """Stop the rank processes (SIGTERM, then SIGKILL past ``grace_s``) and reap them."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def main(world_size: int = 2, size_mb: int = 384, out: str | None = None, keep: bool = False,
         io_threads: int = 4, rounds: int = 5) -> int:
    import torch.multiprocessing as mp

    out_dir = os.path.abspath(out or tempfile.mkdtemp(prefix="safe_ckpt_demo_"))
    os.makedirs(out_dir, exist_ok=True)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_quietly,
                             args=(r, world_size, init_file, out_dir, size_mb, io_threads, rounds, results))
                 for r in range(world_size)]
        try:
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
        except BaseException:  # an interrupt: the ranks go too, and a temporary directory with them
            _stop(procs)
            if out is None and not keep:
                shutil.rmtree(out_dir, ignore_errors=True)
            raise
    errors = {r: v["error"] for r, v in per_rank.items() if "error" in v}
    if errors or len(per_rank) < world_size:
        print(f"demo FAILED: {errors or 'a rank died'}")
        return 1
    r0 = per_rank[0]
    ckpt = os.path.join(out_dir, iteration_dir(ITERATION))
    mib = r0["bytes"] / MiB
    safe_s, ceil_s, dcp_s = (_rounds(per_rank, n) for n in ("safe_ckpt", "ceiling", "dcp"))
    ceil_mib = sum(v["rank_bytes"] // io_threads * io_threads for v in per_rank.values()) / MiB
    of_ceiling = [100 * (mib / s) / (ceil_mib / c) for s, c in zip(safe_s, ceil_s)]
    checked = sum(v["checked"] for v in per_rank.values())
    bad = [b for v in per_rank.values() for b in v["bad"]]
    print(f"safe_ckpt demo: {_plural(world_size, 'rank')} saved {mib:.1f} MiB of Megatron-shaped state "
          f"(TP-split weights, distributed-optimizer shards, objects) to {ckpt}")
    print(f"  {filesystem_line(out_dir)}")
    print(f"  measured in this run on the same target, {_plural(io_threads, 'writer thread')} a rank, "
          f"{_plural(rounds, 'interleaved round')}: medians, and the fastest and slowest round")
    for label, mb, xs in (("safe_ckpt.save", mib, safe_s), ("write ceiling (same bytes, pwrite + fsync)", ceil_mib, ceil_s),
                          ("stock DCP save of the same tensors", mib, dcp_s)):
        print(f"    {label:<44} {mb / _median(xs):8.1f} MiB/s  {_spread(xs, '.2f', ' s')}")
    print(f"  {ceiling_line(of_ceiling)}")
    print(f"  {dcp_verdict(safe_s, dcp_s)}")
    if noisy := noise_line(ceil_s):
        print(f"  {noisy}")
    print(f"  files: {', '.join(r0['files'])}")
    print(f"  stock megatron.core.dist_checkpointing.load under a different sharding: {checked} tensors/objects, "
          f"{'all bit-exact' if not bad else f'{len(bad)} DIFFER: {bad[:5]}'} "
          f"(load {max(v['load_s'] for v in per_rank.values()):.2f} s)")
    print(dispose(out_dir, keep=keep or out is not None))
    return 0 if not bad else 1
