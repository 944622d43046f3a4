"""Defaults that hold at several ranks per host: writer threads, hashing threads and the staging
pool derived from each rank's share of its host's cores and memory (`cpu.resolve`), explicit
options kept, and every rank planning with the same `io_threads`."""

import os
import re

import pytest

import safe_ckpt
from safe_ckpt.host import cpu
from tests.helpers.bodies import common as cases
from tests.helpers.mp import run_world, values

GiB = 1 << 30
MiB = 1 << 20


def _reports(*hosts):
    """``hosts``: (host, [cpu sets of its ranks], memory_bytes); reports in rank order."""
    return [cpu.HostReport(name, tuple(cpus), memory) for name, rank_cpus, memory in hosts for cpus in rank_cpus]


def test_ranks_free_to_use_every_core_split_the_host():
    reports = _reports(("a", [range(16)] * 8, 128 * GiB))
    share = cpu.rank_share(reports, 5)
    assert (share.local_ranks, share.core_share, share.memory_share_bytes) == (8, 2.0, 16 * GiB)
    opts = cpu.resolve(safe_ckpt.SaveOptions(), reports, 5)
    # 8 ranks x 2 writers on 16 cores, 8 x 1 GiB pinned out of 128 GiB available; no core to spare for hashers
    assert (opts.io_threads, opts.staging_budget_bytes, opts.checksum_threads) == (2, GiB, 0)


def test_ranks_bound_to_their_own_cores_keep_them():
    reports = _reports(("a", [range(14 * r, 14 * r + 14) for r in range(8)], 2048 * GiB))
    assert cpu.rank_share(reports, 7).core_share == 14.0
    opts = cpu.resolve(safe_ckpt.SaveOptions(), reports, 7)
    assert (opts.io_threads, opts.staging_budget_bytes, opts.checksum_threads) == (14, 2 * GiB, 0)


def test_partly_shared_cores_count_by_how_many_ranks_may_use_them():
    # rank 0 alone on cores 0-3, ranks 0 and 1 both on 4-7: 4 + 4/2 = 6 cores for rank 0, 2 for rank 1
    reports = _reports(("a", [range(8), range(4, 8)], 8 * GiB))
    assert [cpu.rank_share(reports, r).core_share for r in (0, 1)] == [6.0, 2.0]
    # every rank plans with the fewest: 2
    assert {cpu.resolve(safe_ckpt.SaveOptions(), reports, r).io_threads for r in (0, 1)} == {2}
    # rank 0's spare share (6 cores, 2 writers) leaves it hashers; rank 1's none
    assert [cpu.resolve(safe_ckpt.SaveOptions(), reports, r).checksum_threads for r in (0, 1)] == [2, 0]


def test_writer_threads_are_the_fewest_any_host_gives_and_pools_are_each_hosts():
    reports = _reports(("a", [range(16)] * 4, 64 * GiB), ("b", [range(16)] * 2, 256 * GiB))
    resolved = [cpu.resolve(safe_ckpt.SaveOptions(), reports, r) for r in range(6)]
    assert {o.io_threads for o in resolved} == {4}
    assert [o.staging_budget_bytes for o in resolved] == [GiB] * 4 + [2 * GiB] * 2


@pytest.mark.parametrize("cpus, ranks, expected", [(64, 1, 16), (16, 1, 16), (2, 4, 1), (16, 3, 5), (6, 2, 3)])
def test_writer_threads_stay_within_one_and_sixteen(cpus, ranks, expected):
    reports = _reports(("a", [range(cpus)] * ranks, 64 * GiB))
    assert cpu.resolve(safe_ckpt.SaveOptions(), reports, 0).io_threads == expected


