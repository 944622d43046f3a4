"""The bench's view of a node of N ranks: each rank's device-to-host share measured with every
rank copying at once, one write-ceiling source per host, a row's outcome from every rank, the
stock peers' threads under library defaults, and the goals checked per rank."""

import os

import pytest

from safe_ckpt_lab.bench import ceilings, goals, node, report

GB = 10**9


def _node_parts(rank, world, root):
    """On a real gloo world: the concurrent copy (a host copy standing in for the device one,
    which the GPU machine runs), the shared source, the fallback where /dev/shm has no room,
    and a row gathered with one rank failing."""
    import datetime
    import errno

    import torch.distributed as dist

    from safe_ckpt_lab.bench.run import _everyone

    group = dist.new_group(backend="gloo")
    copying = dist.new_group([0, 1], backend="gloo", timeout=datetime.timedelta(seconds=30))
    everyone = lambda mine: _everyone(mine, group)  # noqa: E731
    out = {}

    def copy():
        # the copies overlap only if every rank with GPU bytes (0 and 1) runs its n-th copy in
        # the same round: each waits (bounded) inside its copy until the other has begun its own
        dist.monitored_barrier(copying, timeout=datetime.timedelta(seconds=30))
        out.setdefault("copies", []).append(len(out.get("copies", [])))

    out["share"] = node.d2h_share(copy if rank != 2 else None, (rank + 1) << 20, everyone, dist.barrier)

    source = node.host_source((rank + 1) << 20, rank, everyone, dist.barrier)
    out["source"] = {"shared": source.shared, "len": len(source.view), "head": bytes(source.view[:4096]),
                     "tail": bytes(source.view[(1 << 20) - 4096:1 << 20])}
    dist.barrier()  # every rank has returned: the creator has unlinked its file
    pid = everyone(os.getpid())[0]
    out["left"] = [f for f in os.listdir("/dev/shm") if f.startswith(f"safe_ckpt_bench_source_{pid}_")]
    source.close()

    def full(fd, offset, length):  # /dev/shm without room for the source
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    node.os.posix_fallocate = full
    source = node.host_source((rank + 1) << 20, rank, everyone, dist.barrier)
    dist.barrier()
    out["full"] = {"shared": source.shared, "len": len(source.view),
                   "left": [f for f in os.listdir("/dev/shm") if f.startswith(f"safe_ckpt_bench_source_{pid}_")]}
    source.close()

    ok = {"stall_s": 0.1 * (rank + 1), "total_s": 1.0 + rank, "io_threads": 4, "staging_budget_bytes": 1 << 30,
          "extra_rss_bytes": 5 << 20}
    out["row"] = node.gather_result(ok, None, everyone)
    out["failed"] = node.gather_result(None if rank == 1 else ok, "boom on 1" if rank == 1 else None, everyone)
    return out


def test_node_parts_on_three_ranks(tmp_path):
    from tests.helpers.mp import run_world

    results = run_world(3, _node_parts, (str(tmp_path),), timeout_s=120)
    assert [status for status, _ in results] == ["ok"] * 3, results
    values = [v for _, v in results]
    share = values[0]["share"]
    assert all(v["share"] == share for v in values)  # the same record on every rank
    assert share["device_bytes"] == [1 << 20, 2 << 20, 0] and share["reps"] == 3
    assert share["gbps"][2] is None and all(g > 0 for g in share["gbps"][:2])  # rank 2 has no GPU bytes
    assert share["gbps"][1] == pytest.approx((2 << 20) / share["seconds"][1] / GB)
    assert share["aggregate_gbps"] == pytest.approx((3 << 20) / max(share["seconds"][:2]) / GB)
    assert values[0]["copies"] == values[1]["copies"] == [0, 1, 2] and "copies" not in values[2]
    # one copy per host, mapped by every rank: the same bytes, each rank seeing its own size
    if os.path.isdir("/dev/shm"):
        assert all(v["source"]["shared"] for v in values)
        assert len({v["source"]["head"] for v in values}) == 1
        assert [v["source"]["len"] for v in values] == [1 << 20, 2 << 20, 3 << 20]
    assert all(v["left"] == [] for v in values)  # the file is unlinked once every rank has mapped it
    if os.path.isdir("/dev/shm"):  # no room: each rank its own buffer, and the file is gone
        assert [v["full"] for v in values] == [{"shared": False, "len": n << 20, "left": []} for n in (1, 2, 3)]
    row = values[0]["row"]
    assert all(v["row"] == row for v in values)
    assert row["stall_s"] == pytest.approx(0.3) and row["total_s"] == 3.0  # the slowest rank's
    assert row["by_rank"]["stall_s"] == pytest.approx([0.1, 0.2, 0.3])
    assert row["by_rank"]["staging_budget_bytes"] == [1 << 30] * 3 and "pool_allocations" not in row["by_rank"]
    assert all(v["failed"] == {"error": "boom on 1", "error_ranks": [1]} for v in values)


