"""How much of its host a rank's save takes: writer and hashing threads, the staging pool's
size, and the writers' priority.

One job: derive the defaults of `io_threads`, `staging_budget_bytes` and `checksum_threads`
from the cores and memory each rank of a host has (the rule is in `SaveOptions`' docstring),
decide how many hashing threads fit beside the writers, and lower a writer thread's
scheduling priority. Must not: start threads, read environment variables, or touch the
priority of any thread but the calling one (a thread cannot get its priority back without
privileges).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import sys
import threading
import weakref
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Writer threads run this much nicer than the thread that started the save: where the writers
# fill every core, the thread issuing the device copies otherwise waits for a core each time it
# wakes (figures: benchmarks/results/HISTORY.md). The writes are background work beside a
# training loop too. Threads a writer starts (the hashing pool's workers, started on a writer's
# first submit) inherit it: they do the writers' work. 0: the writers' priority is left alone.
WRITER_NICE_INCREMENT = 5


def lower_thread_priority(increment: int) -> None:
    """Make the calling thread nicer by ``increment`` (Linux: a thread id names one thread).
    A thread can never get its priority back without privileges: only threads that end
    with the save may call this, never the caller's."""
    if increment <= 0 or not sys.platform.startswith("linux"):  # elsewhere the id would name a process
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except OSError as exc:
        log.debug("writer priority unchanged: %s", exc)


def checksum_threads(asked: int | None, lanes: int, cores: int | None = None) -> int:
    """Beside-the-writes hashing needs idle cores; where the writers take them all, hashing
    in the writer threads costs less than twice as many threads fighting for the cores
    (benchmarks/results/HISTORY.md). ``cores``: the rank's share of its host's cores (default:
    every core this process may run on)."""
    if asked is not None:
        return asked
    if cores is None:
        cores = len(_allowed_cpus())
    spare = cores - lanes
    return min(lanes, spare) if spare > 0 else 0


# ------------------------------------------------------------------ defaults per rank
# A rank's default writers: its share of the host's cores, at most this many: more than 16
# was never seen to help one rank (benchmarks/results/HISTORY.md).
MAX_DEFAULT_IO_THREADS = 16
# A rank's default staging pool: 1/STAGING_MEMORY_DIVISOR of its share of the host's
# available memory, at most MAX_DEFAULT_STAGING_BYTES (the pool is pinned: memory the
# kernel can never reclaim while training runs), rounded down to whole MiB.
MAX_DEFAULT_STAGING_BYTES = 2 << 30
STAGING_MEMORY_DIVISOR = 16

_MEMINFO = "/proc/meminfo"
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_CGROUP_V2 = "/sys/fs/cgroup"
_CGROUP_V1 = "/sys/fs/cgroup/memory"


@dataclass(frozen=True)
class HostReport:
    """What one rank tells the others, once, about the machine it runs on."""

    host: str  # equal on every rank of one machine: its kernel's boot id (shared by containers), else hostname
    cpus: tuple  # the cores this process may run on
    memory_bytes: int | None  # memory still available to this process: MemAvailable, bounded by its cgroup


@dataclass(frozen=True)
class RankShare:
    """One rank's part of its host, from every rank's report."""

    local_ranks: int  # ranks of the save on this rank's host, itself included
    core_share: float  # cores this rank may use, each split evenly among the local ranks that may use it
    memory_share_bytes: int | None  # this rank's available memory divided by the local ranks (None: unknown)


def _allowed_cpus() -> tuple:
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _stat_field(text: str | None, name: str) -> int:
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return int(value)
    return 0


def _cgroup_available_bytes() -> int | None:
    """The memory this process's cgroup may still take (its limit less what it holds, page cache
    that could be dropped counted as free), or None where no limit is set or readable."""
    for limit_file, usage_file, stat_file, inactive in (
        (f"{_CGROUP_V2}/memory.max", f"{_CGROUP_V2}/memory.current", f"{_CGROUP_V2}/memory.stat", "inactive_file"),
        (f"{_CGROUP_V1}/memory.limit_in_bytes", f"{_CGROUP_V1}/memory.usage_in_bytes", f"{_CGROUP_V1}/memory.stat",
         "total_inactive_file"),
    ):
        limit, usage = _read(limit_file), _read(usage_file)
        if limit is None or usage is None or not limit.strip().isdigit():
            continue  # "max": no limit at this level
        limit_bytes = int(limit)
        if limit_bytes >= 1 << 60:  # cgroup v1 writes "no limit" as a huge number
            return None
        free = limit_bytes - int(usage) + _stat_field(_read(stat_file), inactive)
        return max(0, min(limit_bytes, free))
    return None


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo, bounded by the cgroup's room; None where neither is readable."""
    meminfo = _read(_MEMINFO)
    available = None
    for line in (meminfo or "").splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    cgroup = _cgroup_available_bytes()
    known = [v for v in (available, cgroup) if v is not None]
    return min(known) if known else None


