"""The ways zero_stall_bench.py saves (see its docstring). Each mode: `save(directory, verify)`
(the call, timed by the bench), `hooks()` (what it needs inside the next steps), `finish()` (waits
for the save; returns ``ttd_s``, ``gate_s`` = host time the training thread was held outside the
call, and ``verified`` where the mode checks bytes) and `close()`.
"""

from __future__ import annotations

import os
import queue
import threading
import time

from zero_stall_trainers import GiB, Hooks, Unavailable

from safe_ckpt.names import COMMON_STATE_KEY

CHUNK_BYTES = 64 << 20


class SafeAsync:
    """Today's async save through the drop-in (dry run: `safe_ckpt.async_save`)."""

    verifies = False

    def __init__(self, trainer, opts) -> None:
        self.trainer = trainer
        self.results: list = []

    def save(self, directory: str, verify: bool = False) -> None:
        self.gate_s = 0.0
        self.results = []
        self.handle = self.trainer.safe_save(directory)

    def _loop_top(self) -> None:
        t = time.perf_counter()
        self.results += self.trainer.safe_finalize(False)
        self.gate_s += time.perf_counter() - t

    def hooks(self) -> Hooks:
        return Hooks(loop_top=self._loop_top)

    def finish(self) -> dict:
        self.results += self.trainer.safe_finalize(True)
        result = self.results[-1]
        return {"ttd_s": result.timings.total_s, "gate_s": self.gate_s, "plan_s": result.timings.plan_s,
                "bytes": result.total_file_bytes}

    def close(self) -> None:
        self.trainer.safe_finalize(True)


class Overlap(SafeAsync):
    """This mode: the Megatron drop-in with `--safe-ckpt-overlap-copy` (dry run: `safe_ckpt.async_save`
    with `return_after="planned"`); the untimed save compares its checkpoint with today's async save
    of the same state, through stock readers."""

    verifies = True
    opens_at_zero_grad = True  # its stall includes the next step's zero_grad, where the window opens

    def __init__(self, trainer, opts) -> None:
        from safe_ckpt.options import SaveOptions

        if "return_after" not in SaveOptions.__dataclass_fields__:
            raise Unavailable("this safe_ckpt has no overlap mode (SaveOptions.return_after)")
        super().__init__(trainer, opts)
        self.reference = None

    def save(self, directory: str, verify: bool = False) -> None:
        self.reference = None
        if verify:  # untimed: the same state through today's path first
            self.reference = directory + "_reference"
            self.trainer.safe_save(self.reference)
            self.trainer.safe_finalize(True)
        self.iteration = self.trainer.iteration
        self.gate_s = 0.0
        self.results = []
        self.handle = self.trainer.safe_save(directory, overlap=True)
        self.directory = directory

    def finish(self) -> dict:
        done = super().finish()
        stats = getattr(self.handle, "window_stats", None)
        if stats is not None:
            window = stats()
            done["window"] = getattr(window, "__dict__", window)
            done["gate_s"] += getattr(window, "gate_wait_s", 0.0)
        if self.reference is not None:
            from tests.helpers.megatron_evidence import compare_contents

            name = "iter_%07d" % self.iteration
            content = compare_contents(os.path.join(self.directory, name), os.path.join(self.reference, name))
            differ = content.get("differ")
            # the common state holds Megatron's args: only the save directory and the mode's own flag may differ
            args_only = differ == [f"{COMMON_STATE_KEY}/shard_0_1"] and content.get("common_differ") == ["args"] \
                and set(content.get("common_args_differ", [])) <= {"save", "safe_ckpt_overlap_copy"}
            done["verified"] = (differ == [] or args_only) and content.get("tensors", 0) > 0
            done["compare"] = {k: v for k, v in content.items() if k != "traceback"}
            done["cleanup"] = [self.reference]
        return done


