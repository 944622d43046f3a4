"""The sink interface: put bytes at known offsets of named files, then make them durable.

Call order, per save: the pipeline calls `open(name, size_bytes)` once per data file
(each file is then used by one thread at a time, not always the same one), `write_at` any number of times with
non-overlapping ranges in any order, `sync()` once all its bytes are written, then
`close()` (a sink whose files are whole values, with ``one_item_per_file``, takes exactly
one `write_at` at offset 0 per file). `write_file` writes a whole small file (metadata, common state) and makes it
durable. `sync_root()` makes the directory entries durable, after every file is synced.
A sink must raise `OSError` (or a `CheckpointError`) on any failure and never return
short. Sinks know nothing about tensors or checkpoints.
"""

from __future__ import annotations

from typing import Protocol, Sequence, Union

Buffer = Union[bytes, bytearray, memoryview]


class SinkFile(Protocol):
    def write_at(self, offset_bytes: int, buffers: Sequence[Buffer]) -> None: ...

    def sync(self) -> None: ...

    def close(self) -> None: ...


class Sink(Protocol):
    root: str

    def open(self, relative_path: str, size_bytes: int) -> SinkFile: ...

    def write_file(self, relative_path: str, data: bytes) -> None: ...

    def sync_root(self) -> None: ...
