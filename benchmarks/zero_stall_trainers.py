"""The training loops zero_stall_bench.py times: a real Megatron GPTModel with the distributed
optimizer on the GPU, or (``--dry-run``) a small torch model on the CPU that exercises the harness.

Both offer the same few calls: `step(hooks)` (one training step, Megatron-shaped: zero the grad
buffers, `hooks.before_zero_grad`, `optimizer.zero_grad()`, forward+backward, `hooks.before_opt_step`,
`optimizer.step()`, scheduler, the loss's `.item()`), `window_sources()` (the saved tensors, from the
state dict the save builds), `plain_state()` (the same as a flat dict for DCP), `safe_save` /
`safe_finalize` (safe_ckpt's Megatron drop-in, or `safe_ckpt.async_save` in the dry run),
`write_settings()` (that save's writer threads, fsync and niceness) and `stock_save` /
`stock_finalize` (stock Megatron's async save; GPU only).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

GiB = 1 << 30


class Unavailable(Exception):
    """A mode cannot run here (reason in the message)."""


@dataclass(frozen=True)
class Hooks:
    loop_top: Optional[Callable[[], None]] = None
    before_zero_grad: Optional[Callable[[], None]] = None
    before_opt_step: Optional[Callable[[], None]] = None


NO_HOOKS = Hooks()


class _Timer:
    """Elapsed time between marks: CUDA events on the current stream, else the host clock."""

    def __init__(self, cuda: bool) -> None:
        import torch

        self._cuda = cuda
        self._marks: list = []
        self._torch = torch

    def mark(self) -> None:
        if self._cuda:
            event = self._torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        if self._cuda:
            self._marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self._marks, self._marks[1:])]
        return [b - a for a, b in zip(self._marks, self._marks[1:])]


def _dedup(pairs):
    seen, out = set(), []
    for key, t in pairs:
        ident = (t.data_ptr(), t.numel(), t.dtype)
        if ident not in seen and t.numel():
            seen.add(ident)
            out.append((key, t))
    return out


def _writers(overrides: dict, threads, fsync: bool) -> dict:
    """A save's writers as safe_ckpt runs them (`writes_beside`): threads (None: its default for this
    host), fsync, niceness; a mode's overrides first."""
    from safe_ckpt.host import cpu

    nice = overrides.get("safe_ckpt_writer_nice")
    threads = overrides.get("safe_ckpt_io_threads") or threads or cpu.default_io_threads(
        cpu.rank_share([cpu.host_report()], 0))
    return {"threads": threads, "fsync": fsync, "nice": cpu.WRITER_NICE_INCREMENT if nice is None else nice}


