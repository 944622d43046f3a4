"""Hand staged items to whichever writer thread is free, one writer per file at a time.

One job: keep the staged items in staging order and give each writer that asks the first
one whose file no other writer is writing, and say when a file's last item is done (so
that writer syncs and closes it). Any writer may take any file's items: a writer bound to
its own files idles while a slower one still has work (benchmarks/results/HISTORY.md).
One file is never given to two writers at once: the kernel serializes writes to one
file (the inode lock), so the second would only wait.

Call order: the staging thread calls `put` for every item and then `close`; each writer
loops on `take` (None: nothing is left) and calls `done` after each item it took.
Must not: touch bytes, files or devices.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Entry:
    file_index: int
    payload: Any  # what the writer needs (the pipeline's item and staged bytes)


class Dispatch:
    def __init__(self, items_per_file: list[int]) -> None:
        self._left = list(items_per_file)  # items of each file not yet done
        self._busy = [False] * len(items_per_file)
        self._pending: deque[Entry] = deque()
        self._closed = False
        self._cond = threading.Condition()

    def put(self, file_index: int, payload: Any) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("dispatch is closed")
            if self._left[file_index] <= 0:
                raise ValueError(f"file {file_index} has no items left to put")
            self._pending.append(Entry(file_index, payload))
            self._cond.notify()

    def close(self) -> None:
        """No more items: writers drain what is pending, then `take` returns None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def take(self) -> Entry | None:
        """The first pending entry whose file is idle (waiting while there is none); marks
        that file busy until `done`. None once closed and nothing is pending."""
        with self._cond:
            while True:
                for k, entry in enumerate(self._pending):
                    if not self._busy[entry.file_index]:
                        del self._pending[k]
                        self._busy[entry.file_index] = True
                        return entry
                if self._closed and not self._pending:
                    return None
                self._cond.wait()

    def done(self, entry: Entry) -> bool:
        """The writer finished ``entry``; True if it was its file's last item."""
        with self._cond:
            self._busy[entry.file_index] = False
            self._left[entry.file_index] -= 1
            self._cond.notify_all()
            return self._left[entry.file_index] == 0
