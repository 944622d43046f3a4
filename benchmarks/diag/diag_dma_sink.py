"""Experiment (GPU machine, tmpfs): can the device-to-host copy land straight in the target's
page-cache pages instead of in a pinned staging buffer that the writers then copy from?

A staging save moves every GPU byte through host memory three times on a page-cache target
(DMA into the staging buffer, the kernel reading it, the kernel writing the file's pages); the
write ceiling moves it twice. Here each file is sized, mapped (MAP_SHARED), and its mapping
registered with CUDA (cudaHostRegister) chunk by chunk, so the copy engine writes the file's
own pages: one pass. Cases, rounds interleaved so drift hits all alike:
- ``write_N``: the write ceiling (N threads pwrite + fsync from distinct host bytes);
- ``dma_lL_cC``: L lanes, each taking C MiB chunks in turn: register, copy on its own stream,
  synchronize, unregister; then munmap, fsync, close;
- ``dma_lL_cC_sum``: the same, each chunk hashed (xxh3/crc, as safe_ckpt's manifest) after it lands.
The first DMA case's bytes are compared with the GPU source once more, after the timed rounds.
Measured (H200, 2026-12-02, results/diagnostics_2026-12-01_02.txt, section
h200_diag_dma_sink_tmpfs_2026-12-02.txt): 1.8-1.9 GB/s against the write ceiling's 26 GB/s,
so registering file-backed pages costs far more than the copy it saves; kept as the record of
that, not used by safe_ckpt.
Prints one JSON line per case (median, min, max seconds, GB/s). Usage:
  python benchmarks/diag/diag_dma_sink.py --target /dev/shm/safe_ckpt_dma --gib 8.6 --reps 3
(each DMA case takes ~5 s a run at 8.6 GiB: the default cases and 5 rounds take ~4 minutes)
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from safe_ckpt_lab.bench.ceilings import run_lanes, source_buffer, write_seconds  # noqa: E402
from safe_ckpt.integrity import checksum_of  # noqa: E402

MiB = 1 << 20


def dma_case(target: str, sources: list[torch.Tensor], lanes: int, chunk_bytes: int, hashed: bool) -> float:
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    cudart = torch.cuda.cudart()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fds, maps, jobs = [], [], []
    for i, src in enumerate(sources):
        n = src.numel()
        fd = os.open(os.path.join(target, f"f{i}"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fd, n)
        fds.append(fd)
        maps.append(mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
        jobs += [(i, off, min(chunk_bytes, n - off)) for off in range(0, n, chunk_bytes)]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def lane(_k: int) -> None:
        stream = torch.cuda.Stream()
        try:
            while True:
                with lock:
                    if not jobs or errors:
                        return
                    i, off, n = jobs.pop(0)
                dst = torch.frombuffer(maps[i], dtype=torch.uint8, count=n, offset=off)
                ptr = dst.data_ptr()
                err = cudart.cudaHostRegister(ptr, n, 0)
                if int(err) != 0:
                    raise RuntimeError(f"cudaHostRegister({n} bytes of f{i}) returned {err}")
                try:
                    with torch.cuda.stream(stream):
                        dst.copy_(sources[i][off:off + n], non_blocking=True)
                    stream.synchronize()
                finally:
                    cudart.cudaHostUnregister(ptr)
                if hashed:
                    checksum_of([memoryview(dst.numpy())])
                del dst
        except BaseException as e:
            errors.append(e)

    run_lanes(lane, lanes)
    if errors:
        raise errors[0]
    for m, fd in zip(maps, fds):
        m.close()
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - t0


def check(target: str, sources: list[torch.Tensor]) -> None:
    for i, src in enumerate(sources):
        with open(os.path.join(target, f"f{i}"), "rb") as f:
            got = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
        if not torch.equal(got, src.cpu()):
            raise AssertionError(f"f{i}: bytes differ from the GPU source")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="/dev/shm/safe_ckpt_dma")
    ap.add_argument("--gib", type=float, default=8.6)
    ap.add_argument("--files", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--write-threads", type=int, default=16)
    ap.add_argument("--cases", default="l4_c64,l8_c64,l16_c64,l8_c256,l16_c16,l8_c64_sum,l16_c64_sum")
    args = ap.parse_args()
    total = int(args.gib * (1 << 30)) // args.files // 4096 * 4096 * args.files
    gen = torch.Generator(device="cuda").manual_seed(11)
    sources = [torch.randint(0, 256, (total // args.files,), dtype=torch.uint8, device="cuda", generator=gen)
               for _ in range(args.files)]
    host = source_buffer(total)
    cases = {f"write_{args.write_threads}": lambda: write_seconds(args.target + "_w", total, args.write_threads, 1, host)}
    for c in args.cases.split(","):
        lanes, chunk = c.split("_")[:2]
        cases[f"dma_{c}"] = (lambda L=int(lanes[1:]), C=int(chunk[1:]) * MiB, h=c.endswith("_sum"):
                             dma_case(args.target, sources, L, C, h))
    times: dict[str, list[float]] = {k: [] for k in cases}
    for name, fn in cases.items():  # one untimed warm-up each (CUDA contexts, first registrations)
        try:
            print(json.dumps({"warmup": name, "s": round(fn(), 4)}), flush=True)
        except Exception as exc:
            print(json.dumps({"case": name, "error": repr(exc)}), flush=True)
            times.pop(name)
    for _ in range(args.reps):
        for name in list(times):
            times[name].append(cases[name]())
            print(json.dumps({"run_of": name, "s": round(times[name][-1], 4)}), flush=True)
    for name, ts in times.items():
        med = statistics.median(ts)
        print(json.dumps({"case": name, "median_s": round(med, 4), "min_s": round(min(ts), 4),
                          "max_s": round(max(ts), 4), "gbps": round(total / med / 1e9, 2), "bytes": total}), flush=True)
    for name in times:
        if name.startswith("dma_"):
            cases[name]()
            check(args.target, sources)
            print(json.dumps({"case": name, "verified": True}), flush=True)
            break
    shutil.rmtree(args.target, ignore_errors=True)
    shutil.rmtree(args.target + "_w", ignore_errors=True)


if __name__ == "__main__":
    main()
