"""The work budget of reading one untrusted `.metadata`: every costly operation charged to it.

One job: size a budget from the file (`budget_for`) and refuse the file, naming the operation,
once the unpickler and the checks after it have spent it (`WorkBudget.charge`). Must not:
decide what an operation costs (the unpickler charges what it does).
"""

from __future__ import annotations

from ...errors import UnreadableCheckpointError

# For a file of n bytes: BUDGET_PER_BYTE * n + BUDGET_BASE. Files written by stock DCP, stock Megatron
# and this library use under 1 per byte (`tests/format/test_restricted_reader_is_bounded.py` measures it); what is not
# charged (pushing values, memo entries) costs at most about 75 bytes of memory per byte of file.
BUDGET_PER_BYTE = 8
BUDGET_BASE = 1 << 22


def budget_for(size_bytes: int) -> int:
    return BUDGET_PER_BYTE * size_bytes + BUDGET_BASE


class WorkBudget:
    """Element operations left for reading one file (its unpickling and the checks after it)."""

    def __init__(self, path: str, size_bytes: int) -> None:
        self.path, self.size_bytes = path, size_bytes
        self.total = self.left = budget_for(size_bytes)

    @property
    def used(self) -> int:
        return self.total - self.left

    def charge(self, units: int, what) -> None:
        """Spend ``units``; past the budget, refuse the file. ``what`` (a string, or a callable or class
        whose call it is) names the operation in the message."""
        self.left -= units
        if self.left < 0:
            if not isinstance(what, str):
                what = f"a call of {getattr(what, '__qualname__', type(what).__name__)}"
            raise UnreadableCheckpointError(
                self.path, f"refused: building it copies or hashes more elements than a DCP metadata file of its "
                           f"size holds ({self.total} for {self.size_bytes} bytes; exceeded at {what}); not read "
                           f"further")