class WindowCore:
    """The copy window alone: state dict at the call, window opened at the next zero_grad, copies
    into the shared pool, optimizer-step gate, drain threads for writers (no files)."""

    verifies = True

    def __init__(self, trainer, opts) -> None:
        from safe_ckpt.staging.pool import shared_pool

        self.trainer = trainer
        self.threads = opts["threads"]
        self.pool = shared_pool(int(trainer.budget_gib * GiB))
        self.window = None

    def save(self, directory: str, verify: bool = False) -> None:
        self.t0 = time.perf_counter()
        self.pairs = self.trainer.window_sources()  # the call's host work: Megatron's state dict
        self.versions = [t._version for _, t in self.pairs]
        self.verify = verify
        self.reference = self._hashes() if verify else None
        self.opened = False
        self.open_s = 0.0
        self.error = None
        self.landed_at = None

    def _jobs(self):
        from safe_ckpt.staging.window import WindowSource
        from safe_ckpt.staging.window_copier import ChunkJob

        sources, jobs = [], []
        for index, (key, t) in enumerate(self.pairs):
            if t.is_contiguous():
                flat = t.view(-1)
                step = max(1, CHUNK_BYTES // t.element_size())
                pieces = [flat[a:a + step] for a in range(0, flat.numel(), step)]
            else:
                pieces = [t]
            device = t.device.index if t.device.type == "cuda" else None
            sources.append(WindowSource(index=index, key=key, tensor=t, device=device, chunks=len(pieces),
                                        size_bytes=t.numel() * t.element_size(), version=self.versions[index]))
            jobs += [ChunkJob(index, piece, (key, k)) for k, piece in enumerate(pieces)]
        return sources, jobs

    def _hashes(self) -> dict:
        from safe_ckpt.integrity import checksum_of
        from safe_ckpt.staging.views import host_memoryview

        _, jobs = self._jobs()
        return {job.item: checksum_of([host_memoryview(job.view.detach().cpu().contiguous())]) for job in jobs}

    def _open(self) -> None:
        """At the next step's zero_grad, in the training thread (the deferred start)."""
        if self.opened:
            return
        self.opened = True
        t = time.perf_counter()
        import torch
        from safe_ckpt.staging import gates
        from safe_ckpt.staging.source_sums import DeviceSums, HostSums
        from safe_ckpt.staging.streams import streams_for
        from safe_ckpt.staging.window import CopyWindow
        from safe_ckpt.staging.window_copier import WindowCopier

        sources, jobs = self._jobs()
        devices = {s.device for s in sources if s.device is not None}
        streams = streams_for(devices, page_locked=self.pool.pinned)
        sums = DeviceSums(streams) if devices and torch.cuda.is_available() else HostSums()
        self.window = CopyWindow(sources, streams, sums, name="window_core", rank=0, timeout_s=300.0)
        items: queue.SimpleQueue = queue.SimpleQueue()
        self.drained: dict = {}
        copier = WindowCopier(self.window, self.pool)
        rest = copier.open(jobs, lambda item, staged: items.put((item, staged)))
        gates.track(self.window)
        copying = threading.Thread(target=self._copy, args=(copier, rest, items), daemon=True)
        drains = [threading.Thread(target=self._drain, args=(items,), daemon=True) for _ in range(self.threads)]
        self.finisher = threading.Thread(target=self._finish_window, args=(copying, drains, items), daemon=True)
        for thread in [copying, *drains, self.finisher]:
            thread.start()
        self.open_s = time.perf_counter() - t

    def _copy(self, copier, rest, items) -> None:
        try:
            copier.run(rest, lambda item, staged: items.put((item, staged)))
        except BaseException as exc:
            self.error = exc

    def _drain(self, items) -> None:
        from safe_ckpt.integrity import checksum_of

        while True:
            entry = items.get()
            if entry is None:
                return
            item, staged = entry
            try:
                views = staged.ready()
                if self.verify:
                    self.drained[item] = checksum_of(views)
            finally:
                staged.release()

    def _finish_window(self, copying, drains, items) -> None:
        copying.join()
        for _ in drains:
            items.put(None)
        for thread in drains:
            thread.join()
        try:
            self.window.settle()
        except BaseException as exc:
            self.error = self.error or exc
        self.landed_at = time.perf_counter()

    def hooks(self) -> Hooks:
        return Hooks(before_zero_grad=self._open)

    def finish(self) -> dict:
        self._open()  # no step opened it (post_steps 0): open now
        self.finisher.join()
        stats = self.window.stats()
        done = {"ttd_s": self.landed_at - self.t0, "gate_s": self.open_s + stats.gate_wait_s, "open_s": self.open_s,
                "window": stats.__dict__, "error": None if self.error is None else repr(self.error)}
        if self.verify:
            done["verified"] = self.error is None and self.drained == self.reference
            done["chunks_checked"] = len(self.reference)
        elif self.error is not None:
            done["verified"] = False
        return done

    def close(self) -> None:
        pass


class WritesBeside:
    """The target alone: at the call, a separate process (zero_stall_writer.py: no GIL shared) writes
    as many bytes as the saved state into the save's directory, in the save's files (two of equal
    size per writer thread), with its writer threads, niceness and fsync, from a seeded random
    buffer it filled when this mode began, before any timed step. No copies, no hashing."""

    verifies = False

    def __init__(self, trainer, opts) -> None:
        from zero_stall_writer import WriterProcess

        self.settings = trainer.write_settings()
        threads = self.settings["threads"]
        self.writer = WriterProcess(trainer.state_bytes, files=2 * threads, threads=threads,
                                    fsync=self.settings["fsync"], nice=self.settings["nice"], chunk_bytes=CHUNK_BYTES)
        print(f"writes_beside: {trainer.state_bytes / 1e9:.2f} GB in {2 * threads} files by {threads} threads "
              f"(fsync {self.settings['fsync']}, nice +{self.settings['nice']}); buffer filled in "
              f"{self.writer.ready['fill_s']:.2f} s", flush=True)

    def save(self, directory: str, verify: bool = False) -> None:
        self.t0 = time.monotonic()  # the writer reports CLOCK_MONOTONIC times too
        self.writer.start(directory)

    def hooks(self) -> Hooks:
        return Hooks()

    def finish(self) -> dict:
        done = self.writer.wait()
        return {"ttd_s": done["end"] - self.t0, "gate_s": 0.0, "bytes": done["bytes"],
                "writes": {k: v for k, v in done.items() if k not in ("start", "end")},
                "writes_began_s": done["start"] - self.t0}

    def close(self) -> None:
        self.writer.close()


class DcpAsync:
    """`dcp.async_save` with its pinned DefaultStager; staging waited for before optimizer.step."""

    verifies = False

    def __init__(self, trainer, opts) -> None:
        import torch

        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError as exc:
            raise Unavailable(f"this torch has no DefaultStager ({exc})")
        pinned = torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(pinned, False, True, pinned))
        self.trainer = trainer
        import torch.distributed as dist

        self.group = dist.new_group(backend="gloo")  # its async save needs a CPU backend
        self.threads = opts["threads"]

    def save(self, directory: str, verify: bool = False) -> None:
        import torch.distributed.checkpoint as dcp

        self.t0 = time.perf_counter()
        self.gate_s = 0.0
        self.done_at = None
        self.staged = False
        self.resp = dcp.async_save(self.trainer.plain_state(),
                                   storage_writer=dcp.FileSystemWriter(directory, thread_count=self.threads),
                                   async_stager=self.stager, process_group=self.group)
        upload = getattr(self.resp, "upload_completion", self.resp)
        upload.add_done_callback(lambda _: setattr(self, "done_at", time.perf_counter()))

    def _before_opt_step(self) -> None:
        if not self.staged:
            self.staged = True
            staging = getattr(self.resp, "staging_completion", None)
            if staging is not None:
                t = time.perf_counter()
                staging.result()
                self.gate_s += time.perf_counter() - t

    def hooks(self) -> Hooks:
        return Hooks(before_opt_step=self._before_opt_step)

    def finish(self) -> dict:
        getattr(self.resp, "upload_completion", self.resp).result()
        while self.done_at is None:  # the callback runs right after the result is set
            time.sleep(0.001)
        return {"ttd_s": self.done_at - self.t0, "gate_s": self.gate_s}

    def close(self) -> None:
        self.stager.close()