@pytest.mark.parametrize("memory, ranks, expected", [
    (2048 * GiB, 8, 2 * GiB),  # capped
    (128 * GiB, 8, GiB),
    (50 * GiB + 12345, 3, (50 * GiB + 12345) // 3 // 16 // MiB * MiB),  # whole MiB
    (GiB, 8, 64 * MiB),  # never below one chunk
    (None, 8, 2 * GiB),  # memory unknown: the cap
])
def test_staging_budget_is_a_sixteenth_of_the_ranks_memory_share(memory, ranks, expected):
    reports = _reports(("a", [range(4)] * ranks, memory))
    assert cpu.resolve(safe_ckpt.SaveOptions(), reports, 0).staging_budget_bytes == expected


def test_explicit_options_win():
    reports = _reports(("a", [range(16)] * 8, 128 * GiB))
    asked = safe_ckpt.SaveOptions(io_threads=8, staging_budget_bytes=3 * GiB, checksum_threads=4)
    assert cpu.resolve(asked, reports, 0) == asked
    # hashers for explicit writers still come from the rank's share: 2 cores, 1 writer, 1 hasher
    assert cpu.resolve(safe_ckpt.SaveOptions(io_threads=1), reports, 0).checksum_threads == 1


def test_one_rank_alone_keeps_the_single_rank_behaviour():
    reports = _reports(("a", [range(16)], 512 * GiB))
    opts = cpu.resolve(safe_ckpt.SaveOptions(), reports, 0)
    assert (opts.io_threads, opts.staging_budget_bytes) == (16, 2 * GiB)
    # explicit 8 writers on 16 cores: 8 hashers, as cpu.checksum_threads gave before
    assert cpu.resolve(safe_ckpt.SaveOptions(io_threads=8), reports, 0).checksum_threads == 8


def test_options_validate_explicit_values_only():
    assert safe_ckpt.SaveOptions().io_threads is None and safe_ckpt.SaveOptions().staging_budget_bytes is None
    with pytest.raises(safe_ckpt.ValidationError, match="io_threads"):
        safe_ckpt.SaveOptions(io_threads=0)
    with pytest.raises(safe_ckpt.ValidationError, match="staging_budget_bytes"):
        safe_ckpt.SaveOptions(staging_budget_bytes=1024, chunk_bytes=64 * 1024)


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def fake_host(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "_MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(cpu, "_CGROUP_V2", str(tmp_path / "v2"))
    monkeypatch.setattr(cpu, "_CGROUP_V1", str(tmp_path / "v1"))
    monkeypatch.setattr(cpu, "_BOOT_ID", str(tmp_path / "boot_id"))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 1, 2})
    _write(tmp_path / "meminfo", "MemTotal:       263000000 kB\nMemAvailable:   200000000 kB\n")
    return tmp_path


def test_host_report_reads_affinity_meminfo_and_boot_id(fake_host):
    _write(fake_host / "boot_id", "1234-abcd\n")
    _write(fake_host / "v2/memory.max", "max\n")
    _write(fake_host / "v2/memory.current", "5\n")
    report = cpu.host_report()
    assert report == cpu.HostReport("boot:1234-abcd", (1, 2, 3), 200000000 * 1024)


def test_a_cgroup_limit_bounds_the_memory(fake_host):
    _write(fake_host / "v2/memory.max", f"{64 * GiB}\n")
    _write(fake_host / "v2/memory.current", f"{40 * GiB}\n")
    _write(fake_host / "v2/memory.stat", f"anon 1\ninactive_file {4 * GiB}\nactive_file 9\n")
    report = cpu.host_report()
    assert report.memory_bytes == 28 * GiB  # 64 - 40 + 4 reclaimable
    assert report.host.startswith("host:")  # no boot id readable


def test_a_cgroup_v1_limit_counts_and_its_no_limit_does_not(fake_host):
    _write(fake_host / "v1/memory.limit_in_bytes", f"{32 * GiB}\n")
    _write(fake_host / "v1/memory.usage_in_bytes", f"{8 * GiB}\n")
    _write(fake_host / "v1/memory.stat", f"total_inactive_file {GiB}\n")
    assert cpu.host_report().memory_bytes == 25 * GiB
    _write(fake_host / "v1/memory.limit_in_bytes", f"{(1 << 63) - 4096}\n")
    assert cpu.host_report().memory_bytes == 200000000 * 1024


def test_no_meminfo_and_no_cgroup_leave_memory_unknown(fake_host):
    (fake_host / "meminfo").unlink()
    assert cpu.host_report().memory_bytes is None


class _Coordinator:
    def __init__(self, group, rank, reports):
        self.group, self.rank, self.world_size, self.reports = group, rank, len(reports), reports
        self.exchanges = []

    @property
    def distributed(self):
        return self.world_size > 1

    def exchange(self, stage, obj):
        self.exchanges.append((stage, obj))
        return self.reports


class _Group:
    def __init__(self, name):
        self.group_name = name


def test_reports_are_exchanged_once_per_group_whatever_the_options(monkeypatch):
    monkeypatch.setattr(cpu, "_group_reports", {})
    reports = _reports(("a", [range(16)] * 4, 64 * GiB))
    coord = _Coordinator(_Group("g-settle-1"), 1, reports)
    # explicit options still take part in the exchange: ranks whose options differ meet in it
    assert cpu.settle(safe_ckpt.SaveOptions(io_threads=3, staging_budget_bytes=GiB), coord).io_threads == 3
    assert cpu.settle(safe_ckpt.SaveOptions(), coord).io_threads == 4
    assert [stage for stage, _ in coord.exchanges] == ["host report"]
    other = _Coordinator(_Group("g-settle-2"), 0, reports)
    cpu.settle(safe_ckpt.SaveOptions(), other)
    assert len(other.exchanges) == 1


