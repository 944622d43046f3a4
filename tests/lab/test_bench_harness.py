"""The benchmark harness runs end to end at a small size on CPU (the CI smoke test)."""

import json
import statistics
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO


@pytest.mark.slow  # the whole bench command (~20 s); its parts are tested in the default run
def test_bench_harness_smoke(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "safe_ckpt_lab.bench", "--gib", "0.03", "--reps", "2", "--peer-reps", "1",
           "--targets", str(tmp_path / "target"), "--cache", "cold,warm", "--peer-cache", "cold",
           "--peers", "safe_sync,safe_async,dcp_sync,megatron_sync,safe_sync_nosum", "--ceiling-each-rep",
           "--ceiling-beside-d2h",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {(s["peer"], s["cache"]): s for s in report["summary"]}
    for peer in ("safe_sync", "safe_async"):
        for cache in ("cold", "warm"):
            s = rows[(peer, cache)]
            assert s["runs"] == 2 and s["total_s"] > 0 and s["gbps"] > 0 and s["stall_s"] <= s["total_s"] + 1e-6
            assert s["plan_s"] > 0 and s["write_s"] > 0 and s["commit_s"] > 0
    for r in report["rows"]:  # each row's breakdown is of that save: the parts fit inside its time
        if r["peer"].startswith("safe"):
            assert r["plan_s"] + r["write_s"] + r["commit_s"] <= r["total_s"] + 2e-3, r
    assert rows[("safe_sync_nosum", "cold")]["runs"] == 2
    assert rows[("dcp_sync", "cold")]["runs"] == 1 and ("dcp_sync", "warm") not in rows
    assert "vs_best_peer" in rows[("safe_sync", "cold")]
    assert report["meta"]["ceilings"][f"write_gbps[{tmp_path / 'target'}]"] > 0
    assert len(report["meta"]["write_samples_gbps"][str(tmp_path / "target")]) == 2 * 2  # a run per round
    assert rows[("safe_sync", "cold")]["vs_write_ceiling_median"] > 0
    megatron = rows[("megatron_sync", "cold")]
    import torch

    if not torch.cuda.is_available():
        assert "needs CUDA" in megatron["error"]
    md = (tmp_path / "bench.md").read_text()
    assert "| safe_sync |" in md and "| plan s | write s | commit s |" in md
    sync = rows[("safe_sync", "cold")]  # both ceilings side by side in the row's cell
    target = str(tmp_path / "target")  # each save beside the ceiling measured just before its round
    rounds = report["meta"]["write_sample_rounds"][target]
    assert rounds == ["gpu|cold|0", "gpu|cold|1", "gpu|warm|0", "gpu|warm|1"]
    ceiling_of = dict(zip(rounds, report["meta"]["write_samples_gbps"][target]))
    mine = [r for r in report["rows"] if r["peer"] == "safe_sync" and r["cache"] == "cold"]
    assert sync["vs_write_ceiling_paired"] == pytest.approx(statistics.median(
        r["bytes"] / r["total_s"] / 1e9 / ceiling_of[f"gpu|cold|{r['rep']}"] for r in mine))
    assert (f"| {sync['vs_write_ceiling']:.0%} ({sync['vs_write_ceiling_median']:.0%}; "
            f"paired {sync['vs_write_ceiling_paired']:.0%}) |") in md
    beside = f"write_beside_d2h_gbps[gpu {tmp_path / 'target'}]"
    if not torch.cuda.is_available():  # a host state has no device bytes to copy beside the writes
        assert beside not in report["meta"]["ceilings"] and "vs_write_beside_d2h" not in sync
        assert report["meta"]["ceiling_notes"][beside] == "not measured: no GPU bytes in this state"
        assert f"{beside}: not measured" in md
    else:
        assert report["meta"]["ceilings"][beside] > 0 and sync["vs_write_beside_d2h"] > 0
    assert "| vs write beside D2H |" in md
    for peer in ("safe_sync", "safe_async"):  # one more save each, loaded back by stock Megatron, bit for bit
        v = report["meta"]["verified"][f"{peer} gpu {tmp_path / 'target'}"]
        assert v == {**v, "tensors": 20, "objects": 2, "ranks": 1} and "failed" not in v
        assert f"Loaded back with stock Megatron, {peer} gpu {tmp_path / 'target'}: 20 tensors and 2 objects bit-exact" in md
    assert not any("nosum" in k for k in report["meta"]["verified"])  # only the peers --verify names
    # a run cut short keeps its rows and meta: the report can be rebuilt from them alone
    (tmp_path / "bench.md").unlink()
    proc = subprocess.run([sys.executable, "-m", "safe_ckpt_lab.bench", "--rebuild", str(out)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rebuilt = (tmp_path / "bench.md").read_text()
    assert "rebuilt from" in rebuilt and rebuilt.count("| safe_sync |") == md.count("| safe_sync |")
    assert rebuilt.count("bit-exact over 1 rank(s)") == 2


def _multi_rank(tmp_path, launcher_cmd, world=2, threads="2"):
    out = tmp_path / "bench"
    cmd = [*launcher_cmd, "--gib", "0.02", "--reps", "1", "--threads", threads, "--targets", str(tmp_path / "t"),
           "--peers", "safe_sync,safe_async,dcp_sync", "--ceiling-beside-d2h", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["meta"]["world_size"] == world
    import torch

    if not torch.cuda.is_available():  # every rank took the same way past the combined ceiling
        assert report["meta"]["ceiling_notes"][f"write_beside_d2h_gbps[gpu {tmp_path / 't'}]"].startswith("not measured")
    rows = {s["peer"]: s for s in report["summary"]}
    assert rows["safe_sync"]["runs"] == 1 and rows["safe_sync"]["total_s"] > 0
    for peer in ("safe_sync", "safe_async"):  # every rank loaded its own shard back bit-exact
        v = report["meta"]["verified"][f"{peer} gpu {tmp_path / 't'}"]
        assert (v["tensors"], v["objects"], v["ranks"]) == (world * 20, world * 2, world) and "failed" not in v, v
    for r in report["rows"]:  # every rank's own figures, beside the slowest rank's
        assert len(r["by_rank"]["stall_s"]) == world and max(r["by_rank"]["total_s"]) == r["total_s"]
    return report


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_bench_ranks_of_one_host_with_torchrun_on_library_defaults(tmp_path, world):
    """N ranks of one host on the library's per-host defaults (--threads 0): each rank's resolved
    writers and pool recorded, the pool allocated at that size before the timed saves (none
    of them allocates it again), the stock peers and the ceiling on the rank's share of the
    cores, and the goals in the report."""
    import os

    report = _multi_rank(tmp_path, [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                                    "-m", "safe_ckpt_lab.bench"], world, threads="0")
    meta = report["meta"]
    assert meta["launcher"] == "torchrun" and meta["ranks_on_host"] == world and meta["safe_defaults"]
    cores = len(os.sched_getaffinity(0))
    assert meta["peer_threads"] == max(1, cores // world)
    opts = meta["safe_options"]["gpu"]
    assert opts["io_threads"] == [max(1, min(16, cores // world))] * world  # the library's rule, per rank
    assert all(b > 0 for b in opts["staging_budget_bytes"]) and len(opts["checksum_threads"]) == world
    for r in report["rows"]:
        if r["peer"].startswith("safe"):
            assert r["by_rank"]["staging_budget_bytes"] == opts["staging_budget_bytes"]
            assert r["by_rank"]["pool_allocations"] == [0] * world
    safe = {s["peer"]: s for s in report["summary"]}["safe_async"]
    assert safe["pool_bytes_by_rank"] == opts["staging_budget_bytes"] and len(safe["stall_s_by_rank"]) == world
    assert {g["goal"] for g in report["goals"] if g["peer"] == "safe_async"} >= {
        "async stall per rank", "peak extra host memory per rank"}
    md = (tmp_path / "bench.md").read_text()
    assert f"Goals, {world} rank(s)" in md and "safe_ckpt by rank, gpu: io_threads" in md
    assert meta["budget_gib"] is None and "(library default), staging pool MiB" in md
    assert "(library default), checksum_threads" in md


@pytest.mark.slow
def test_bench_two_ranks_with_torchrun(tmp_path):
    report = _multi_rank(tmp_path, [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                    "-m", "safe_ckpt_lab.bench"])
    assert report["meta"]["launcher"] == "torchrun"
    assert report["meta"]["safe_options"]["gpu"]["io_threads"] == [2, 2] and report["meta"]["peer_threads"] == 2


@pytest.mark.slow
def test_bench_two_ray_actors(tmp_path):
    pytest.importorskip("ray")
    report = _multi_rank(tmp_path, [sys.executable, "-m", "safe_ckpt_lab.bench", "--ray-actors", "2"])
    assert report["meta"]["launcher"] == "ray"


def test_item_overhead_benchmark_smoke(tmp_path):
    """benchmarks/diag/item_overhead.py runs at a small size, checks its first save bit for bit
    through stock DCP, and reports every saver."""
    import os

    script = os.path.join(REPO, "benchmarks", "diag", "item_overhead.py")
    cmd = [sys.executable, script, "--items", "40", "--reps", "1", "--distinct", "--target", str(tmp_path / "t"),
           "--out", str(tmp_path / "items")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "items.json").read_text())
    assert [r["saver"] for r in report["rows"]] == ["safe_ckpt", "dcp", "ceiling"]
    assert report["meta"]["items"] == 40 and report["meta"]["bytes"] > 40 * 4096 * 4
    assert all(r["median_s"] > 0 for r in report["rows"])
    assert "| safe_ckpt |" in (tmp_path / "items.md").read_text()


def test_plan_exchange_benchmark_times_every_phase_on_two_ranks():
    """benchmarks/plan_exchange.py plans the qwen3-4b-dp8 layout on two gloo ranks through the
    real `saving.start` twice in each process: every phase it wraps is timed, and the second
    save's start is not held by the first (its slot and gc hold released)."""
    import os

    script = os.path.join(REPO, "benchmarks", "plan_exchange.py")
    env = {**os.environ, "PYTHONPATH": REPO}
    # a save that still held the slot would stop the next one after 30 s, not hang
    proc = subprocess.run([sys.executable, script, "--ranks", "2", "--reps", "2", "--io-threads", "2",
                           "--collective-timeout-s", "30", "--store", "tcp", "--sample-ms", "2"],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    out = json.loads(proc.stdout)
    slowest = out["slowest_rank_median_s"]
    for phase in ("collect", "classify", "exchange", "build_global_plan", "lay_out_rank"):
        assert slowest[phase] > 0 and slowest[phase + "_cpu"] > 0, phase
    assert slowest["plan_s"] >= slowest["exchange"] and slowest["index_s"] > 0
    ranks = out["per_rank"]
    assert [r["shards"] for r in ranks] == [1217, 1217] and all(r["chunks"] >= 1217 for r in ranks)
    assert all(r["reps"] == 1 for r in ranks) and ranks[0]["message_bytes"] > 0
    arrivals = out["exchange_arrivals"]
    assert len(arrivals["arrival_spread_s"]) == 1 and 0 <= arrivals["after_last_arrival_s"][0] <= slowest["exchange"] + 1e-3
    assert all(r["samples"]["top"] for r in ranks) and all(len(r["by_rep"]["gc_s"]) == 1 for r in ranks)
    assert "gc_full_passes" in slowest and "exchange_process_cpu" in slowest


def test_gather_probe_runs_every_case_on_two_ranks():
    """benchmarks/diag/gather_probe.py times torch's object gather on the default and a second
    gloo group and safe_ckpt's own, for every size, checking each gathered payload."""
    import os

    script = os.path.join(REPO, "benchmarks", "diag", "gather_probe.py")
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, script, "--ranks", "2", "--reps", "2"], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    got = json.loads(proc.stdout)["runs"]["2ranks"]["slowest_rank_median"]
    assert "errors" not in got, got
    for case in ("all_gather_object_default_group", "all_gather_object_new_group", "safe_ckpt_gather_new_group"):
        for size in (8, 80 << 10, 800 << 10):
            assert got[f"{case}_{size}B_s"] > 0 and got[f"{case}_{size}B_other_threads_cpu_s"] >= 0


def test_gil_handoffs_benchmark_smoke(tmp_path):
    """benchmarks/diag/gil_handoffs.py runs at a small size and reports every case, with and
    without writers, the writers at their priority and 5 nicer, and cleans its files up."""
    import os

    script = os.path.join(REPO, "benchmarks", "diag", "gil_handoffs.py")
    target = tmp_path / "gil"
    cmd = [sys.executable, script, "--writers", "2", "--piece-mib", "1", "--chunks", "4", "--calls", "3",
           "--rounds", "1", "--target", str(target)]
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if '"case"' in line]
    assert {(r["case"], r["writers"], r["writer_nice"]) for r in rows} == {
        (k, w, n) for k in ("release", "hold", "torch", "python") for w, n in ((0, 0), (2, 0), (2, 5))}
    assert all(r["us_per_chunk_median"] > 0 for r in rows)
    assert not target.exists()


def test_write_ceiling_beside_a_copy(tmp_path):
    """The ceiling with a copy beside it runs the copy once per run, at the same time as the
    writes, keeps the fastest run, leaves no files and raises the copy's failure."""
    import threading

    import torch

    from safe_ckpt_lab.bench import ceilings

    src = torch.empty(64 << 20, dtype=torch.uint8).random_(generator=torch.Generator().manual_seed(2))
    dst = torch.empty_like(src)
    writing, seen = threading.Event(), []

    def copy():
        seen.append(writing.wait(10))  # the writers have started by the time the copy ends
        dst.copy_(src)

    real_lanes = ceilings.run_lanes

    def lanes(work, threads):
        writing.set()
        try:
            return real_lanes(work, threads)
        finally:
            writing.clear()

    ceilings.run_lanes = lanes
    try:
        best = ceilings.write_beside_copy(str(tmp_path / "t"), 32 << 20, 4, copy, reps=3)
    finally:
        ceilings.run_lanes = real_lanes
    assert seen == [True, True, True] and torch.equal(src, dst)
    assert best.write_s > 0 and best.copy_s > 0 and best.seconds == max(best.write_s, best.copy_s)
    assert not any((tmp_path / "t").iterdir())

    def broken():
        raise OSError("no pinned memory")

    with pytest.raises(RuntimeError, match="no pinned memory"):
        ceilings.write_beside_copy(str(tmp_path / "t"), 8 << 20, 2, broken, reps=1)
    assert ceilings.device_to_host_copier([src, "not a tensor"]) is None  # nothing on a GPU: nothing to copy


def _beside_on_ranks(rank, world, target, fail_rank, fail_at):
    """The bench's combined ceiling on a real gloo world, a host copy standing for the device
    one (the GPU suite's bench part runs the real one); ``fail_at`` "alloc" or "copy" on one
    rank, or "nogpu": that rank has no GPU bytes and only writes."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from safe_ckpt_lab.bench import ceilings, run

    src = torch.empty(4 << 20, dtype=torch.uint8).random_(generator=torch.Generator().manual_seed(rank))
    dst = torch.empty_like(src)
    closed = []

    class HostCopy:
        def __call__(self):
            if rank == fail_rank and fail_at == "copy":
                raise OSError("copy broke")
            dst.copy_(src)

        def close(self):
            closed.append(True)

    def copier(tensors):
        if rank == fail_rank and fail_at == "alloc":
            raise RuntimeError("no pinned memory")
        return None if rank == fail_rank and fail_at == "nogpu" else HostCopy()

    ceilings.device_to_host_copier = copier
    meta = {"ceilings": {}, "ceiling_threads": {target: 2}}
    key = "write_beside_d2h_gbps[gpu t]"
    run._ceiling_beside_d2h(key, target, SimpleNamespace(plain={}, nbytes=8 << 20, device_bytes=4 << 20), meta,
                            None, rank, world, dist.new_group(backend="gloo"))
    return {"gbps": meta["ceilings"].get(key), "note": meta.get("ceiling_notes", {}).get(key),
            "copied": torch.equal(src, dst), "closed": closed == [True]}


@pytest.mark.parametrize("fail_rank,fail_at", [(None, None), (1, "alloc"), (0, "copy"), (1, "nogpu")])
def test_combined_ceiling_on_two_ranks_fails_together(tmp_path, fail_rank, fail_at):
    from tests.helpers.mp import run_world

    results = run_world(2, _beside_on_ranks, (str(tmp_path), fail_rank, fail_at), timeout_s=120)
    assert [status for status, _ in results] == ["ok", "ok"], results
    values = [v for _, v in results]
    if fail_at in (None, "nogpu"):  # a rank without GPU bytes writes beside the others' copies
        assert all(v["gbps"] > 0 and v["note"] is None for v in values), values
        assert [v["copied"] for v in values] == [fail_rank != r for r in range(2)]
        assert [v["closed"] for v in values] == [fail_rank != r for r in range(2)]
        return
    assert all(v["gbps"] is None for v in values)  # nobody reports a ceiling one rank could not measure
    reason = {"alloc": "RuntimeError: no pinned memory", "copy": "RuntimeError: the copy beside"}[fail_at]
    assert all(v["note"].startswith(f"failed on rank {fail_rank}: {reason}") for v in values), values
    assert all(v["closed"] for r, v in enumerate(values) if not (fail_at == "alloc" and r == fail_rank))


def _verify_on_ranks(rank, world, target, fail_rank):
    """The bench's round trip on a real gloo world, one rank (``fail_rank``) failing alone
    after the save and before the load, as a host running out of memory for the buffers would."""
    import os
    from types import SimpleNamespace

    import torch.distributed as dist

    from safe_ckpt_lab.bench import run, verify
    from safe_ckpt_lab.bench.state import build

    real = verify._empty_like_sharded

    def buffers(sharded):
        if rank == fail_rank:
            raise RuntimeError("no host memory for the buffers")
        return real(sharded)

    verify._empty_like_sharded = buffers
    state = build("anchor", 0.004, "gpu", rank, world)
    meta = {}
    args = SimpleNamespace(threads=2, out=os.path.join(target, f"out{rank}"))
    run._verify("safe_sync", state, target, "gpu", args, 128 << 20, meta, rank, dist.new_group(backend="gloo"))
    return {"entry": meta["verified"][f"safe_sync gpu {target}"],
            "left": os.path.exists(os.path.join(target, "verify_safe_sync"))}


@pytest.mark.parametrize("fail_rank", [None, 1])
def test_bench_round_trip_on_two_ranks_fails_together(tmp_path, fail_rank):
    """Both ranks load their shards back, or, where one rank fails alone before the load, no
    rank enters the load's collectives (nothing hangs), both record that rank's failure, and
    the checkpoint is gone."""
    from tests.helpers.mp import run_world

    results = run_world(2, _verify_on_ranks, (str(tmp_path), fail_rank), timeout_s=180)
    assert [status for status, _ in results] == ["ok", "ok"], results
    entries = [v["entry"] for _, v in results]
    assert entries[0] == entries[1] and not any(v["left"] for _, v in results)
    if fail_rank is None:
        assert (entries[0]["tensors"], entries[0]["ranks"]) == (2 * 20, 2) and "failed" not in entries[0]
    else:
        assert entries[0]["failed"] == "rank 1: RuntimeError: no host memory for the buffers", entries[0]


def _diag_ttd():
    import importlib.util
    import os

    import sys

    here = os.path.join(REPO, "benchmarks", "diag")
    spec = importlib.util.spec_from_file_location("diag_ttd_under_test", os.path.join(here, "diag_ttd.py"))
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, here)  # as when it runs as a script: its saves module beside it
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(here)
    return module


def test_diag_write_lanes_direct_bytes_and_errors(tmp_path, monkeypatch):
    """diag_ttd's O_DIRECT lane writes exactly its span (whole blocks past the page cache,
    the unaligned tail through it), spans for it start on block boundaries, and a lane that
    fails fails the case instead of vanishing with its thread."""
    import errno
    import mmap
    import os
    import random

    diag = _diag_ttd()
    nbytes = 3 * diag.DIRECT_ALIGN * 5 + 777
    buf = mmap.mmap(-1, nbytes)  # page-aligned, as the CUDA pinned buffer is
    buf[:] = random.Random(7).randbytes(nbytes)
    mv = memoryview(buf)
    spans = diag._spans(nbytes, 3, align=diag.DIRECT_ALIGN)
    assert all(s.start % diag.DIRECT_ALIGN == 0 for s in spans)
    assert [s.start for s in spans[1:]] == [s.stop for s in spans[:-1]] and spans[-1].stop == nbytes
    try:
        for i, span in enumerate(spans):
            diag._direct_lane(str(tmp_path / f"f{i}"), mv, span, 2 * diag.DIRECT_ALIGN)
    except OSError as e:
        if e.errno == errno.EINVAL:
            pytest.skip(f"this filesystem takes no O_DIRECT: {e}")
        raise
    assert b"".join((tmp_path / f"f{i}").read_bytes() for i in range(3)) == bytes(buf)

    calls = []
    real = os.pwrite

    def failing(fd, data, offset):
        calls.append(offset)
        if len(calls) == 2:
            raise OSError(errno.EIO, "injected")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", failing)
    with pytest.raises(OSError, match="injected"):
        diag._write_lanes(str(tmp_path / "lanes"), mv, 2, diag.DIRECT_ALIGN)
    assert not (tmp_path / "lanes").exists()


def test_diag_write_lanes_short_writes_are_finished(tmp_path, monkeypatch):
    """A pwrite that takes fewer bytes than given is continued, not dropped."""
    import os
    import random

    diag = _diag_ttd()
    data = random.Random(3).randbytes(10_000)
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, b, off: real(fd, bytes(b)[:1000], off))
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        diag._pwrite_all(fd, memoryview(data), 5)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"\0" * 5 + data


def test_bench_fails_a_save_that_does_not_load_back(tmp_path, monkeypatch):
    """A checkpoint whose bytes differ from the state (one payload byte flipped on disk after
    the save) fails the bench run, after its report is written and naming the rank; stock
    Megatron's load itself does not check the bytes."""
    import os
    import socket

    from safe_ckpt_lab.bench import main as bench_main
    from safe_ckpt_lab.bench import peers

    real = peers.RUNNERS["safe_sync"]

    def corrupting(state, target, threads, budget_bytes):
        result = real(state, target, threads, budget_bytes)
        data = max((os.path.join(target, f) for f in os.listdir(target) if f.endswith(".distcp")),
                   key=os.path.getsize)
        with open(data, "r+b") as f:
            f.seek(os.path.getsize(data) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
        return result

    monkeypatch.setitem(peers.RUNNERS, "safe_sync", corrupting)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "bench"
    import safe_ckpt

    try:
        with pytest.raises(RuntimeError, match=r"did not load back bit-exact.*safe_sync gpu .*rank 0: 1 differ"):
            bench_main.main(["--gib", "0.02", "--reps", "1", "--threads", "2", "--targets", str(tmp_path / "t"),
                      "--peers", "safe_sync,safe_async", "--budget-gib", "0.1", "--out", str(out)])
    finally:  # the bench prepares this process's staging pool, as a training job would
        safe_ckpt.release_staging_pool()
    report = json.loads((tmp_path / "bench.json").read_text())
    assert "failed" in report["meta"]["verified"][f"safe_sync gpu {tmp_path / 't'}"]
    assert "failed" not in report["meta"]["verified"][f"safe_async gpu {tmp_path / 't'}"]
    assert {r["peer"] for r in report["rows"]} == {"safe_sync", "safe_async"}
    assert "**FAILED**" in (tmp_path / "bench.md").read_text()
    assert not os.path.exists(tmp_path / "t" / "verify_safe_sync")


def test_verify_compare_names_every_difference():
    """The bench's round-trip check names a flipped bit, a changed object, a changed plain value
    and a key the load did not return, and passes an exact copy."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from safe_ckpt_lab.bench.verify import compare

    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(64, generator=g), torch.randn(8, 8, generator=g).to(torch.bfloat16)
    expected = {"a": ShardedTensor.from_rank_offsets("a", a), "b": ShardedTensor.from_rank_offsets("b", b),
                "o": ShardedObject("o", {"lr": 1e-4}, (1,), (0,)), "iteration": 4}
    exact = {"a": a.clone(), "b": b.clone(), "o": {"lr": 1e-4}, "iteration": 4}
    v = compare(exact, expected)
    assert (v.tensors, v.objects, v.mismatched) == (2, 2, ())
    flipped = a.clone()
    flipped.view(torch.int32)[17] ^= 1
    v = compare({"a": flipped, "o": {"lr": 2e-4}, "iteration": torch.ones(2)}, expected)
    assert v.mismatched == ("a", "b (not loaded)", "o", "iteration")
    # bf16 values stored as fp32 would load into bf16 buffers unnoticed: the stored metadata tells
    stored = {"a": ShardedTensor.from_rank_offsets("a", a), "b": ShardedTensor.from_rank_offsets("b", b.float())}
    v = compare(exact, expected, stored)
    assert v.mismatched == ("b (stored as (torch.float32, (8, 8)))",)
    assert compare(exact, expected, {"a": stored["a"]}).mismatched == ("b (stored as None)",)


def test_bench_peer_with_its_own_thread_count(tmp_path, monkeypatch, capsys):
    """``NAME@T`` runs that saver with T writer threads beside the same saver at --threads, as
    a row of its own; a name that is no saver or a count that is no whole number >= 1 is
    refused before anything runs, naming it, and so is a --ceiling-beside-d2h filesystem that
    no target is on."""
    import socket

    from safe_ckpt_lab.bench import main as bench_main
    from safe_ckpt_lab.bench import peers
    from safe_ckpt_lab.bench.machine import fs_type

    seen = []
    real = peers.RUNNERS["dcp_sync"]

    def recording(state, target, threads, budget_bytes):
        seen.append(threads)
        return real(state, target, threads, budget_bytes)

    monkeypatch.setitem(peers.RUNNERS, "dcp_sync", recording)
    small = ["--gib", "0.02", "--reps", "1", "--targets", str(tmp_path / "never"), "--out", str(tmp_path / "never")]
    for bad, said in (("dcp_sync@0", "whole number >= 1"), ("dcp_sync@x", "whole number >= 1"),
                      ("dcp_sync@08", "whole number >= 1"), ("dcp_sync@\u00b2", "whole number >= 1"),
                      ("megatron_sync@4", "takes no thread count"), ("nope@3", "unknown peer")):
        with pytest.raises(SystemExit):
            bench_main.main(["--peers", f"safe_sync,{bad}", *small])
        err = capsys.readouterr().err
        assert said in err and repr(bad) in err, err
        with pytest.raises(ValueError, match=said):
            peers.resolve(bad)
    with pytest.raises(SystemExit):  # --verify names are checked the same way
        bench_main.main(["--peers", "safe_sync", "--verify", "safe_sync@0", *small])
    assert "safe_sync@0" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a filesystem no target is on would measure no ceiling beside the copies
        bench_main.main(["--peers", "safe_sync", "--ceiling-beside-d2h", "tmfps", *small])
    err = capsys.readouterr().err
    assert "--ceiling-beside-d2h tmfps: no target is on it" in err and fs_type(str(tmp_path)) in err, err
    assert not seen and not (tmp_path / "never").exists()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    import safe_ckpt

    try:
        bench_main.main(["--gib", "0.02", "--reps", "1", "--threads", "2", "--targets", str(tmp_path / "t"),
                  "--peers", "dcp_sync,dcp_sync@3,safe_sync@3", "--verify", "none", "--budget-gib", "0.1",
                  "--out", str(tmp_path / "bench")])
    finally:  # the bench prepares this process's staging pool, as a training job would
        safe_ckpt.release_staging_pool()
    assert seen == [2, 3]  # one run each, in the round's order
    assert "safe_sync@3: not loaded back" in capsys.readouterr().err
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {s["peer"]: s for s in report["summary"]}
    assert rows["dcp_sync"]["runs"] == rows["dcp_sync@3"]["runs"] == 1 and rows["dcp_sync@3"]["total_s"] > 0
    assert rows["safe_sync@3"]["vs_best_peer"] > 0  # a safe_ckpt row, against the stock peers
    assert [s["peer"] for s in report["summary"]] == ["safe_sync@3", "dcp_sync", "dcp_sync@3"]
    assert "| dcp_sync@3 |" in (tmp_path / "bench.md").read_text()


def test_diag_ttd_save_cases_run_on_cpu(tmp_path):
    """diag_ttd's save cases (patched, traced, phased, paced) run end to end on a host state and
    report every case, so the GPU machine's calls do not find a broken script."""
    import os

    script = os.path.join(REPO, "benchmarks", "diag", "diag_ttd.py")
    cases = ["write_8", "safe_sync", "safe_async_io16_new_trace", "safe_sync_io16_phases", "safe_sync_io16_rate30",
             "safe_sync_io16_nice5"]
    proc = subprocess.run([sys.executable, script, "--gib", "0.02", "--reps", "1", "--target", str(tmp_path / "d"),
                           "--only", ",".join(cases)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    medians = {d["case"]: d for d in lines if "median_s" in d}
    assert set(medians) == set(cases) and all(d["median_s"] > 0 for d in medians.values())
    assert medians["safe_async_io16_new_trace"]["stall_median_s"] > 0  # async: its return time recorded
    assert any(d.get("case") == "trace" and d["of"] == "safe_async_io16_new_trace" and d["lanes"] >= 1
               and d["stall_s"] > 0 for d in lines)
    assert any(d.get("case") == "phases" and "collect" in d["phases"] for d in lines)
    assert not os.path.exists(tmp_path / "d")


def test_diag_copy_pacing_schedules(monkeypatch):
    """diag_saves' paced copies: from the issuing thread, each copy waits until the bytes
    before it would have taken at the rate since the first; on the device, a spin sized by
    the previous chunk goes on the copy stream before the next copy (never after the last, and
    not between a copy and its own sums)."""
    import contextlib
    import os

    import torch

    import importlib.util

    here = os.path.join(REPO, "benchmarks", "diag", "diag_saves.py")
    spec = importlib.util.spec_from_file_location("diag_saves_under_test", here)
    saves = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(saves)

    clock, log = [100.0], []
    monkeypatch.setattr(saves.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(saves.time, "sleep", lambda s: (log.append(("sleep", round(s, 6))), clock.__setitem__(0, clock[0] + s)))

    class FakeStager:
        def __init__(self):
            self.device_bytes = 0

        def _stream(self, index):
            return index

    def enqueue(self, chunk, *a, **k):
        log.append(("copy", chunk.numel()))
        self.device_bytes += chunk.numel()
        return "event"

    stager, chunks = FakeStager(), [torch.empty(n, dtype=torch.uint8) for n in (2000, 1000, 3000)]
    paced = saves._paced(enqueue, 1e-6)  # 1000 bytes a second
    assert [paced(stager, c) for c in chunks] == ["event"] * 3
    assert log == [("copy", 2000), ("sleep", 2.0), ("copy", 1000), ("sleep", 1.0), ("copy", 3000)]

    log.clear()
    monkeypatch.setattr(saves, "_cycles_per_s", lambda: 1e9)
    monkeypatch.setattr(saves, "D2H_GBPS", 4e-6)  # 4000 bytes a second at full speed
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("spin", cycles)))
    stager, devpaced = FakeStager(), saves._devpaced(enqueue, 1e-6)
    for c in chunks:
        devpaced(stager, c)
    # 2000 bytes: 2 s at the rate, 0.5 s at full speed, so 1.5 s of spin before the next copy
    assert log == [("copy", 2000), ("spin", int(1.5e9)), ("copy", 1000), ("spin", int(0.75e9)), ("copy", 3000)]


def test_diag_pipe_lanes_fail_their_case():
    """diag_pipes' lanes run all at once and a lane's error fails the case (it used to vanish
    with its thread, and the case reported a time for work it never did)."""
    import importlib.util
    import os
    import sys

    here = os.path.join(REPO, "benchmarks", "diag")
    spec = importlib.util.spec_from_file_location("diag_pipes_under_test", os.path.join(here, "diag_pipes.py"))
    pipes = importlib.util.module_from_spec(spec)
    sys.path.insert(0, here)
    try:
        spec.loader.exec_module(pipes)
    finally:
        sys.path.remove(here)
    ran = []
    assert pipes.run_guarded(ran.append, 4) >= 0 and sorted(ran) == [0, 1, 2, 3]

    def lane(i):
        ran.append(i)
        if i == 2:
            raise OSError(28, "No space left on device")

    ran.clear()
    with pytest.raises(OSError, match="No space left"):
        pipes.run_guarded(lane, 3)
    assert sorted(ran) == [0, 1, 2]  # the other lanes still ran to the end


@pytest.mark.slow
def test_one_run_over_tmpfs_and_disk_measures_the_beside_ceiling_on_tmpfs_only(tmp_path):
    """One run over a tmpfs and a disk target: the ceiling beside the copies is asked for
    tmpfs only (the disk's own write binds there), and the log and report say when each phase
    ended, so a run cut short shows where its time went."""
    import os
    import shutil

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    shm = f"/dev/shm/safe_ckpt_test_{os.getpid()}"
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "safe_ckpt_lab.bench", "--gib", "0.005", "--reps", "1", "--targets",
           f"{shm},{tmp_path / 'disk'}", "--peers", "safe_sync", "--verify", "none", "--ceiling-beside-d2h",
           "tmpfs", "--out", str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((tmp_path / "bench.json").read_text())["meta"]
    notes = meta.get("ceiling_notes", {})
    disk_key = f"write_beside_d2h_gbps[gpu {tmp_path / 'disk'}]"
    assert notes[disk_key].startswith("not measured: ") and notes[disk_key].endswith(", not tmpfs")
    assert f"write_beside_d2h_gbps[gpu {shm}]" in {**notes, **meta["ceilings"]}
    phases = meta["at_s"]
    assert phases["state gpu"] <= phases[f"ceiling {shm}"] <= phases["pool gpu"]
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [r["at_s"] for r in rows] == sorted(r["at_s"] for r in rows) and rows[0]["at_s"] >= phases["pool gpu"]
    assert "s] ceiling write" in proc.stdout
