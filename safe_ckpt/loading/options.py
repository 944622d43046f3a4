"""LoadOptions: every tunable of a load, validated.

One job: hold the settings of `safe_ckpt.load` with defaults that need no tuning. Must not:
read environment variables (the edges do: the Megatron adapter reads its args) or touch devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import ValidationError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class LoadOptions:
    """Settings of one load; ranks may differ (each reads only what it needs).

    io_threads: reader threads per rank. None (default): the rank's share of its host's cores,
        within [1, 16], by the rule `SaveOptions.io_threads` states.
    verify_checksums: where the checkpoint has safe_ckpt's manifest (`safe_ckpt_manifest.json`),
        check every item that is read whole against its recorded checksum on the way, and fail
        the load naming the file, key and rank on a mismatch. An item only part of which this rank
        needs (a resharded load) is not read whole and so not checked; `safe-ckpt verify` checks
        everything. Checkpoints without a manifest (stock-written) load unchecked, as stock does.
    staging_budget_bytes: size of the process-wide pinned pool that GPU destinations are read
        through (the one saves use: None gives the same default, so a save and a load share one
        pool). Each reader thread takes two pieces of it.
    piece_bytes: the most one read through the pinned pool moves at a time (a bigger item goes
        in pieces, so reads and host-to-device copies overlap).
    batch_bytes: items smaller than this that lie back to back in one file are read with one
        system call (and their small reads share one piece of the pool); items bound for the GPU
        that fit a piece are gathered into one read of one piece whatever their size.
    collective_timeout_s: how long a rank waits for its peers in a coordination step (the gloo
        group safe_ckpt creates; a caller's group keeps its own).
    safe_globals: classes, beyond megatron-core's own safe globals, that the common state and
        the ShardedObjects may hold (`torch.load(weights_only=True)` refuses anything else, and
        the error names the class).
    kvstore_spec: a TensorStore kvstore spec (e.g. {"driver": "s3", "bucket": B, "endpoint": URL});
        the checkpoint directory is then a path inside it. A directory written as a URL
        ("s3://", "gs://", "file://", "memory://") is read through TensorStore too.
    kvstore_request_timeout_s: the most one kvstore read may take, TensorStore's own retries
        included; past it the load fails on every rank with `ReadError`.
    progress_interval_s: period of each rank's progress log lines during a long read (0: none).
    gc_freeze: during the load, keep Python's cyclic garbage collector off the objects that
        existed when it began, as `SaveOptions.gc_freeze` does for a save (a load of many shards
        allocates tens of objects per shard; each collection that triggers would walk the whole
        heap of a training process).
    on_read: called on each rank with its `ReadReport` (bytes, items, checksums verified, time)
        once its reads are done (benchmarks, monitoring); None: the report is only logged.
    """

    io_threads: Optional[int] = None
    verify_checksums: bool = True
    staging_budget_bytes: Optional[int] = None
    piece_bytes: int = 8 * MiB
    batch_bytes: int = 1 * MiB
    collective_timeout_s: float = 600.0
    safe_globals: tuple = ()
    kvstore_spec: Optional[dict] = None
    kvstore_request_timeout_s: float = 30.0
    progress_interval_s: float = 10.0
    gc_freeze: bool = True
    on_read: Optional[Callable] = None

    def __post_init__(self) -> None:
        problems = []
        if self.io_threads is not None and not (1 <= self.io_threads <= 256):
            problems.append(f"io_threads={self.io_threads} must be None or within [1, 256]")
        if not (64 * KiB <= self.piece_bytes <= 1 * GiB):
            problems.append(f"piece_bytes={self.piece_bytes} must be within [64 KiB, 1 GiB]")
        if not (0 <= self.batch_bytes <= self.piece_bytes):
            problems.append(f"batch_bytes={self.batch_bytes} must be within [0, piece_bytes]")
        if self.staging_budget_bytes is not None and self.staging_budget_bytes < 2 * self.piece_bytes:
            problems.append(f"staging_budget_bytes={self.staging_budget_bytes} must hold at least two pieces "
                            f"(2 x piece_bytes={self.piece_bytes})")
        if not self.collective_timeout_s > 0:
            problems.append(f"collective_timeout_s={self.collective_timeout_s} must be positive")
        if not self.kvstore_request_timeout_s > 0:
            problems.append(f"kvstore_request_timeout_s={self.kvstore_request_timeout_s} must be positive")
        if self.progress_interval_s < 0:
            problems.append(f"progress_interval_s={self.progress_interval_s} must be >= 0")
        if not isinstance(self.safe_globals, (tuple, list)):
            problems.append("safe_globals must be a tuple of classes")
        if problems:
            raise ValidationError("invalid LoadOptions: " + "; ".join(problems))


def checked(options, default=None) -> "LoadOptions":
    """``options`` where it is a `LoadOptions`, ``default`` (else a fresh one) where it is None;
    anything else is refused at once, naming the class a load takes."""
    if options is None:
        return default if default is not None else LoadOptions()
    if not isinstance(options, LoadOptions):
        raise TypeError(f"a load takes safe_ckpt.LoadOptions, not {type(options).__name__}"
                        + (" (SaveOptions are for saves)" if type(options).__name__ == "SaveOptions" else ""))
    return options
