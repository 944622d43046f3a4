"""The GPU side of slime_loop_bench.py: a rollout stand-in that lives as long as the run, and the
sampler of the GPU memory a save adds.

- `RolloutEngine`: another process, started once, as SGLang's engines are in slime's colocated
  mode: between rollouts it holds only its CUDA context; for each rollout it takes a share of
  the free GPU memory (as SGLang's KV cache does on resume), runs matmuls until the rollout's
  time is up or it is told to stop, and gives the memory back. Started anew for every rollout,
  it would put a Python start, a torch import and a CUDA init beside each save, which slime
  never does.
- `GpuPeak`: the most GPU memory a save added: the device's bytes sampled every millisecond less
  the rollout's, and torch's peak of the bytes allocated in the saving process.

Must not: save, load or time saves (the bench does).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

# The child: line commands on stdin, one reply line per step on stdout.
#   go SHARE SECONDS  -> "ready BYTES" once SHARE of the free memory is taken and the GPU busy,
#                        then "done MATMULS" after SECONDS ("inf": none) or a "stop" line, the
#                        memory given back
#   quit, or EOF      -> exits
# Any other line ("stop" when no rollout runs) is ignored. Lines are read by a thread into a
# queue: a select on a buffered stream misses lines already in its buffer.
ENGINE_CHILD = r"""
import queue, sys, threading, time, torch
dev = sys.argv[1]
lines = queue.Queue()
def read():
    for line in sys.stdin:
        lines.put(line.split())
    lines.put(["quit"])
threading.Thread(target=read, daemon=True).start()
n = 4096 if dev == "cuda" else 64
a = torch.randn(n, n, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
b = torch.empty_like(a)
torch.matmul(a, a, out=b)
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
sync()
print("up", flush=True)
while True:
    cmd = lines.get()
    if cmd and cmd[0] == "quit":
        break
    if len(cmd) != 3 or cmd[0] != "go":
        continue
    share, seconds = float(cmd[1]), float(cmd[2])
    free = torch.cuda.mem_get_info()[0] if dev == "cuda" else 64 << 20
    filler = torch.empty(int(free * share), dtype=torch.uint8, device=dev)
    filler.fill_(0xA5)
    sync()
    print("ready", filler.numel(), flush=True)
    end, steps, quit = time.monotonic() + seconds, 0, False
    while time.monotonic() < end:
        torch.matmul(a, a, out=b)
        torch.tanh(b, out=a)
        steps += 1
        if steps % 16 == 0:
            sync()
            if not lines.empty():  # any line ends the rollout early: a "stop", or EOF (the parent is gone)
                cmd = lines.get()
                quit = bool(cmd) and cmd[0] == "quit"
                break
    sync()
    del filler
    if dev == "cuda":
        torch.cuda.empty_cache()
    print("done", steps, flush=True)
    if quit:
        break
"""


class RolloutEngine:
    """The rollout stand-in's process. ``device``: "cuda" (the bench) or "cpu" (its tests).
    Every wait for it is bounded; a stand-in that does not answer in time is killed and the
    error says what it last said and how it exited."""

    def __init__(self, device: str = "cuda", start_timeout_s: float = 300.0, program: str = ENGINE_CHILD,
                 reply_timeout_s: float = 120.0) -> None:
        """``program``: the child's source (the tests give others that speak the same protocol);
        ``reply_timeout_s``: how long a reply may take beyond the rollout's own time."""
        self.reply_timeout_s = reply_timeout_s
        # Its own session: a child of the stand-in that outlives it (and keeps the pipe open) can be
        # killed with it, so that closing never waits on a pipe no one will end.
        self.proc = subprocess.Popen([sys.executable, "-c", program, device], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
        self._lines: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True, name="rollout-engine-reader")
        self._reader.start()
        self._expect("up", start_timeout_s)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line.split())
        self._lines.put(None)  # EOF: the child is gone

    def _kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:  # already gone
            pass

    def _exit_code(self):
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._kill()
            return self.proc.wait()

    def _send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
        except OSError as exc:  # the child is gone: say how it ended, not just the broken pipe
            raise RuntimeError(f"the rollout stand-in is gone (exit {self._exit_code()}): {exc}") from exc

    def _expect(self, word: str, timeout_s: float) -> list:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            self._kill()
            raise RuntimeError(f"the rollout stand-in did not say {word!r} within {timeout_s:.0f} s "
                               f"(killed, exit {self._exit_code()})") from None
        if line is None:
            raise RuntimeError(f"the rollout stand-in is gone (exit {self._exit_code()}) before saying {word!r}")
        if not line or line[0] != word:
            self._kill()
            raise RuntimeError(f"the rollout stand-in said {line} where {word!r} was due "
                               f"(killed, exit {self._exit_code()})")
        return line

    def rollout(self, seconds: float, peak: "GpuPeak | None" = None, share: float = 0.8,
                during=None) -> dict:
        """One rollout: take ``share`` of the free GPU memory and keep the GPU busy for ``seconds``;
        with ``during`` (a function), run it once the memory is taken, then stop the rollout and
        return its result as "during". ``peak`` pauses from the request until the memory is
        taken (0.1 s with nothing else running, 0.4 s beside an asleep save), then discounts what
        the device gained meanwhile: whatever else was allocated during the take and kept is
        discounted with it, for the whole rollout (torch's count still sees it)."""
        start = time.monotonic()
        taken_s = 0.0
        if peak is not None:
            peak.paused = True
            before = peak.device_used()
        try:
            try:
                self._send(f"go {share} {seconds if during is None else 'inf'}")
                ready = self._expect("ready", self.reply_timeout_s)
                taken_s = time.monotonic() - start
                if peak is not None:
                    peak.discount_bytes = peak.device_used() - before
            finally:
                if peak is not None:
                    peak.paused = False
            out = {"rollout_bytes": int(ready[1]), "rollout_take_s": taken_s}
            if during is not None:
                try:
                    out["during"] = during()
                except BaseException:
                    # The rollout still ends, and its "done" is read here: left in the queue, it
                    # would answer the next rollout's "go".
                    try:
                        self._send("stop")
                        self._expect("done", self.reply_timeout_s)
                    except RuntimeError:
                        pass  # the first error is the one to report
                    raise
                self._send("stop")
            done = self._expect("done", seconds + self.reply_timeout_s)
        finally:
            if peak is not None:
                peak.paused = False
                peak.discount_bytes = 0
        out.update({"matmuls": int(done[1]), "rollout_s": time.monotonic() - start,
                    "sampler_paused_s": taken_s if peak is not None else 0.0})
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._kill()  # the stand-in if still there, and whatever it started that still holds the pipe
        self.proc.wait()
        self._reader.join(timeout=10)  # it reads stdout until EOF: close that only once it is done
        streams = [self.proc.stdin] + ([self.proc.stdout] if not self._reader.is_alive() else [])
        for stream in streams:
            try:
                stream.close()
            except OSError:
                pass