class MegatronTrainer:
    VARIANTS = {"gpu": "gpu", "cpu_offload": "cpu_offload_pinned"}

    def __init__(self, opts: dict, world: int) -> None:
        import megatron.core  # noqa: F401
        import megatron.training  # noqa: F401
        import torch
        from tests.helpers.bodies import gpu_megatron as g

        g.MODEL_ARGS = g.MODEL_ARGS + [
            "--num-layers", str(opts["layers"]), "--hidden-size", str(opts["hidden"]),
            "--num-attention-heads", str(opts["heads"]), "--seq-length", str(opts["seq_length"]),
            "--max-position-embeddings", str(opts["seq_length"]), "--micro-batch-size", "2",
            "--train-iters", "100000"]
        self.opts = opts
        self._g = g
        self.model, self.optimizer, self.scheduler = g._setup(os.path.join(opts["target"], "unused"),
                                                              self.VARIANTS[opts["variant"]], world)
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.training import get_args

        self.args = get_args()
        self.forward_backward = get_forward_backward_func()
        self.iteration = 0
        self.k = 1
        self.losses: list[float] = []
        self._torch = torch
        self.state_bytes = self.device_bytes = 0
        self.budget_gib = 0.0

    def measure_state(self) -> None:
        """The saved bytes and the pool to hold them (after a step: Adam's state exists then)."""
        sources = self.window_sources()
        self.state_bytes = sum(t.numel() * t.element_size() for _, t in sources)
        self.device_bytes = sum(t.numel() * t.element_size() for _, t in sources if t.device.type == "cuda")
        self.budget_gib = self.state_bytes * 1.05 / GiB + 0.25

    def describe(self) -> dict:
        import megatron.core

        return {"params": sum(p.numel() for m in self.model for p in m.parameters()), "state_bytes": self.state_bytes,
                "device_bytes": self.device_bytes, "gpu": self._torch.cuda.get_device_name(0),
                "megatron_core": megatron.core.__version__}

    def calibrate(self, window_s: float) -> int:
        self.k = 1
        self.step()
        fb = self.step()["fb_gpu_s"]
        self.k = max(1, min(64, int(round(window_s / max(fb, 1e-3)))))
        self.step()
        return self.k

    def prepare_pool(self) -> None:
        from safe_ckpt.staging import pool

        pool.prepare(int(self.budget_gib * GiB))

    def _batch(self, j: int):
        torch = self._torch
        g = torch.Generator().manual_seed(10_000 * self.iteration + j)
        tokens = torch.randint(0, 500, (self.args.micro_batch_size, self.args.seq_length + 1), generator=g).cuda()
        positions = torch.arange(self.args.seq_length).unsqueeze(0).expand(self.args.micro_batch_size, -1).cuda()
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), positions

    def step(self, hooks: Hooks | None = None) -> dict:
        from megatron.core.rerun_state_machine import RerunDataIterator, get_rerun_state_machine

        hooks = hooks or NO_HOOKS
        cpu0 = time.thread_time()
        if hooks.loop_top:
            hooks.loop_top()
        args = self.args
        batches = [self._batch(j) for j in range(self.k)]
        taken = [0]

        def forward_step(data_iterator, m):
            tokens, labels, positions = batches[taken[0] % len(batches)]
            taken[0] += 1
            out = m(tokens, positions, None, labels=labels)

            def loss_func(output):
                loss = output.float().mean()
                return loss, {"lm loss": loss.detach()}

            return out, loss_func

        timer = _Timer(cuda=True)
        timer.mark()
        data = RerunDataIterator(iter([None] * (self.k + 4)))
        rerun = get_rerun_state_machine()
        t_fb = time.perf_counter()
        while rerun.should_run_forward_backward(data):
            for m in self.model:
                m.zero_grad_buffer()
            if hooks.before_zero_grad:
                hooks.before_zero_grad()
            t_zero = time.perf_counter()
            self.optimizer.zero_grad()  # where the drop-in's deferred copy window opens
            zero_grad_s = time.perf_counter() - t_zero
            t_fb = time.perf_counter()
            result = self.forward_backward(forward_step_func=forward_step, data_iterator=data, model=self.model,
                                           num_microbatches=self.k, seq_length=args.seq_length,
                                           micro_batch_size=args.micro_batch_size,
                                           decoder_seq_length=args.seq_length, forward_only=False)
        fb_host_s = time.perf_counter() - t_fb  # the host's time to enqueue it: near fb_gpu_s, the step waits on the host
        timer.mark()
        if hooks.before_opt_step:
            hooks.before_opt_step()
        self.optimizer.step()
        timer.mark()
        self.scheduler.step(increment=args.global_batch_size)
        loss = float(result[-1]["lm loss"].item())
        fb, opt = timer.spans()
        self.losses.append(loss)
        self.iteration += 1
        return {"fb_gpu_s": fb, "opt_gpu_s": opt, "loss": loss, "cpu_s": time.thread_time() - cpu0,
                "zero_grad_s": zero_grad_s, "fb_host_s": fb_host_s}

    def losses_finite(self) -> bool:
        return all(math.isfinite(v) for v in self.losses)

    def state_dict(self) -> dict:
        """Megatron's state dict as the drop-in builds it."""
        from safe_ckpt.megatron import training as drop_in

        mck, _ = drop_in._megatron_training()
        args = self.args
        metadata = drop_in._sharding_metadata(mck, args, None)
        rng = drop_in._rng_state(mck, args, {})
        return mck.generate_state_dict(args, mck.unwrap_model(self.model), self.optimizer, self.scheduler, rng,
                                       **drop_in._accepted(mck.generate_state_dict, {
                                           "iteration": self.iteration, "optim_sd_kwargs": dict(metadata=metadata),
                                           "model_sd_kwargs": dict(metadata=metadata),
                                           "rerun_state": drop_in._rerun_state(args, None)}))

    def window_sources(self) -> list:
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica

        sd = self.state_dict()
        apply_factories(sd)
        return _dedup((f"{v.key}@{tuple(v.global_offset)}", v.data) for v in nested_values(sd)
                      if isinstance(v, ShardedTensor) and v.data is not None and is_main_replica(v.replica_id))

    def plain_state(self) -> dict:
        return dict(self.window_sources())

    def _save_args(self, directory: str, overlap: bool):
        args = self.args
        for name in ("safe_ckpt_io_threads", "safe_ckpt_writer_nice"):  # a mode's overrides (zero_stall_bench)
            setattr(args, name, getattr(self, "overrides", {}).get(name))
        args.save = directory
        args.async_save = True
        args.safe_ckpt_staging_budget_gib = self.budget_gib
        args.safe_ckpt_overlap_copy = overlap

    def safe_save(self, directory: str, overlap: bool = False):
        import safe_ckpt.megatron as drop_in

        self._save_args(directory, overlap)
        try:
            return drop_in.save_checkpoint(self.iteration, self.model, self.optimizer, self.scheduler,
                                           num_floating_point_operations_so_far=0)
        finally:
            self.args.async_save = False
            self.args.safe_ckpt_overlap_copy = False

    def safe_finalize(self, blocking: bool) -> list:
        import safe_ckpt.megatron as drop_in

        return drop_in.finalize_async_saves(blocking=blocking)

    def write_settings(self) -> dict:
        from safe_ckpt.options import SaveOptions

        return _writers(getattr(self, "overrides", {}), None, SaveOptions().fsync)  # the drop-in's fsync: the default

    def stock_save(self, directory: str) -> None:
        from megatron.training.checkpointing import save_checkpoint

        os.makedirs(directory, exist_ok=True)
        self._save_args(directory, False)
        # megatron-core 0.19 accepts --async-save only with the persistent worker (slime sets it too);
        # the worker starts with the first save
        self.args.use_persistent_ckpt_worker = True
        try:
            save_checkpoint(self.iteration, self.model, self.optimizer, self.scheduler,
                            num_floating_point_operations_so_far=0)
        finally:
            self.args.async_save = True  # stock finalize reads it: left on until the save is finalized

    def stock_finalize(self, blocking: bool) -> bool:
        """Finalize stock saves; True once none is pending."""
        from megatron.training.async_utils import is_empty_async_queue, maybe_finalize_async_save

        maybe_finalize_async_save(blocking=blocking)
        empty = is_empty_async_queue()
        if empty and blocking:
            self.args.async_save = False
        return empty


