"""What one rank's read did: the counts its reader threads keep, and the report a load hands back.

One job: tally the reader threads' counts under a lock and turn them into a `ReadReport` (and its
log line). Must not: read, plan or talk to other ranks.
"""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass

log = logging.getLogger("safe_ckpt")


@dataclass(frozen=True)
class ReadReport:
    bytes_read: int
    items: int
    verified: int  # items whose checksum matched
    unverified: int  # items read in part (resharded), or with no checksum recorded
    decoded: int  # items decoded with torch.load (not the standard archive)
    threads: int
    seconds: float
    # summed over the threads: in read calls; waiting for pool memory, a piece's earlier copy or the
    # last copies; hashing (with, for an item read in pieces, the wait for the pieces before it)
    read_s: float = 0.0
    wait_s: float = 0.0
    hash_s: float = 0.0
    copy_s: float = 0.0  # issuing the copies out of pieces (host destinations: making them)
    cpu_s: float = 0.0  # the threads' CPU time (kernel time in reads included; not the GIL waits)
    check_s: float = 0.0  # after the threads: comparing the device-summed items (waiting for the sums included)


class Tally:
    """The reader threads' running counts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts = dict(items=0, verified=0, unverified=0, decoded=0, nbytes=0, read_s=0.0, wait_s=0.0,
                           hash_s=0.0, copy_s=0.0, cpu_s=0.0, check_s=0.0)

    def add(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                self.counts[k] += v

    def report(self, threads: int, seconds: float) -> ReadReport:
        with self._lock:
            c = dict(self.counts)
        return ReadReport(c["nbytes"], c["items"], c["verified"], c["unverified"], c["decoded"], threads, seconds,
                          c["read_s"], c["wait_s"], c["hash_s"], c["copy_s"], c["cpu_s"], c["check_s"])


def log_read(report: ReadReport, where: str, rank: int) -> None:
    if not report.items:
        return
    rate = report.bytes_read / report.seconds / 2**30 if report.seconds > 0 else math.inf
    log.info("rank %d read %.3f GiB of %s in %.3f s (%.2f GiB/s, %d threads): %d items, %d checksums "
             "verified, %d unverified, %d decoded by torch.load; threads spent %.3f s reading, %.3f s waiting "
             "for copies or pool memory, %.3f s hashing, %.3f s issuing copies; then %.3f s comparing the device "
             "sums", rank, report.bytes_read / 2**30,
             where, report.seconds, rate, report.threads, report.items, report.verified, report.unverified,
             report.decoded, report.read_s, report.wait_s, report.hash_s, report.copy_s, report.check_s)
