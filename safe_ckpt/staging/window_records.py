"""The frozen records a copy window takes and gives: its sources, a group of whole sources copied
together, and its statistics.

One job: hold these values between the window (`window`), its copier and the save's handle.
Must not: hold behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class WindowSource:
    index: int  # the source's local index in the rank's plan
    key: str  # its fqn, for errors
    tensor: torch.Tensor
    device: Optional[int]  # the copy stream's device; None: host-resident (captured by the host)
    chunks: int  # chunks to copy or capture
    size_bytes: int
    version: int  # the tensor's version counter when the save planned it


@dataclass(frozen=True)
class WindowChunk:
    index: int  # the source's index
    size_bytes: int


@dataclass(frozen=True)
class WindowStats:
    gates: int  # gates met while the window was open
    blocked_gates: int  # of them, those that blocked the host
    gate_wait_s: float  # host time spent blocked in gates
    open_s: float  # from open() until settled (or until now)
    copied_bytes: int  # device bytes whose copies were issued
    captured_bytes: int  # host bytes snapshotted or written
    pending_bytes: int  # bytes neither issued nor captured yet
    opening_held: bool = False  # the opener's streams were held while the staging thread opened the window
