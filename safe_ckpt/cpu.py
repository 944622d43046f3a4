"""How much of the host's CPU the save's threads take, and at what priority.

One job: decide how many hashing threads fit beside the writers, and lower a writer
thread's scheduling priority or keep it off some cores. Must not: start threads, or touch
the priority or cores of any thread but the calling one (a thread cannot get its priority
back without privileges).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

# Writer threads run this much nicer than the thread that started the save. On a host whose
# cores the writers fill (16 writers, 16 cores), the thread that issues the device copies
# otherwise waits for a core each time it wakes: a 9.23 GB async save to disk stalled
# 0.32 s (median of 3) with the writers at the caller's priority and 0.19 s with them 5
# nicer, time-to-durable 5.32 s against 5.22 s (H200, diag_ttd `safe_async_io16{,_nice5}`).
# The writes are background work beside a training loop too. Threads a writer starts (the
# hashing pool's workers, started on a writer's first submit) inherit it: they do the
# writers' work. 0: the writers' priority is left alone.
WRITER_NICE_INCREMENT = 5


# Writer threads keep off this many of the process's cores (the highest-numbered), so that
# the thread issuing the device copies finds an idle core. Measured, no help, so 0: on the
# same 9.23 GB async save to disk, sparing 1 / 2 cores stalled 0.32 / 0.37 s against 0.32 s,
# and sparing 1 slowed a tmpfs save from 0.37 to 0.41 s (H200, diag_ttd `*_spare1`); nicer
# writers (above) do what it was for. Where cores have two hardware threads the last logical
# CPUs may be siblings of the first, so sparing them need not free a whole core. Threads a
# writer starts inherit it; at least two cores are always left to them.
WRITER_SPARED_CPUS = 0


def spare_cpus(count: int) -> None:
    """Keep the calling thread off the last ``count`` of the cores it may run on (Linux: pid 0
    names the calling thread only). Leaves it alone where fewer than two cores would remain."""
    if count <= 0 or not hasattr(os, "sched_setaffinity"):
        return
    try:
        allowed = sorted(os.sched_getaffinity(0))
        if len(allowed) - count < 2:
            return
        os.sched_setaffinity(0, allowed[:-count])
    except OSError as exc:
        log.debug("safe_ckpt: writer cores unchanged: %s", exc)


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
        log.debug("safe_ckpt: writer priority unchanged: %s", exc)


def checksum_threads(asked: int | None, lanes: int) -> int:
    """Beside-the-writes hashing needs idle cores; where the writers take them all, hashing
    in the writer threads costs less than twice as many threads fighting for the cores (on a
    16-core H200 host, 16 writers + 16 hashers took 0.52 s where 16 writers without
    checksums took 0.40 s)."""
    if asked is not None:
        return asked
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    spare = cores - lanes
    return min(lanes, spare) if spare > 0 else 0