class MegatronAsync:
    """Stock Megatron `save_checkpoint` with --async-save, finalized at each loop top."""

    verifies = False

    def __init__(self, trainer, opts) -> None:
        import torch

        if not torch.cuda.is_available() or not hasattr(trainer, "args"):
            raise Unavailable("stock Megatron saving needs CUDA and megatron.training")
        self.trainer = trainer

    def save(self, directory: str, verify: bool = False) -> None:
        self.t0 = time.perf_counter()
        self.gate_s = 0.0
        self.ttd = None
        self.trainer.stock_save(directory)

    def _loop_top(self) -> None:
        if self.ttd is not None:
            return
        t = time.perf_counter()
        empty = self.trainer.stock_finalize(False)
        now = time.perf_counter()
        self.gate_s += now - t
        if empty:
            self.ttd = now - self.t0

    def hooks(self) -> Hooks:
        return Hooks(loop_top=self._loop_top)

    def finish(self) -> dict:
        self.trainer.stock_finalize(True)
        if self.ttd is None:
            self.ttd = time.perf_counter() - self.t0
        return {"ttd_s": self.ttd, "gate_s": self.gate_s}

    def close(self) -> None:
        self.trainer.stock_finalize(True)


MODE_CLASSES = {"window_core": WindowCore, "writes_beside": WritesBeside, "overlap": Overlap, "safe_async": SafeAsync,
                "dcp_async": DcpAsync, "megatron_async": MegatronAsync}
