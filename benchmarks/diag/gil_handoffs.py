"""What it costs a thread to give up the GIL while busy writer threads run beside it.

The thread that issues a save's device copies gives up the GIL at each of its torch and
ctypes calls, about 20 per chunk. On a 16-core H200 host with 16 writer threads writing
to disk, a 9.23 GB save's 296 copies took until 0.35-0.41 s to issue where the copies
alone take 0.18 s (a diag_ttd trace now in git history: results/HISTORY.md). This measures
the mechanism without a GPU: an issuing thread makes ``--calls`` calls per "chunk" for
``--chunks`` chunks, each call one of

- ``release``: a ctypes call of about the length of enqueueing a copy (~2 us: libc ``memset``
  of ``--call-bytes``) that releases the GIL (``ctypes.CDLL``, as `cuda_driver` calls libcuda
  by default),
- ``hold``: the same call through ``ctypes.PyDLL``, which keeps the GIL (the library tried
  this for its copy-issuing calls and does not ship it: benchmarks/results/HISTORY.md),
- ``torch``: a torch view op (``Tensor.view``), whose binding releases the GIL like the
  grid sums' ops,
- ``python``: a few bytecodes that never release it (what the thread's share of the cores
  costs, apart from the GIL),

with no writers, with ``--writers`` threads writing ``--piece-mib`` pieces to files under
``--target`` (pwrite, as the POSIX sink does), and with those writers 5 nicer
(`cpu.lower_thread_priority`). Prints one JSON line per case: median microseconds per chunk
over ``--rounds``. Usage:
python benchmarks/diag/gil_handoffs.py [--writers 16] [--target /dev/shm/safe_ckpt_gil]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import shutil
import statistics
import threading
import time

MiB = 1 << 20


def _writer(path: str, piece: memoryview, stop: threading.Event, span_bytes: int, nice: int) -> None:
    from safe_ckpt.host.cpu import lower_thread_priority

    lower_thread_priority(nice)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        offset = 0
        while not stop.is_set():
            os.pwrite(fd, piece, offset)
            offset = (offset + len(piece)) % span_bytes
    finally:
        os.close(fd)


def _calls(kind: str, call_bytes: int):
    if kind == "torch":
        import torch

        t = torch.empty(1024, dtype=torch.uint8)
        return lambda: t.view(-1)
    if kind == "python":
        return lambda: len(str(12345)) + 1
    name = ctypes.util.find_library("c") or "libc.so.6"
    lib = ctypes.PyDLL(name) if kind == "hold" else ctypes.CDLL(name)
    buf = ctypes.create_string_buffer(call_bytes)
    fn = lib.memset
    fn.restype, fn.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    return lambda: fn(buf, 1, call_bytes)


def _issue(call, chunks: int, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(chunks):
        for _ in range(calls):
            call()
    return time.perf_counter() - t0


def _one(kind: str, writers: int, nice: int, args) -> float:
    """Seconds the issuing thread took, with ``writers`` threads writing beside it."""
    call = _calls(kind, args.call_bytes)
    stop = threading.Event()
    piece = memoryview(os.urandom(args.piece_mib * MiB))  # random bytes: never zeros
    threads = [threading.Thread(target=_writer, args=(os.path.join(args.target, f"w{k}"), piece, stop,
                                                      4 * args.piece_mib * MiB, nice), daemon=True)
               for k in range(writers)]
    for t in threads:
        t.start()
    time.sleep(0.05 if writers else 0.0)  # the writers at full speed before timing
    box = {}
    issuer = threading.Thread(target=lambda: box.setdefault("s", _issue(call, args.chunks, args.calls)))
    issuer.start()
    issuer.join()
    stop.set()
    for t in threads:
        t.join()
    return box["s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--writers", type=int, default=16)
    ap.add_argument("--target", default="/dev/shm/safe_ckpt_gil")
    ap.add_argument("--piece-mib", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=296)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--call-bytes", type=int, default=64 << 10, help="memset length of the ctypes calls")
    args = ap.parse_args()
    os.makedirs(args.target, exist_ok=True)
    print(json.dumps({"cores": os.cpu_count(), "writers": args.writers, "target": args.target,
                      "chunks": args.chunks, "calls_per_chunk": args.calls, "call_bytes": args.call_bytes}), flush=True)
    kinds = ("release", "hold", "torch", "python")
    cases = [(kind, w, n) for w, n in ((0, 0), (args.writers, 0), (args.writers, 5)) for kind in kinds]
    runs = {c: [] for c in cases}
    try:
        for _ in range(args.rounds):  # rounds interleave the cases, so drift hits all alike
            for case in cases:
                runs[case].append(_one(*case, args))
    finally:
        shutil.rmtree(args.target, ignore_errors=True)
    for (kind, w, n), times in runs.items():
        med = statistics.median(times)
        print(json.dumps({"case": kind, "writers": w, "writer_nice": n,
                          "us_per_chunk_median": round(med / args.chunks * 1e6, 1),
                          "us_per_chunk_min": round(min(times) / args.chunks * 1e6, 1),
                          "us_per_chunk_max": round(max(times) / args.chunks * 1e6, 1),
                          "issue_s_median": round(med, 4)}), flush=True)


if __name__ == "__main__":
    main()
