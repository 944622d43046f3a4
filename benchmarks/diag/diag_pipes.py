"""The device-to-host pipelines diag_ttd measures beside safe_ckpt's saves (GPU machine):
``_d2h`` (the bare copy into one pinned buffer), ``_pipeline`` (one stream, lanes that write
each copy as it lands, from one buffer as large as the state) and ``_ring`` (a stream and a few
reused slots per lane). Each returns its seconds and removes what it wrote; none of them
checks the bytes (the save cases and the bench's round trip do).
"""

from __future__ import annotations

import os
import shutil
import time

import torch

from safe_ckpt_lab.bench.ceilings import copy_to_host, run_lanes
from safe_ckpt.integrity import checksum_of
from safe_ckpt.staging.views import host_memoryview

MiB = 1 << 20


def fresh(target: str) -> str:
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    return target


def pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    while len(buf):
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n


def run_guarded(lane_fn, lanes: int) -> float:
    """``run_lanes``, but a lane's failure fails the case instead of vanishing with its thread."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            lane_fn(i)
        except BaseException as e:
            errors.append(e)

    dt = run_lanes(guarded, lanes)
    if errors:
        raise errors[0]
    return dt


def d2h(sources: list[torch.Tensor], pinned: torch.Tensor, stream) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    copy_to_host(sources, pinned, stream)
    return time.perf_counter() - t0


def pipeline(target: str, sources: list[torch.Tensor], pinned: torch.Tensor, stream, lanes: int,
              piece: int | None, checksum: bool = False, container: bool = False, grid: bool = False) -> float:
    """Chunks of <= 256 MiB dealt round robin to lanes; copies issued per chunk (piece=None)
    or per piece, round robin over the lanes' current chunks; each lane writes as copies land.
    ``checksum``: each lane hashes what it writes (xxh3) just before writing it; ``container``:
    each write gets a freshly built torch.save prefix and suffix around it, in one pwritev
    (what safe_ckpt adds per item, without its bookkeeping); ``grid``: the device grid sums of
    every piece computed on the copy stream and copied to the host before it (device checksums)."""
    from safe_ckpt.encoding import torchzip
    from safe_ckpt.integrity import grid_sums

    chunks, off = [], 0
    for s in sources:
        flat = s.view(-1).view(torch.uint8)
        for start in range(0, flat.numel(), 256 * MiB):
            part = flat[start:start + 256 * MiB]
            chunks.append((part, off))
            off += part.numel()
    per_lane = [chunks[i::lanes] for i in range(lanes)]
    work = [[] for _ in range(lanes)]  # lane -> [(event, host view, file offset)]
    d = fresh(target)
    # one reused pinned buffer per lane, big enough for a 256 MiB piece (the sums are not checked here)
    sums_host = [torch.empty(256 * MiB // 4096 + 1024, dtype=torch.int32, pin_memory=True) for _ in range(lanes)] \
        if grid else []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        step = piece or 256 * MiB
        cursors = [[(c, o, 0) for c, o in lane] for lane in per_lane]
        file_off = [0] * lanes
        while any(cursors):
            for lane in range(lanes):
                if not cursors[lane]:
                    continue
                part, off, done = cursors[lane][0]
                n = min(step, part.numel() - done)
                host = pinned[off + done:off + done + n]
                if grid:
                    sums = grid_sums(part[done:done + n])
                    sums_host[lane][:sums.numel()].copy_(sums, non_blocking=True)
                host.copy_(part[done:done + n], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
                work[lane].append((ev, host_memoryview(host), file_off[lane]))
                file_off[lane] += n
                if done + n >= part.numel():
                    cursors[lane].pop(0)
                else:
                    cursors[lane][0] = (part, off, done + n)

    def lane_fn(i: int) -> None:
        fd = os.open(os.path.join(d, f"f{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            extra = 0
            for ev, mv, fo in work[i]:
                ev.synchronize()
                if checksum:
                    checksum_of([mv])
                if container:
                    c = torchzip.tensor_container(torch.uint8, (len(mv),))
                    os.pwritev(fd, [c.prefix, mv, c.suffix()], fo + extra)
                    extra += c.total_bytes - len(mv)
                else:
                    os.pwrite(fd, mv, fo)
            os.fsync(fd)
        finally:
            os.close(fd)

    try:
        run_guarded(lane_fn, lanes)
        return time.perf_counter() - t0  # from before the first copy was issued
    finally:
        shutil.rmtree(d, ignore_errors=True)


def ring(target: str, sources: list[torch.Tensor], ring: torch.Tensor, lanes: int, slot_bytes: int,
          slots: int) -> float:
    """Each lane copies its share of the state device-to-host on a stream of its own into
    ``slots`` reused pinned slots of ``slot_bytes`` and writes each slot as its copy lands, then
    reuses it: a staging ring small enough (lanes x slots x slot_bytes) that the bytes a writer
    reads may still be in the last-level cache the copy engine wrote them into, so the host
    reads them from cache instead of memory. Copies are paced by the writes (a sync save's
    shape: the device is not free until the last write)."""
    pieces, off = [], 0
    for s in sources:
        flat = s.view(-1).view(torch.uint8)
        for start in range(0, flat.numel(), slot_bytes):
            part = flat[start:start + slot_bytes]
            pieces.append((part, off))
            off += part.numel()
    # contiguous runs of pieces per lane, so each lane writes one file front to back
    per = -(-len(pieces) // lanes)
    shares = [pieces[i * per:(i + 1) * per] for i in range(lanes)]
    if lanes * slots * slot_bytes > ring.numel():
        raise ValueError(f"{lanes} lanes x {slots} slots of {slot_bytes} bytes do not fit a ring of {ring.numel()}")
    d = fresh(target)
    streams = [torch.cuda.Stream() for _ in range(lanes)]

    def lane_fn(i: int) -> None:
        share, stream = shares[i], streams[i]
        if not share:
            return
        base = share[0][1]
        mine = [ring[(i * slots + k) * slot_bytes:(i * slots + k + 1) * slot_bytes] for k in range(slots)]
        views = [host_memoryview(m) for m in mine]
        events = [torch.cuda.Event() for _ in range(slots)]

        def issue(j: int) -> None:
            part = share[j][0]
            k = j % slots
            with torch.cuda.stream(stream):
                mine[k][:part.numel()].copy_(part, non_blocking=True)
                events[k].record(stream)

        for j in range(min(slots, len(share))):
            issue(j)
        fd = os.open(os.path.join(d, f"f{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for j, (part, at) in enumerate(share):
                k = j % slots
                events[k].synchronize()
                pwrite_all(fd, views[k][:part.numel()], at - base)  # the slot is free once this returns
                if j + slots < len(share):
                    issue(j + slots)
            os.fsync(fd)
        finally:
            os.close(fd)

    torch.cuda.synchronize()
    try:
        return run_guarded(lane_fn, lanes)
    finally:
        shutil.rmtree(d, ignore_errors=True)
