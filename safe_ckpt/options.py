"""SaveOptions: the one place every tunable of a save lives.

One job: hold validated settings with sensible defaults. Must not: read environment
variables (that happens at the edges: CLI and integrations) or touch devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .errors import ValidationError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

UNMAPPED_POLICIES = ("error", "cpu_backup")
REPLACE_POLICIES = ("checkpoint", "any", "never")
RETURN_AFTER = ("staged", "planned")


@dataclass(frozen=True)
class SaveOptions:
    """Settings of one save; every rank of a collective save should pass equal options
    (ranks whose `chunk_bytes` or `io_threads` differ are refused: the plan depends on them).

    chunk_bytes: largest payload of one stored item; bigger shards are split into
        several chunks (each a standalone torch.save archive). Bounds loader memory too.
    io_threads: writer threads per rank; each rank writes two files of equal bytes per writer,
        and any free writer writes the next staged item of a file no other writer is writing.
        None (default): the rank's share of its host's cores, within [1, 16], the fewest any
        rank of the save gets (every rank must plan with the same value). A rank's share
        counts each core it may run on (its CPU affinity) as 1/k, k being the ranks of the
        save on the same machine that may run on it: 8 ranks free to use all 16 cores get 2
        each; 8 ranks bound to 14 cores apiece get 14. Ranks on one machine are those whose
        kernel boot id (else hostname) is the same; every rank tells the others its own once,
        at the first save on a process group (one small exchange).
    fsync: make every file durable before the checkpoint is published.
    staging_budget_bytes: size of the process-wide pinned staging pool, allocated once
        on first use and reused by later saves. Device-resident bytes beyond it are
        staged as earlier chunks finish writing. None (default): 1/16 of the rank's share of
        its host's available memory (MemAvailable, bounded by the cgroup's limit, read once
        per process, divided by the ranks of the save on that machine), at most 2 GiB, at
        least `chunk_bytes`: 8 ranks on a host with 2 TiB available get 2 GiB each, on one
        with 128 GiB 1 GiB each. For `async_save` to return after the device-to-host copy
        alone, set it to at least the rank's GPU bytes.
    collective_timeout_s: how long a rank waits for its peers in any coordination step
        (applies to the gloo group safe_ckpt creates; a caller's group keeps its own).
    zip_crc32: compute the zip CRC-32 of every payload (stock readers do not check it).
    checksums: record a checksum (xxh3-64, or CRC-32 without the xxhash package) of every
        stored item in the sidecar manifest (`safe_ckpt_manifest.json`, ignored by stock
        loaders) for `safe-ckpt verify`.
    checksum_threads: threads that compute the checksums beside the writers; 0 computes each
        one in its writer thread, 2 MiB at a time just before writing it (no extra threads, and
        the write reads bytes the hash just brought into cache); None (default) uses as many
        threads as writers while the rank's share of cores (see `io_threads`) has cores to
        spare, and 0 once the writers alone use every core of it.
    device_checksums: checksum GPU-resident chunks of 8 MiB or more on their device: row and
        column sums of the payload's 32-bit words, computed on the copy stream and folded with
        the host algorithm (`grid32+xxh3_64` in the manifest; see `safe_ckpt.integrity`), so
        the host CPU does not read those bytes a second time. False hashes everything on the host.
    integrity_manifest: also write Megatron's `integrity.json` (megatron-core >= 0.18
        `--verify-integrity`): the SHA-256 of every file of the checkpoint, computed from the
        bytes as the writers write them, so stock `load(..., verify_integrity=True)` accepts
        the checkpoint. Costs one SHA-256 pass over the bytes, spread over the writer (and
        checksum) threads; set by the Megatron adapter from `args.verify_integrity`.
    unmapped_policy: "error" refuses tensors whose device memory is paused; "cpu_backup"
        reads their bytes from torch_memory_saver's CPU backup where one exists.
    replace: what may already be at the target: "checkpoint" (default) atomically
        replaces a complete torch_dist checkpoint (re-saving an iteration) and refuses a
        directory holding anything else (foreign or half-written); "any" replaces whatever
        is there; "never" refuses any non-empty target.
    progress_interval_s: period of progress log lines for long saves (0 disables).
    gc_freeze: during the save, keep Python's cyclic garbage collector off the objects that
        existed when it began (`gc.freeze()`, undone when the save ends), so collections the
        save's own allocations trigger do not walk the whole training process's heap. In a
        process that freezes objects itself (before or during a save), its freeze is left
        alone and the collector's oldest generation is held off for the save instead.
    writer_nice: how much nicer than the saving thread the writer threads run (their own
        threads only: the caller's priority never changes). None uses the measured default,
        `cpu.WRITER_NICE_INCREMENT` (5); 0 leaves them at the caller's priority.
    sink_factory: builds the byte sink for a staging directory, or wraps the kvstore sink
        (tests inject faults here); None means the POSIX (or kvstore) sink.
    kvstore_spec: a TensorStore kvstore spec (e.g. {"driver": "gcs", "bucket": "b"}); the
        checkpoint directory is then a path inside it. A checkpoint directory written as a
        URL ("file:///...", "gs://...", "memory://...") selects the kvstore sink too. For an
        S3-compatible store at its own endpoint (MinIO, Ceph RGW): {"driver": "s3", "bucket": B,
        "endpoint": "http://host:port", "aws_region": "us-east-1"}
        (`safe_ckpt.sinks.tensorstore.resolve_target` builds it from an `s3://` URL and an endpoint).
    kvstore_request_timeout_s: the most one kvstore request may take (one value of up to
        chunk_bytes, a listing, a delete), TensorStore's own retries included; past it the
        request is cancelled and the save fails with `WriteError` on every rank. An unreachable
        or dead store therefore fails a save within about this time. Raise it where a value of
        chunk_bytes takes longer to upload.
    kvstore_save_timeout_s: the most all of a save's kvstore requests may take together, from
        planning to publication (None: no bound beyond each request's; a save's time grows
        with its bytes, so set it from the expected size).
    return_after: when `async_save` returns. "staged" (default): once every device byte is in
        the pinned pool. "planned": right after planning; the device-to-host copies then run on
        a side stream while training goes on, and every `torch.optim` optimizer step in the
        process (a global step pre-hook), `SaveHandle.before_update()` / `safe_ckpt.before_update()`
        and torch_memory_saver's `pause` wait for the bytes they would change (a stream wait once
        every copy is issued; the host waits only while the pool is too small or host sources are
        being snapshotted). A write to a saved tensor that none of these orders (a `.data` write,
        another stream) fails the save with `SourceModifiedError`. Zero stall needs
        `staging_budget_bytes` >= the rank's saved bytes (device + host). Gates wait at most
        `collective_timeout_s`, then the save is abandoned (`StagingTimeoutError`).
    safe_globals: classes, beyond torch's own, megatron-core's safe globals and those registered
        with `torch.serialization.add_safe_globals`, that the common state and the ShardedObjects
        may hold. The save refuses, before writing anything, state the loaders' weights-only
        unpickler would refuse; pass here only classes every loading process admits too
        (`LoadOptions.safe_globals`, or `add_safe_globals` there).
    """

    chunk_bytes: int = 64 * MiB
    io_threads: Optional[int] = None
    fsync: bool = True
    staging_budget_bytes: Optional[int] = None
    collective_timeout_s: float = 600.0
    zip_crc32: bool = False
    checksums: bool = True
    checksum_threads: Optional[int] = None
    device_checksums: bool = True
    integrity_manifest: bool = False
    unmapped_policy: str = "error"
    replace: str = "checkpoint"
    progress_interval_s: float = 10.0
    gc_freeze: bool = True
    writer_nice: Optional[int] = None
    sink_factory: Optional[Callable] = None
    kvstore_spec: Optional[dict] = None
    kvstore_request_timeout_s: float = 30.0
    kvstore_save_timeout_s: Optional[float] = None
    return_after: str = "staged"
    safe_globals: tuple = ()

    def __post_init__(self) -> None:
        problems = []
        if not (4 * KiB <= self.chunk_bytes <= 2 * GiB):
            problems.append(f"chunk_bytes={self.chunk_bytes} must be within [4 KiB, 2 GiB]")
        if self.io_threads is not None and not (1 <= self.io_threads <= 256):
            problems.append(f"io_threads={self.io_threads} must be None or within [1, 256]")
        if self.staging_budget_bytes is not None and self.staging_budget_bytes < self.chunk_bytes:
            problems.append(
                f"staging_budget_bytes={self.staging_budget_bytes} must be at least chunk_bytes={self.chunk_bytes}"
            )
        if self.checksum_threads is not None and not (0 <= self.checksum_threads <= 256):
            problems.append(f"checksum_threads={self.checksum_threads} must be None or within [0, 256]")
        if not self.collective_timeout_s > 0:
            problems.append(f"collective_timeout_s={self.collective_timeout_s} must be positive")
        if not self.kvstore_request_timeout_s > 0:
            problems.append(f"kvstore_request_timeout_s={self.kvstore_request_timeout_s} must be positive")
        if self.kvstore_save_timeout_s is not None and not self.kvstore_save_timeout_s > 0:
            problems.append(f"kvstore_save_timeout_s={self.kvstore_save_timeout_s} must be None or positive")
        if self.replace not in REPLACE_POLICIES:
            problems.append(f"replace={self.replace!r} must be one of {REPLACE_POLICIES}")
        if self.unmapped_policy not in UNMAPPED_POLICIES:
            problems.append(f"unmapped_policy={self.unmapped_policy!r} must be one of {UNMAPPED_POLICIES}")
        if self.writer_nice is not None and (type(self.writer_nice) is not int or not 0 <= self.writer_nice <= 19):
            problems.append(f"writer_nice={self.writer_nice!r} must be None or an int within [0, 19]")
        if self.return_after not in RETURN_AFTER:
            problems.append(f"return_after={self.return_after!r} must be one of {RETURN_AFTER}")
        if not isinstance(self.safe_globals, (tuple, list)) or not all(isinstance(c, type) or callable(c)
                                                                        for c in self.safe_globals):
            problems.append("safe_globals must be a tuple of classes")
        if self.progress_interval_s < 0:
            problems.append(f"progress_interval_s={self.progress_interval_s} must be >= 0")
        if problems:
            raise ValidationError("invalid SaveOptions: " + "; ".join(problems))


def checked(options, default=None) -> "SaveOptions":
    """``options`` where it is a `SaveOptions`, ``default`` (else a fresh one) where it is None;
    anything else is refused at once, naming the class a save takes."""
    if options is None:
        return default if default is not None else SaveOptions()
    if not isinstance(options, SaveOptions):
        raise TypeError(f"a save takes safe_ckpt.SaveOptions, not {type(options).__name__}"
                        + (" (LoadOptions are for safe_ckpt.load)" if type(options).__name__ == "LoadOptions" else ""))
    return options