class _UnregisteredGroup:
    """As torch 2.13's ProcessGroup answers for a group it never registered (a detached gloo group)."""

    @property
    def group_name(self):
        raise RuntimeError("ProcessGroup name not set")


def test_a_group_torch_never_named_is_told_apart_by_identity(monkeypatch):
    monkeypatch.setattr(cpu, "_unnamed_reports", {})
    reports = _reports(("a", [range(16)] * 4, 64 * GiB))
    group = _UnregisteredGroup()
    coord = _Coordinator(group, 0, reports)
    cpu.settle(safe_ckpt.SaveOptions(), coord)
    cpu.settle(safe_ckpt.SaveOptions(), coord)
    assert len(coord.exchanges) == 1 and group in cpu._unnamed_reports


def test_a_single_process_exchanges_nothing(monkeypatch):
    monkeypatch.setattr(cpu, "_group_reports", {})
    coord = _Coordinator(None, 0, [None])
    opts = cpu.settle(safe_ckpt.SaveOptions(), coord)
    assert coord.exchanges == [] and 1 <= opts.io_threads <= 16


# ------------------------------------------------------------------ real ranks


def _expected_io_threads(world: int) -> int:
    # spawned ranks inherit this process's affinity and run on this host
    return max(1, min(16, len(os.sched_getaffinity(0)) // world))


def _data_files_per_rank(files: list[str]) -> dict:
    per_rank: dict = {}
    for name in files:
        m = re.fullmatch(r"__(\d+)_(\d+)\.distcp", name)
        if m:
            per_rank[int(m.group(1))] = per_rank.get(int(m.group(1)), 0) + 1
    return per_rank


def test_a_save_with_the_defaults_loads_back_bit_exact(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    defaults = {"io_threads": None, "staging_budget_bytes": None}
    out = values(run_world(2, cases.roundtrip, (1, 2, ckpt, None, defaults)))
    for rank, r in enumerate(out):
        assert r["mismatches"] == [], f"rank {rank}: {r['mismatches'][:10]}"
        assert r["tensors_checked"] > 10
    # two files per writer on each rank, the writers being this host's cores split two ways
    expected = 2 * _expected_io_threads(2)
    assert _data_files_per_rank(out[0]["files"]) == {0: expected, 1: expected}


def _mixed_options(rank, world, ckpt, odd_threads):
    from tests.helpers.mp import describe_exception

    state, _, _ = cases.hostile_state("options_disagree", rank, world)
    opts = cases.small_options(io_threads=odd_threads) if rank == 0 else cases.small_options(io_threads=None)
    try:
        safe_ckpt.save(state, ckpt, options=opts)
    except BaseException as exc:
        return describe_exception(exc)
    return None


def test_a_rank_with_explicit_writers_beside_ranks_with_the_default_is_refused_not_hung(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    out = values(run_world(2, _mixed_options, (ckpt, _expected_io_threads(2) + 1), timeout_s=120))
    for err in out:
        assert err is not None and "ValidationError" in err["mro"], err
        assert "SaveOptions.io_threads" in err["message"]
    assert not os.path.exists(ckpt)


def test_a_new_group_at_a_dead_groups_address_exchanges_its_own_reports(monkeypatch):
    """A group without a name (the slime integration's detached gloo backend has none) is known
    by its object: one that is gone must not lend its reports to a new group given its address
    on one rank only, or that rank would skip the "host report" exchange the others make, and
    every save on the new group would fail as cross-paired."""
    from tests.helpers.addresses import new_at_freed_address

    monkeypatch.setattr(cpu, "_group_reports", {})
    reports = _reports(("a", [range(16)] * 4, 64 * GiB))

    class Backend:  # no group_name, as a bare ProcessGroupGloo backend
        pass

    old = Backend()
    cpu.settle(safe_ckpt.SaveOptions(), _Coordinator(old, 0, reports))
    address = id(old)
    del old
    new = new_at_freed_address(address, Backend)
    if new is None:
        pytest.skip("this interpreter did not reuse the freed address")
    coord = _Coordinator(new, 0, reports)
    cpu.settle(safe_ckpt.SaveOptions(), coord)
    assert [stage for stage, _ in coord.exchanges] == ["host report"]


def test_checksum_threads_beside_the_writers_only_while_cores_are_spare(monkeypatch):
    from safe_ckpt.host import cpu

    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert cpu.checksum_threads(None, 8) == 8
    assert cpu.checksum_threads(None, 12) == 4
    assert cpu.checksum_threads(None, 16) == 0
    assert cpu.checksum_threads(None, 32) == 0
    assert cpu.checksum_threads(3, 16) == 3 and cpu.checksum_threads(0, 2) == 0
