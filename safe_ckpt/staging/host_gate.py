"""The host gate of an asynchronous save: the next optimizer step waits for the host sources.

One job: for an `async_save` whose sources include host memory (pinned or pageable tensors,
torch_memory_saver's CPU backup, an owner's host copy), open a copy window over exactly those
sources and track it, so that every torch optimizer step in the process (a global step pre-hook)
and `gates.before_update()` block until each host source's chunks are written. A fused CPU
optimizer step (`--optimizer-cpu-offload`) changes tensors without moving their version counters,
so only ordering, not detection, keeps such a save from mixing two steps' state.

Must not: copy, write or hash anything (the writers report each written chunk to the window), or
gate device sources (their bytes are in the pinned pool before `async_save` returns).
"""

from __future__ import annotations

from ..residence.classify import HOST_RESIDENCES
from . import gates
from .streams import HostStreams
from .window import CopyWindow, WindowSource


def open_host_gate(items, residences, sources, versions, *, name: str, rank: int,
                   timeout_s: float) -> CopyWindow | None:
    """The tracked window over the host sources of ``items`` (the rank's placed items), or None
    when it writes none. ``versions``: each source's version counter when the save planned it."""
    chunks, payload_bytes, keys = {}, {}, {}
    for item in items:
        chunk = item.chunk
        if chunk is None or residences[chunk.local_index] not in HOST_RESIDENCES:
            continue
        i = chunk.local_index
        chunks[i] = chunks.get(i, 0) + 1
        payload_bytes[i] = payload_bytes.get(i, 0) + chunk.payload_bytes
        keys[i] = chunk.fqn
    if not chunks:
        return None
    window = CopyWindow([WindowSource(index=i, key=keys[i], tensor=sources[i], device=None, chunks=chunks[i],
                                      size_bytes=payload_bytes[i], version=versions[i]) for i in sorted(chunks)],
                        HostStreams(), None, name=name, rank=rank, timeout_s=timeout_s)
    window.open()
    window.order_opening()  # no device sources: nothing is enqueued on a stream
    gates.track(window)
    return window