class GpuPeak:
    """The GPU memory a save adds, two ways. NVML's used bytes of the whole device, sampled every
    millisecond in a thread (one query; ctypes drops the GIL), less ``discount_bytes`` (what the
    device gained while the rollout took its memory, which is what it blinds NVML to: anything
    else allocated in that window and kept), not sampled while ``paused`` (the rollout taking its
    memory: its size is known only once taken). And torch's own
    count of the bytes allocated in this process, whose peak over the save is exact and free to
    read, for every allocation made through torch (torch_memory_saver's included). NVML's
    per-process query would need no discount; it was tried once, sampled every millisecond, and
    that run's saves were slower than the next run's by more than its ceilings were (two boots,
    so not separated): it is not used. What the device-wide sampler itself costs a save was not
    measured (no save ran with it off)."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)  # the one GPU of the machine
        self.discount_bytes = 0
        self.paused = False
        self._stop = threading.Event()
        self._thread = None
        self.baseline_bytes = self.peak_bytes = 0
        self.torch_baseline_bytes = 0
        self.torch_extra_bytes = 0
        self._lock = threading.Lock()  # the thread and a caller's `sample` both update the peak

    def device_used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def start(self, sampling: bool = True) -> "GpuPeak":
        """``sampling`` False: no thread; the caller calls `sample` (the tests do)."""
        import torch

        if self._thread is not None:  # started again without a stop: end the earlier sampler first
            self.stop()
        torch.cuda.reset_peak_memory_stats()
        self.torch_baseline_bytes = torch.cuda.memory_allocated()
        self.baseline_bytes = self.peak_bytes = self.device_used()
        self.discount_bytes = 0
        self._stop.clear()
        self._thread = None
        if sampling:
            self._thread = threading.Thread(target=self._sample_loop, daemon=True, name="gpu-peak")
            self._thread.start()
        return self

    def sample(self) -> None:
        used = self.device_used()  # read, then check the pause, then the discount: no allocation slips past
        if not self.paused:
            with self._lock:
                self.peak_bytes = max(self.peak_bytes, used - self.discount_bytes)

    def _sample_loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(0.001)

    def stop(self) -> int:
        """NVML's figure; torch's is left in ``torch_extra_bytes``."""
        import torch

        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.torch_extra_bytes = max(0, torch.cuda.max_memory_allocated() - self.torch_baseline_bytes)
        return max(0, self.peak_bytes - self.baseline_bytes)
