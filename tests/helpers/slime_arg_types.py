"""Argument types a slime program may keep in its args beyond megatron-core's safe globals (its
enums, small config records), importable in the Ray actors that unpickle those args: what the
common state of the program's own checkpoints then holds (tests/integrations/test_slime_load_through_safe_ckpt.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RolloutMode(enum.Enum):
    SYNC = "sync"
    ASYNC = "async"


@dataclass(frozen=True)
class RewardSpec:
    name: str
    weight: float


class NotInTheLoadersArgs:
    """A class only the saving program's args held: the loading program has no value of it."""

    def __init__(self, note: str = "saved by another program") -> None:
        self.note = note
