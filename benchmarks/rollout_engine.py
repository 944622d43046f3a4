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

import select
import subprocess
import sys
import threading
import time

# The child: line commands on stdin, one reply line per step on stdout.
#   go SHARE SECONDS  -> "ready BYTES" once SHARE of the free memory is taken and the GPU busy,
#                        then "done MATMULS" after SECONDS or a "stop" line, the memory given back
#   quit              -> exits
ENGINE_CHILD = r"""
import select, sys, time, torch
dev = sys.argv[1]
a = torch.randn(4096 if dev == "cuda" else 64, 4096 if dev == "cuda" else 64, device=dev,
                dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
b = torch.empty_like(a)
torch.matmul(a, a, out=b)
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
sync()
print("up", flush=True)
for line in sys.stdin:
    cmd = line.split()
    if not cmd or cmd[0] == "quit":
        break
    share, seconds = float(cmd[1]), float(cmd[2])
    free = torch.cuda.mem_get_info()[0] if dev == "cuda" else 64 << 20
    filler = torch.empty(int(free * share), dtype=torch.uint8, device=dev)
    filler.fill_(0xA5)
    sync()
    print("ready", filler.numel(), flush=True)
    end, steps = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        torch.matmul(a, a, out=b)
        torch.tanh(b, out=a)
        steps += 1
        if steps % 16 == 0:
            sync()
            if select.select([sys.stdin], [], [], 0)[0]:
                sys.stdin.readline()  # "stop"
                break
    sync()
    del filler
    if dev == "cuda":
        torch.cuda.empty_cache()
    print("done", steps, flush=True)
"""


class RolloutEngine:
    """The rollout stand-in's process. ``device``: "cuda" (the bench) or "cpu" (its tests)."""

    def __init__(self, device: str = "cuda", start_timeout_s: float = 300.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", ENGINE_CHILD, device], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self._expect("up", start_timeout_s)

    def _send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
        except OSError as exc:  # the child is gone: say how it ended, not just the broken pipe
            raise RuntimeError(f"the rollout stand-in is gone (exit {self.proc.wait()}): {exc}") from exc

    def _expect(self, word: str, timeout_s: float) -> list:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline().split() if ready else []
        if not line or line[0] != word:
            self.proc.kill()
            code = self.proc.wait()
            raise RuntimeError(f"the rollout stand-in did not say {word!r} within {timeout_s:.0f} s "
                               f"(it said {line}, exit {code})")
        return line

    def rollout(self, seconds: float, peak: "GpuPeak | None" = None, share: float = 0.8,
                during=None) -> dict:
        """One rollout: take ``share`` of the free GPU memory and keep the GPU busy for ``seconds``;
        with ``during`` (a function), run it once the memory is taken, then stop the rollout and
        return its result as "during". ``peak`` pauses from the request until the memory is
        taken (a tenth of a second: the process is already up), then discounts it."""
        discounting = peak is not None
        if discounting:
            peak.paused = True
            before = peak.device_used()
        start = time.monotonic()
        self._send(f"go {share} {seconds if during is None else 3600}")
        ready = self._expect("ready", 120.0)
        taken_s = time.monotonic() - start
        if discounting:
            peak.discount_bytes = peak.device_used() - before
            peak.paused = False
        out = {"rollout_bytes": int(ready[1]), "rollout_take_s": taken_s}
        if during is not None:
            try:
                out["during"] = during()
            finally:
                self._send("stop")
        done = self._expect("done", seconds + 120.0)
        if discounting:
            peak.discount_bytes = 0
        out.update({"matmuls": int(done[1]), "rollout_s": time.monotonic() - start,
                    "sampler_paused_s": taken_s if discounting else 0.0})
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


class GpuPeak:
    """The GPU memory a save adds, two ways. NVML's used bytes of the whole device, sampled every
    millisecond in a thread (one cheap query; ctypes drops the GIL, so the sampler barely
    competes with the save's threads), less ``discount_bytes`` (the rollout's), not sampled while
    ``paused`` (the rollout taking its memory: its size is known only once taken). And torch's own
    count of the bytes allocated in this process, whose peak over the save is exact and free to
    read, for every allocation made through torch (torch_memory_saver's included). A query per
    process (NVML's running-process list) would need no discount; in the one run that sampled it
    every millisecond, the saves it watched took about twice as long as in the next run, against
    1.2-1.3x for the ceilings it did not watch, so it is not used."""

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

    def device_used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def start(self) -> "GpuPeak":
        import torch

        torch.cuda.reset_peak_memory_stats()
        self.torch_baseline_bytes = torch.cuda.memory_allocated()
        self.baseline_bytes = self.peak_bytes = self.device_used()
        self.discount_bytes = 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="gpu-peak")
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            used = self.device_used()  # read, then check the pause, then the discount: no allocation slips past
            if not self.paused:
                self.peak_bytes = max(self.peak_bytes, used - self.discount_bytes)
            self._stop.wait(0.001)

    def stop(self) -> int:
        """NVML's figure; torch's is left in ``torch_extra_bytes``."""
        import torch

        self._stop.set()
        self._thread.join()
        self.torch_extra_bytes = max(0, torch.cuda.max_memory_allocated() - self.torch_baseline_bytes)
        return max(0, self.peak_bytes - self.baseline_bytes)
