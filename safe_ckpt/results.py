"""What a save reports back: sizes, where bytes came from, files and timings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SaveTimings:
    """Seconds on this rank. ``plan_s``: from the call until its writers started; ``write_s``:
    from then until its files were durable; ``commit_s``: from every rank's write vote to the
    end; ``stall_s``: how long the caller was blocked (all of it for `save`)."""

    plan_s: float
    stall_s: float
    write_s: float
    commit_s: float
    total_s: float


@dataclass(frozen=True)
class SaveResult:
    """One rank's account of a save. `payload_bytes` and `total_file_bytes` cover the sharded items
    (`ShardedTensor`, `ShardedObject`) in the data files (`__<rank>_<n>.distcp`), not the common
    state (`common.pt`: everything else, plain tensors included, as stock Megatron stores it)."""

    checkpoint_dir: str
    rank: int
    world_size: int
    payload_bytes: int  # tensor and object bytes this rank wrote
    file_bytes: int  # bytes of this rank's files, containers included (and the whole files it wrote, e.g. common.pt)
    total_file_bytes: int  # all ranks' data files together, containers included
    bytes_by_residence: dict[str, int]
    files: list[str]
    items: int
    timings: SaveTimings
    staging_pool_allocations: int = 0  # times the pinned pool was allocated during this save
    extra: dict = field(default_factory=dict)

    @property
    def throughput_bytes_per_s(self) -> float:
        return self.total_file_bytes / self.timings.total_s if self.timings.total_s > 0 else 0.0