class TinyTrainer:
    """A small MLP and a fused CPU AdamW (the shape of --optimizer-cpu-offload's host step)."""

    FSYNC = False  # its saves' (the harness's check needs no durable files)

    def __init__(self, opts: dict, world: int) -> None:
        import torch

        self._torch = torch
        g = torch.Generator().manual_seed(0)
        width, layers = 1024, 8
        self.params = [torch.nn.Parameter(torch.randn(width, width, generator=g) / 32) for _ in range(layers)]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, fused=True)
        self.opts = opts
        self.k = 1
        self.iteration = 0
        self.losses: list[float] = []
        self._handles: list = []
        self.step()  # Adam's state exists

    def measure_state(self) -> None:
        self.state_bytes = sum(t.numel() * t.element_size() for _, t in self.window_sources())
        self.device_bytes = 0
        self.budget_gib = self.state_bytes * 1.05 / GiB + 0.01

    def describe(self) -> dict:
        return {"params": sum(p.numel() for p in self.params), "state_bytes": self.state_bytes,
                "device_bytes": 0, "gpu": "none (CPU dry run)", "megatron_core": "n/a"}

    def calibrate(self, window_s: float) -> int:
        fb = self.step()["fb_gpu_s"]
        self.k = max(1, min(8, int(round(window_s / max(fb, 1e-3)))))
        return self.k

    def prepare_pool(self) -> None:
        from safe_ckpt.staging import pool

        pool.prepare(int(self.budget_gib * GiB))

    def step(self, hooks: Hooks | None = None) -> dict:
        torch = self._torch
        hooks = hooks or NO_HOOKS
        cpu0 = time.thread_time()
        if hooks.loop_top:
            hooks.loop_top()
        timer = _Timer(cuda=False)
        timer.mark()
        if hooks.before_zero_grad:
            hooks.before_zero_grad()
        t_zero = time.perf_counter()
        self.optimizer.zero_grad()
        zero_grad_s = time.perf_counter() - t_zero
        t_fb = time.perf_counter()
        g = torch.Generator().manual_seed(self.iteration)
        for _ in range(self.k):
            x = torch.randn(64, self.params[0].shape[0], generator=g)
            for p in self.params:
                x = torch.tanh(x @ p)
            loss = x.square().mean()
            loss.backward()
        fb_host_s = time.perf_counter() - t_fb  # the host's time to enqueue it: near fb_gpu_s, the step waits on the host
        timer.mark()
        if hooks.before_opt_step:
            hooks.before_opt_step()
        self.optimizer.step()
        timer.mark()
        fb, opt = timer.spans()
        self.losses.append(float(loss.item()))
        self.iteration += 1
        return {"fb_gpu_s": fb, "opt_gpu_s": opt, "loss": self.losses[-1], "cpu_s": time.thread_time() - cpu0,
                "zero_grad_s": zero_grad_s, "fb_host_s": fb_host_s}

    def losses_finite(self) -> bool:
        return all(math.isfinite(v) for v in self.losses)

    def window_sources(self) -> list:
        pairs = []
        for i, p in enumerate(self.params):
            pairs.append((f"w{i}", p.detach()))
            for name in ("exp_avg", "exp_avg_sq"):
                if name in self.optimizer.state.get(p, {}):
                    pairs.append((f"w{i}.{name}", self.optimizer.state[p][name]))
        return _dedup(pairs)

    def plain_state(self) -> dict:
        return dict(self.window_sources())

    def safe_save(self, directory: str, overlap: bool = False):
        """`safe_ckpt.async_save` into DIRECTORY/iter_NNNNNNN (the drop-in's layout), returning after
        planning with ``overlap``."""
        import safe_ckpt
        from megatron.core.dist_checkpointing import ShardedTensor

        sharded = {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in self.window_sources()}
        over = getattr(self, "overrides", {})
        opts = safe_ckpt.SaveOptions(staging_budget_bytes=int(self.budget_gib * GiB),
                                     io_threads=over.get("safe_ckpt_io_threads", self.opts["threads"]),
                                     writer_nice=over.get("safe_ckpt_writer_nice"),
                                     progress_interval_s=0, fsync=self.FSYNC,
                                     return_after="planned" if overlap else "staged")
        handle = safe_ckpt.async_save(sharded, os.path.join(directory, "iter_%07d" % self.iteration), options=opts)
        self._handles.append(handle)
        return handle

    def safe_finalize(self, blocking: bool) -> list:
        done = [h for h in self._handles if blocking or h.done()]
        self._handles = [h for h in self._handles if h not in done]
        return [h.wait() for h in done]

    def write_settings(self) -> dict:
        return _writers(getattr(self, "overrides", {}), self.opts["threads"], self.FSYNC)

    def stock_save(self, directory: str) -> None:
        raise Unavailable("stock Megatron saving needs CUDA and megatron.training")

    def stock_finalize(self, blocking: bool) -> bool:
        return True


def make_trainer(opts: dict, world: int):
    return TinyTrainer(opts, world) if opts["dry_run"] else MegatronTrainer(opts, world)