def host_report() -> HostReport:
    boot_id = (_read(_BOOT_ID) or "").strip()
    return HostReport(f"boot:{boot_id}" if boot_id else f"host:{socket.gethostname()}", _allowed_cpus(),
                      available_memory_bytes())


def rank_share(reports: list, rank: int) -> RankShare:
    """``reports``: every rank's `HostReport`, in rank order. Ranks bound to disjoint cores
    (a launcher's binding) each keep theirs; ranks that may all run anywhere split the host."""
    me = reports[rank]
    local = [r for r in reports if r.host == me.host]
    users: dict = {}
    for r in local:
        for c in r.cpus:
            users[c] = users.get(c, 0) + 1
    share = sum(1.0 / users[c] for c in me.cpus)
    memory = None if me.memory_bytes is None else me.memory_bytes // len(local)
    return RankShare(len(local), share, memory)


def default_io_threads(share: RankShare) -> int:
    # A small tolerance: 16 cores shared three ways are 5.333..., and 6 cores two ways exactly 3.
    return max(1, min(MAX_DEFAULT_IO_THREADS, math.floor(share.core_share + 1e-9)))


def default_staging_budget_bytes(share: RankShare, chunk_bytes: int) -> int:
    budget = MAX_DEFAULT_STAGING_BYTES
    if share.memory_share_bytes is not None:
        budget = min(budget, share.memory_share_bytes // STAGING_MEMORY_DIVISOR)
    return max(chunk_bytes, budget // (1 << 20) * (1 << 20))


def resolve(options, reports: list, rank: int):
    """``options`` with `io_threads`, `staging_budget_bytes` and `checksum_threads` filled in
    where left None. `io_threads` is the fewest any rank's share gives, so that every rank
    plans with the same value; the pool and the hashing threads are each rank's own."""
    shares = [rank_share(reports, r) for r in range(len(reports))]
    mine = shares[rank]
    io_threads = options.io_threads
    if io_threads is None:
        io_threads = min(default_io_threads(s) for s in shares)
    budget = options.staging_budget_bytes
    if budget is None:
        budget = default_staging_budget_bytes(mine, options.chunk_bytes)
    hashers = options.checksum_threads
    if hashers is None:
        hashers = checksum_threads(None, io_threads, cores=math.floor(mine.core_share + 1e-9))
    resolved = dataclasses.replace(options, io_threads=io_threads, staging_budget_bytes=budget,
                                   checksum_threads=hashers)
    if resolved != options:
        log.debug("rank %d of %d on its host (%.1f cores, %.1f GiB available to it): io_threads %d, "
                  "staging_budget_bytes %d, checksum_threads %d", rank, mine.local_ranks, mine.core_share,
                  (mine.memory_share_bytes or 0) / 2**30, io_threads, budget, hashers)
    return resolved


_reports_lock = threading.Lock()
_own_report: list = []  # this process's report, read once: the pool it sizes lowers MemAvailable later
_group_reports: dict = {}  # (group name, world size) -> every rank's report
# An unnamed group (the slime asleep save's detached backend) is keyed by the object, held
# weakly: keyed by its address, a new group given a dead one's address on one rank only would
# skip the exchange there while the others made it.
_unnamed_reports = weakref.WeakKeyDictionary()


def settle(options, coord):
    """`resolve` for a save on ``coord`` (a `dist.Coordinator`). Every rank's report is exchanged
    once per group, at the group's first save, whatever the options, so that ranks whose
    options differ still meet in the same collectives (and the plan exchange then names the
    option that differs)."""
    with _reports_lock:
        if not _own_report:
            _own_report.append(host_report())
        own = _own_report[0]
        try:
            name = getattr(coord.group, "group_name", None)
        except RuntimeError:  # a group torch never registered (a detached gloo group) raises for its name
            name = None
        cache, key = ((_group_reports, (name, coord.world_size)) if name or coord.group is None
                      else (_unnamed_reports, coord.group))
        reports = cache.get(key)
    if reports is None:
        reports = coord.exchange("host report", own) if coord.distributed else [own]
        with _reports_lock:
            cache[key] = reports
    return resolve(options, reports, coord.rank)
