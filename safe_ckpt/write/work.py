"""What one rank's write phase is given (`RankWork`) and what it reports (`WriteStats`).

One job: hold these records. Must not: do anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..encoding.layout import RankLayout
from ..integrity import ItemChecksum


@dataclass(frozen=True)
class RankWork:
    layout: RankLayout
    sources: list[torch.Tensor]  # by ShardRef.local_index
    residences: list[str]
    versions: list[int]  # each source's version counter when the save began
    object_payloads: dict[str, bytes]
    whole_files: dict[str, bytes]  # small files written in one piece (e.g. common.pt)


@dataclass(frozen=True)
class WriteStats:
    payload_bytes: int
    file_bytes: int
    bytes_by_residence: dict[str, int]
    device_bytes: int
    staged_s: float  # from start until every device payload was in host memory
    written_s: float  # from start until every file was durable
    files: list[str]
    checksums: list[ItemChecksum]  # empty unless checksums were asked for
    file_digests: dict[str, str]  # SHA-256 of each file written, for integrity.json (empty unless asked for)