def test_source_bytes_differ_block_to_block():
    import torch

    block = 4096
    t = torch.empty(300 * block + 5, dtype=torch.uint8)  # past 256 blocks, where the shift wraps
    node.fill(t, block_bytes=block)
    blocks = {bytes(t[i * block:(i + 1) * block].numpy()) for i in range(300)}
    assert len(blocks) == 300  # every block its own bytes
    assert t.float().std() > 60  # spread over the byte values, not a constant


def test_threads_of_the_stock_peers_and_ceilings(monkeypatch):
    assert node.peer_threads(8, 4, 16) == 8  # given: every saver's
    assert [node.peer_threads(0, n, 16) for n in (1, 2, 4, 8, 32)] == [16, 8, 4, 2, 1]  # 0: the rank's share
    monkeypatch.setattr(ceilings.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert ceilings.thread_counts(2, 8) == [2] and ceilings.thread_counts(4, 2) == [4, 8]
    assert ceilings.thread_counts(8) == [8, 16]  # one rank: one writer per core, as before


def _row(peer, rep, stalls, totals, extra, *, pool=1 << 30, allocs=None, target="/shm", nbytes=8 * GB):
    by_rank = {"stall_s": stalls, "total_s": totals, "extra_rss_bytes": extra}
    if peer.startswith("safe"):
        by_rank.update(staging_budget_bytes=[pool] * len(stalls), pool_allocations=allocs or [0] * len(stalls))
    return {"peer": peer, "residence": "gpu", "target": target, "cache": "cold", "rep": rep, "stall_s": max(stalls),
            "total_s": max(totals), "bytes": nbytes, "device_bytes": nbytes // len(stalls), "by_rank": by_rank}


def _meta(fs="tmpfs", target="/shm", shares=(20.0, 10.0)):
    n = len(shares)
    return {"world_size": n, "ranks_on_gpu0": n, "targets": {target: fs},
            "ceilings": {f"write_gbps[{target}]": 10.0, f"write_beside_d2h_gbps[gpu {target}]": 8.0},
            "device_bytes_by_rank": {"gpu": [4 * GB] * n},
            "d2h_shares": {"gpu": {"gbps": list(shares), "seconds": [4 / s for s in shares], "reps": 3,
                                   "device_bytes": [4 * GB] * n, "aggregate_gbps": 8 / max(4 / s for s in shares)}},
            "safe_options": {"gpu": {"io_threads": [8] * n, "staging_budget_bytes": [1 << 30] * n,
                                     "checksum_threads": [0] * n}},
            "staging_pool": {"gpu": {"staging_budget_bytes": 1 << 30, "pinned": True}}}


def _by(results, peer, goal):
    return next(g for g in results if g["peer"] == peer and g["goal"].startswith(goal))


def test_stall_is_checked_per_rank_against_its_own_share():
    # rank 1's share is half rank 0's: its bound is 1.2 x 4 GB / 10 GB/s + 0.1 = 0.58 s, rank 0's 0.34 s.
    # Medians per rank over the runs: rank 0 0.30 s (within), rank 1 0.50 s (within its own bound,
    # though above rank 0's): a bound on the slowest rank's stall against the fastest share would fail it
    rows = [_row("safe_async", i, [s0, s1], [1.0, 1.0], [0, 0]) for i, (s0, s1) in
            enumerate([(0.30, 0.50), (0.29, 0.52), (0.31, 0.40)])]
    summary = report.summarize(rows, _meta())
    assert summary[0]["stall_s_by_rank"] == pytest.approx([0.30, 0.50])
    stall = _by(goals.evaluate(summary, _meta()), "safe_async", "async stall")
    assert stall["passed"] is True and "stalls by rank [0.3, 0.5] s" in stall["detail"]
    # the rank nearest its own bound is the one shown
    assert stall["value"] == pytest.approx(0.30) and stall["bound"] == pytest.approx(0.34)
    rows[0]["by_rank"]["stall_s"][0] = rows[1]["by_rank"]["stall_s"][0] = 0.36  # rank 0 over its 0.34 s
    stall = _by(goals.evaluate(report.summarize(rows, _meta()), _meta()), "safe_async", "async stall")
    assert stall["passed"] is False and "worst rank 0" in stall["detail"] and stall["bound"] == pytest.approx(0.34)


def test_memory_is_the_pool_held_plus_what_the_save_adds_per_rank():
    pool = 1 << 30
    # a pinned pool allocated before the save is resident already: 50 MiB more is 1.049 x, 60 MiB 1.059 x
    rows = [_row("safe_sync", 0, [1.0, 1.0], [1.0, 1.0], [50 << 20, 10 << 20])]
    s = report.summarize(rows, _meta())[0]
    assert s["host_peak_bytes_by_rank"] == [pool + (50 << 20), pool + (10 << 20)]
    assert _by(goals.evaluate([s], _meta()), "safe_sync", "peak")["passed"] is True
    rows.append(_row("safe_sync", 1, [1.0, 1.0], [1.0, 1.0], [10 << 20, 60 << 20]))  # the peak over runs counts
    mem = _by(goals.evaluate(report.summarize(rows, _meta()), _meta()), "safe_sync", "peak")
    assert mem["passed"] is False and "worst rank 1" in mem["detail"]
    # a save that had to allocate its pool has it in its RSS growth: not counted twice
    rows = [_row("safe_sync", 0, [1.0, 1.0], [1.0, 1.0], [pool + (20 << 20), 0], allocs=[1, 0])]
    assert report.summarize(rows, _meta())[0]["host_peak_bytes_by_rank"] == [pool + (20 << 20), pool]
    # a pageable pool (no CUDA) becomes resident during the save: its growth alone
    meta = _meta()
    meta["staging_pool"]["gpu"]["pinned"] = False
    rows = [_row("safe_sync", 0, [1.0, 1.0], [1.0, 1.0], [pool // 2, 0])]
    assert report.summarize(rows, meta)[0]["host_peak_vs_pool_by_rank"] == [0.5, 0.0]
    # a stock peer's growth, against the safe_ckpt pool of the same rank
    rows = [_row("dcp_async_pinned", 0, [1.0, 1.0], [2.0, 2.0], [8 * pool, 4 * pool])]
    assert report.summarize(rows, _meta())[0]["host_peak_vs_pool"] == 8.0


def test_goals_on_tmpfs_and_disk_with_their_numbers():
    rows = [_row("safe_sync", i, [0.9, 1.0], [0.9, 1.0], [0, 0]) for i in range(3)]  # 8 GB in 1 s: 8 GB/s
    rows += [_row("dcp_sync", 0, [3.0, 3.0], [3.0, 3.0], [0, 0])]
    tmpfs = goals.evaluate(report.summarize(rows, _meta()), _meta())
    beside = _by(tmpfs, "safe_sync", "time-to-durable vs ceiling beside")
    assert beside["passed"] is True and beside["value"] == pytest.approx(1.0)  # 8 GB/s vs 8 GB/s beside 2 copies
    assert "beside 2 device-to-host copies" in beside["detail"]
    assert not any(g["goal"].startswith(("vs best", "async")) for g in tmpfs)  # disk only; sync saver
    disk_rows = [{**r, "target": "/disk"} for r in rows]
    meta = _meta("ext4", "/disk")
    meta["write_samples_gbps"] = {"/disk": [9.0, 10.0, 11.0]}  # paired per round: 8/9, 8/10, 8/11
    meta["write_sample_rounds"] = {"/disk": [report.round_key("gpu", "cold", i) for i in range(3)]}
    disk = goals.evaluate(report.summarize(disk_rows, meta), meta)
    ceiling = _by(disk, "safe_sync", "time-to-durable vs write")
    assert ceiling["value"] == pytest.approx(0.8) and ceiling["passed"] is False and "round's ceiling" in ceiling["detail"]
    peer = _by(disk, "safe_sync", "vs best")
    assert peer["value"] == pytest.approx(3.0) and peer["passed"] is True and "dcp_sync 3.000 s" in peer["detail"]
    lines = goals.compact_lines(disk, meta)
    assert lines == ["goals N=2 disk(ext4) gpu/cold safe_sync: ttd/ceiling 0.80>=0.85 FAIL; "
                     "vs-best-peer 3.00>=1.50 PASS; mem/pool 1.00<=1.05 PASS"]
    md = report.to_markdown(report.summarize(disk_rows, meta), meta)
    assert "| vs best stock peer (disk) | gpu | /disk | cold | safe_sync | 3.000 | >= 1.500 | **PASS** |" in md


def test_no_share_measured_is_not_a_pass():
    rows = [_row("safe_async", 0, [0.1, 0.1], [1.0, 1.0], [0, 0])]
    meta = _meta()
    meta["d2h_shares"]["gpu"] = None  # a CPU run: no GPU bytes to copy
    stall = _by(goals.evaluate(report.summarize(rows, meta), meta), "safe_async", "async stall")
    assert stall["passed"] is None and "not measured" in stall["detail"]


def test_a_save_reports_what_it_resolved(tmp_path):
    """What a save used where its options left them to the defaults, as the bench records per rank."""
    import safe_ckpt
    from safe_ckpt.host import cpu
    from safe_ckpt_lab.bench.state import build

    state = build("anchor", 0.001, "gpu", 0, 1)
    result = safe_ckpt.save(state.make_sharded(), str(tmp_path / "a"), options=safe_ckpt.SaveOptions(
        io_threads=3, staging_budget_bytes=64 << 20))
    assert (result.extra["io_threads"], result.extra["staging_budget_bytes"]) == (3, 64 << 20)
    assert result.extra["checksum_threads"] == cpu.checksum_threads(None, 3, cpu.math.floor(
        cpu.rank_share([cpu.host_report()], 0).core_share + 1e-9))
    result = safe_ckpt.save(state.make_sharded(), str(tmp_path / "b"))  # all left to the library
    assert 1 <= result.extra["io_threads"] <= cpu.MAX_DEFAULT_IO_THREADS
    assert 0 < result.extra["staging_budget_bytes"] <= cpu.MAX_DEFAULT_STAGING_BYTES
    safe_ckpt.release_staging_pool()


def _safe_line(meta):
    return next(line for line in report._rank_lines(meta) if line.startswith("safe_ckpt by rank"))


def test_the_report_says_who_set_the_writers_and_who_the_pool():
    # --threads 0 leaves the writers to the library, while --budget-gib still sets the pool
    meta = {**_meta(), "threads": 0, "safe_defaults": True, "peer_threads": 8, "budget_gib": 4.55}
    assert _safe_line(meta) == ("safe_ckpt by rank, gpu: io_threads [8, 8] (library default), staging pool MiB "
                                "[1024, 1024] (set by --budget-gib 4.55), checksum_threads [0, 0] (library default); "
                                "other savers and the ceiling 8 threads each")
    assert "MiB [1024, 1024] (library default)" in _safe_line({**meta, "budget_gib": None})
    given = _safe_line({**meta, "threads": 8, "safe_defaults": False, "budget_gib": None})
    assert "io_threads [8, 8] (--threads 8)" in given and "(the bench's: the GPU bytes + 0.25 GiB" in given


def test_rebuild_reads_a_meta_recorded_before_the_budget_was_kept(tmp_path):
    import json

    from safe_ckpt_lab.bench import run

    meta = {**_meta(), "threads": 0, "safe_defaults": True, "peer_threads": 8, "label": "old run"}
    meta["staging_pool"]["gpu"] = {"bytes": 1 << 30, "pinned": True}  # its key before it ended in _bytes
    prefix = str(tmp_path / "old")
    with open(prefix + ".meta.json", "w") as f:
        json.dump(meta, f)
    with open(prefix + ".rows.jsonl", "w") as f:
        f.write(json.dumps(_row("safe_sync", 0, [1.0, 1.0], [1.0, 1.0], [0, 0])) + "\n")
    md = run.rebuild(prefix)
    assert "# old run (rebuilt from 1 recorded rows)" in md
    assert "staging pool MiB [1024, 1024] (how it was set not recorded)" in md  # not called the library's


def _aligned_ceilings(rank, world, root, fail_at):
    """Each rank's repetitions take the times below: rank 0 is fast in its first, rank 1 in its
    last. Repetitions that start together count at their slowest rank, so no repetition had
    both ranks fast and the ceiling is the 5 s one; each rank's own best of 3 (what a call with
    ``reps`` 3 returns) paired across ranks would give 1 s. ``fail_at``: rank 1 raises in that
    repetition instead."""
    import types

    import torch.distributed as dist

    from safe_ckpt_lab.bench import collective

    group = dist.new_group(backend="gloo")
    times = {0: [1.0, 5.0, 5.0], 1: [5.0, 5.0, 1.0]}[rank]
    used = []

    def write_seconds(target, nbytes, threads, reps, source):
        if rank == 1 and len(used) == fail_at:
            raise OSError(28, "No space left on device")
        mine = times[len(used):len(used) + reps]
        used.extend(mine)
        return min(mine)

    collective.ceilings.write_seconds = write_seconds
    state = types.SimpleNamespace(nbytes=10 * GB)
    try:
        rate = collective._ceiling_rate(root, state, 1, 3, None, rank, world, group)
    except RuntimeError as exc:
        return {"error": str(exc), "repetitions": len(used)}
    return {"rate_gbps": rate, "repetitions": len(used)}


def test_ceiling_repetitions_start_together_and_count_at_the_slowest_rank(tmp_path):
    from tests.helpers.mp import run_world

    results = run_world(2, _aligned_ceilings, (str(tmp_path), None), timeout_s=120)
    for status, out in results:
        assert status == "ok", out
        assert out["rate_gbps"] == pytest.approx(2 * 10 / 5.0) and out["repetitions"] == 3


def test_a_ceiling_failing_on_one_rank_fails_every_rank_at_once(tmp_path):
    from tests.helpers.mp import run_world

    results = run_world(2, _aligned_ceilings, (str(tmp_path), 1), timeout_s=120)
    outs = [out for status, out in results if status == "ok"]
    assert len(outs) == 2, results
    assert all("failed on rank 1" in o["error"] and "No space left" in o["error"] for o in outs)
    assert [o["repetitions"] for o in outs] == [2, 1]  # rank 0 stopped after the failed repetition


def _fresh_on_ranks(rank, world, root):
    """Each rank empties and makes the same save directory, then puts a file of its own in it;
    the last rank is late: it waits (bounded) for rank 0's file before its own ``_fresh``."""
    import datetime
    import shutil

    import torch.distributed as dist

    from safe_ckpt_lab.bench import peers

    removed = []
    real = shutil.rmtree
    peers.shutil.rmtree = lambda path, **kw: (removed.append(path), real(path, **kw))
    store = dist.distributed_c10d._get_default_store()
    path = os.path.join(root, "ck_megatron_sync")
    if rank == world - 1:
        try:  # rank 0 cannot get this far before every rank has reached _fresh: the wait runs out
            store.wait(["made_0"], datetime.timedelta(seconds=2))
        except Exception:
            pass
    d = peers._fresh(path, make=True)
    with open(os.path.join(d, f"rank{rank}"), "w") as f:
        f.write("x")
    store.set(f"made_{rank}", "1")
    dist.barrier()
    return {"removed": removed, "files": sorted(os.listdir(d))}


def test_only_the_first_rank_empties_a_save_directory_and_every_rank_waits_for_it(tmp_path):
    """Ranks of a host share its filesystem: a rank that removed the directory for itself took
    away what another had begun (or failed to make it and left the others waiting in stock
    Megatron's collectives for ever)."""
    from tests.helpers.mp import run_world

    stale = tmp_path / "ck_megatron_sync"
    stale.mkdir()
    (stale / "from_an_earlier_run").write_text("old")
    results = run_world(3, _fresh_on_ranks, (str(tmp_path),), timeout_s=120)
    assert [status for status, _ in results] == ["ok"] * 3, results
    values = [v for _, v in results]
    assert values[0]["removed"] == [str(stale)] and values[1]["removed"] == values[2]["removed"] == []
    assert all(v["files"] == ["rank0", "rank1", "rank2"] for v in values)
