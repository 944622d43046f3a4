"""The writes alone, in a process of their own: the `writes_beside` mode of zero_stall_bench.py.

A separate interpreter (no GIL shared with the training process) fills a seeded random buffer
as large as the saved state once, at its start, and then, for each "write" it is sent, writes
that buffer into a directory as a save would: as many files of equal size (two per writer
thread, as safe_ckpt lays a rank's bytes out), by as many writer threads, each niced as safe_ckpt
nices its writers, in chunk-sized positional writes, each file fsynced by the thread that wrote
it and the directory after, where the save would fsync. No device copies, no hashing: what
the target alone costs the host.

`WriterProcess` is the training process's side: it starts the process, waits until its buffer
is filled, starts a write, and waits for its report. Run directly, this file is the process
(a line of JSON per command on stdin, a line per reply on stdout).

Must not: be imported by the library; write zeros; import torch (the process stays small).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import select
import subprocess
import sys
import threading
import time


class WriterProcess:
    """The writer process, started now; returns once its buffer is filled (``ready`` holds its report)."""

    def __init__(self, total_bytes: int, files: int, threads: int, fsync: bool, nice: int, chunk_bytes: int,
                 seed: int = 0, ready_timeout_s: float = 600.0) -> None:
        argv = [sys.executable, os.path.abspath(__file__), "--bytes", str(total_bytes), "--files", str(files),
                "--threads", str(threads), "--chunk-bytes", str(chunk_bytes), "--seed", str(seed),
                "--nice", str(nice)] + (["--fsync"] if fsync else [])
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        try:
            self.ready = self._reply("ready", ready_timeout_s)
        except BaseException:
            self._kill()
            raise

    def _reply(self, expected: str, timeout_s: float) -> dict:
        readable, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not readable:
            self._kill()
            raise TimeoutError(f"the writer process sent no {expected!r} within {timeout_s:.0f} s; killed it")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the writer process ended (exit status {self.proc.wait()}) before its {expected!r}; "
                               "its stderr is in this run's log")
        kind, _, payload = line.strip().partition(" ")
        if kind != expected:
            raise RuntimeError(f"the writer process answered {kind!r} instead of {expected!r}: {payload[:500]}")
        return json.loads(payload)

    def start(self, directory: str) -> None:
        """Start writing into ``directory`` (created by the process); returns at once."""
        self.proc.stdin.write(json.dumps({"cmd": "write", "dir": directory}) + "\n")
        self.proc.stdin.flush()

    def wait(self, timeout_s: float = 600.0) -> dict:
        """The write's report: ``start``/``end`` (CLOCK_MONOTONIC, `time.monotonic` of any process on the
        host), ``write_s``, ``cpu_s`` (the process's CPU time, every thread), ``bytes``, ``files``."""
        return self._reply("done", timeout_s)

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._kill()


# ---------------------------------------------------------------- the process itself
def _fill(total_bytes: int, chunk_bytes: int, threads: int, seed: int):
    """An anonymous mapping of ``total_bytes`` (rounded up to 8), each chunk a seeded random block
    xored with a per-chunk word (distinct chunks, never zeros), filled by ``threads`` threads."""
    import mmap

    import numpy as np

    size = (total_bytes + 7) // 8 * 8
    mapping = mmap.mmap(-1, size)
    words = np.frombuffer(mapping, dtype=np.uint64)
    block_words = max(1, min(chunk_bytes, size) // 8)
    block = np.frombuffer(np.random.default_rng(seed).bytes(block_words * 8), dtype=np.uint64)
    chunks = queue.SimpleQueue()
    for k in range((words.size + block_words - 1) // block_words):
        chunks.put(k)

    def work() -> None:
        while True:
            try:
                k = chunks.get_nowait()
            except queue.Empty:
                return
            part = words[k * block_words:(k + 1) * block_words]
            key = np.uint64(((k + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
            np.bitwise_xor(block[:part.size], key, out=part)

    workers = [threading.Thread(target=work) for _ in range(max(1, threads))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return mapping


def _lower_priority(increment: int) -> None:
    # as safe_ckpt's writers do: this thread only (a thread id names one thread on Linux)
    if increment <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))


def _sizes(total_bytes: int, files: int) -> list[int]:
    base, extra = divmod(total_bytes, files)
    return [base + (1 if i < extra else 0) for i in range(files)]


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(view: memoryview, directory: str, sizes: list[int], threads: int, chunk_bytes: int, fsync: bool,
           nice: int) -> dict:
    import resource

    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.monotonic()
    os.makedirs(directory, exist_ok=True)
    files: queue.SimpleQueue = queue.SimpleQueue()
    offset = 0
    for i, size in enumerate(sizes):
        files.put((i, offset, size))
        offset += size
    errors: list = []
    busy: list = []

    def writer() -> None:
        _lower_priority(nice)
        t = time.monotonic()
        try:
            while True:
                try:
                    i, at, size = files.get_nowait()
                except queue.Empty:
                    return
                fd = os.open(os.path.join(directory, f"__0_{i}.distcp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                             | os.O_CLOEXEC, 0o644)
                try:
                    done = 0
                    while done < size:
                        n = os.pwrite(fd, view[at + done:at + min(size, done + chunk_bytes)], done)
                        if n <= 0:
                            raise OSError(f"pwrite wrote {n} bytes")
                        done += n
                    if fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
        except BaseException as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            busy.append(time.monotonic() - t)

    workers = [threading.Thread(target=writer) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise OSError("; ".join(errors[:3]))
    if fsync:  # the save fsyncs its directory and the one above it when it publishes
        _fsync_path(directory)
        _fsync_path(os.path.dirname(os.path.abspath(directory)))
    end = time.monotonic()
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    return {"start": start, "end": end, "write_s": end - start, "cpu_s": cpu_s, "bytes": sum(sizes),
            "files": len(sizes), "threads": threads, "fsync": fsync, "nice": nice,
            "thread_s_max": max(busy) if busy else 0.0}


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--files", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--chunk-bytes", type=int, default=64 << 20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nice", type=int, default=5)
    parser.add_argument("--fsync", action="store_true")
    ns = parser.parse_args()
    if ns.bytes <= 0 or ns.files <= 0 or ns.threads <= 0:
        parser.error("--bytes, --files and --threads must be positive")
    t0 = time.monotonic()
    mapping = _fill(ns.bytes, ns.chunk_bytes, ns.threads, ns.seed)
    view = memoryview(mapping)[:ns.bytes]
    sizes = _sizes(ns.bytes, ns.files)

    def reply(kind: str, payload: dict) -> None:
        sys.stdout.write(f"{kind} {json.dumps(payload)}\n")
        sys.stdout.flush()

    reply("ready", {"fill_s": time.monotonic() - t0, "bytes": ns.bytes, "files": ns.files, "sizes": sizes[:2],
                    "pid": os.getpid()})
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("cmd") == "quit":
            break
        try:
            reply("done", _write(view, command["dir"], sizes, ns.threads, ns.chunk_bytes, ns.fsync, ns.nice))
        except Exception as exc:
            reply("error", {"error": f"{type(exc).__name__}: {exc}"})
    view.release()


if __name__ == "__main__":
    _main()
