"""Bodies of the copy-window GPU tests (run in spawned ranks on cuda:0, see mp.py); imported only
where CUDA exists.

The core cases drive the window, its copier and the gates directly with real CUDA streams and a
real fused CUDA AdamW; a spin kernel enqueued first on the copy stream (`torch.cuda._sleep`)
holds the copies so the ordering is decided by the gate, not by timing. The integration case
saves a real GPTModel through the Megatron drop-in in the overlap mode (`--safe-ckpt-overlap-copy`
with `--async-save`), and profiles that save against a plain step.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

SPIN_CYCLES = 400_000_000  # ~0.2 s on an H100/H200: far longer than enqueuing the step
CHUNK_NUMEL = 4 << 20  # 16 MiB fp32 chunks


class _Writer:
    """Stands for the pipeline's writers: reads each staged chunk's bytes, releases its lease."""

    def __init__(self) -> None:
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.written: dict = {}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def put(self, item, staged) -> None:
        self.items.put((item, staged))

    def close(self) -> None:
        self.items.put(None)
        self.thread.join(120)

    def _run(self) -> None:
        while True:
            entry = self.items.get()
            if entry is None:
                return
            item, staged = entry
            try:
                self.written[item] = b"".join(bytes(v) for v in staged.ready())
            finally:
                staged.release()


def _optimizer(n_params: int, numel: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(numel, device="cuda", generator=g)) for _ in range(n_params)]
    for p in params:
        p.grad = torch.randn(numel, device="cuda", generator=g)
    opt = torch.optim.AdamW(params, lr=0.1, fused=True)
    opt.step()
    for p in params:
        p.grad = torch.randn(numel, device="cuda", generator=g)
    tensors = {}
    for i, p in enumerate(params):
        tensors[f"p{i}"] = p.detach()
        tensors[f"p{i}.exp_avg"] = opt.state[p]["exp_avg"]
        tensors[f"p{i}.exp_avg_sq"] = opt.state[p]["exp_avg_sq"]
    return opt, tensors


def _window(tensors: dict, pool, *, name: str, timeout_s: float = 120.0):
    from safe_ckpt.staging.source_sums import DeviceSums
    from safe_ckpt.staging.streams import CudaStreams
    from safe_ckpt.staging.window import CopyWindow, WindowSource
    from safe_ckpt.staging.window_copier import ChunkJob

    streams = CudaStreams(page_locked=pool.pinned)
    sources, jobs = [], []
    for index, (key, t) in enumerate(tensors.items()):
        flat = t.view(-1)
        pieces = [flat[a:a + CHUNK_NUMEL] for a in range(0, flat.numel(), CHUNK_NUMEL)]
        sources.append(WindowSource(index=index, key=key, tensor=t, device=t.device.index, chunks=len(pieces),
                                    size_bytes=t.numel() * t.element_size(), version=t._version))
        jobs += [ChunkJob(index, piece, (key, k)) for k, piece in enumerate(pieces)]
    window = CopyWindow(sources, streams, DeviceSums(streams), name=name, rank=torch.distributed.get_rank(),
                        timeout_s=timeout_s)
    return window, jobs


def _chunks(t: torch.Tensor) -> list[bytes]:
    flat = t.detach().reshape(-1).cpu()
    return [flat[a:a + CHUNK_NUMEL].numpy().tobytes() for a in range(0, flat.numel(), CHUNK_NUMEL)]


def _compare(written: dict, tensors: dict) -> dict:
    """Per key: how many chunks hold the given tensors' values, and how many chunks there are."""
    out = {}
    for key, t in tensors.items():
        expected = _chunks(t)
        out[key] = [sum(written.get((key, k)) == data for k, data in enumerate(expected)), len(expected)]
    return out


def gate_orders_the_step_after_held_copies(rank, world, root, gated: bool) -> dict:
    """Copies held behind a spin kernel on the copy stream; a fused CUDA AdamW step right after every
    copy is issued. Gated: the step's kernels queue behind the copies (the host is not blocked) and
    the checkpoint bytes are the pre-step values. Not gated (the control): the step runs first,
    the copies read post-step values, and the content sums fail the window."""
    from safe_ckpt.errors import SourceModifiedError
    from safe_ckpt.staging import gates
    from safe_ckpt.staging.pool import PinnedPool
    from safe_ckpt.staging.window_copier import WindowCopier

    torch.cuda.set_device(0)
    opt, tensors = _optimizer(n_params=2, numel=3 * CHUNK_NUMEL + 1234, seed=11)
    pre = {k: t.clone() for k, t in tensors.items()}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    pool = PinnedPool(total + (64 << 20))
    pool.preallocate()
    torch.cuda.synchronize()
    window, jobs = _window(tensors, pool, name=f"{root}/ck")
    writer = _Writer()
    copier = WindowCopier(window, pool)
    rest = copier.open(jobs, writer.put)
    if gated:
        gates.track(window)
    spin_start, spin_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def spin():
        spin_start.record()
        torch.cuda._sleep(SPIN_CYCLES)
        spin_end.record()

    window.streams.call(0, spin)
    copier.run(rest, writer.put)
    t0 = time.perf_counter()
    opt.step()  # the gate: a stream wait, then the fused kernels
    step_host_s = time.perf_counter() - t0
    last_done_at_step = window.last_marks()[0].done()
    torch.cuda.synchronize()
    error = None
    try:
        window.settle()
    except SourceModifiedError as exc:
        error = str(exc)
    writer.close()
    post = {k: t.clone() for k, t in tensors.items()}
    return {"gated": gated, "step_host_s": step_host_s, "spin_s": spin_start.elapsed_time(spin_end) / 1000,
            "copies_done_when_step_returned": last_done_at_step, "error": error,
            "pre_step_chunks": _compare(writer.written, pre), "post_step_chunks": _compare(writer.written, post),
            "stats": window.stats().__dict__, "hook_calls": gates.hook_calls()}


def uncovered_device_writes(rank, world, root) -> dict:
    """A write no gate orders while copies are held: through ``.data`` on the current stream (the
    content sums see it), and in place under no_grad (the version counter sees it)."""
    from safe_ckpt.errors import SourceModifiedError
    from safe_ckpt.staging.pool import PinnedPool
    from safe_ckpt.staging.window_copier import WindowCopier

    torch.cuda.set_device(0)
    out = {}
    for how in ("data_add", "in_place"):
        g = torch.Generator(device="cuda").manual_seed(5)
        tensors = {"w": torch.randn(2 * CHUNK_NUMEL, device="cuda", generator=g),
                   "other": torch.randn(CHUNK_NUMEL + 77, device="cuda", generator=g)}
        pool = PinnedPool(64 << 20)
        window, jobs = _window(tensors, pool, name=f"{root}/{how}")
        writer = _Writer()
        copier = WindowCopier(window, pool)
        rest = copier.open(jobs, writer.put)
        window.streams.call(0, lambda: torch.cuda._sleep(SPIN_CYCLES))
        w = tensors["w"]
        if how == "data_add":
            w.data.add_(1.0)  # current stream, no gate: runs before the held copies
        else:
            with torch.no_grad():
                w.add_(1.0)
        try:
            copier.run(rest, writer.put)
        except SourceModifiedError:
            pass
        torch.cuda.synchronize()
        try:
            window.settle()
            out[how] = None
        except SourceModifiedError as exc:
            out[how] = str(exc)
        writer.close()
    return out


def save_copies_make_no_host_to_device_copy_and_no_nccl(rank, world, root) -> dict:
    """The window's whole life (open, opening sums, copies, closing sums, settle) under the profiler."""
    from safe_ckpt.staging.pool import PinnedPool
    from safe_ckpt.staging.window_copier import WindowCopier
    from tests.helpers.bodies.gpu_slime_asleep import profile_counts
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.set_device(0)
    opt, tensors = _optimizer(n_params=2, numel=2 * CHUNK_NUMEL + 5, seed=3)
    pool = PinnedPool(256 << 20)
    pool.preallocate()
    torch.cuda.synchronize()
    window, jobs = _window(tensors, pool, name=f"{root}/ck")
    writer = _Writer()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        copier = WindowCopier(window, pool)
        copier.run(copier.open(jobs, writer.put), writer.put)
        window.settle()
        torch.cuda.synchronize()
    writer.close()
    return {"counts": profile_counts(prof), "chunks": _compare(writer.written, tensors)}


def memory_saver_pause_waits_for_copies(rank, world, root) -> dict:
    """torch_memory_saver's pause of a region without backup while the window's copies are held:
    guarded, it waits for them (no CUDA error), and the checkpoint bytes are the pre-pause ones."""
    from safe_ckpt.staging import gates
    from safe_ckpt.staging.pool import PinnedPool
    from safe_ckpt.staging.window_copier import WindowCopier
    from tests.helpers.bodies.gpu_slime_asleep import _memory_saver

    torch.cuda.set_device(0)
    tms = _memory_saver()
    g = torch.Generator(device="cuda").manual_seed(9)
    with tms.region(tag="zs", enable_cpu_backup=False):
        w = torch.randn(3 * CHUNK_NUMEL, device="cuda", generator=g)
    pre = {"w": w.clone()}
    gates.guard_memory_saver(tms)
    pool = PinnedPool(128 << 20)
    window, jobs = _window({"w": w}, pool, name=f"{root}/ck")
    writer = _Writer()
    copier = WindowCopier(window, pool)
    rest = copier.open(jobs, writer.put)
    gates.track(window)
    window.streams.call(0, lambda: torch.cuda._sleep(SPIN_CYCLES))
    copier.run(rest, writer.put)
    t0 = time.perf_counter()
    tms.pause("zs")  # waits on the host for the held copies
    pause_s = time.perf_counter() - t0
    window.settle()
    writer.close()
    tms.resume("zs")
    torch.cuda.synchronize()
    return {"pause_s": pause_s, "chunks": _compare(writer.written, pre)}


def overlap_save_then_train(rank, world, root, variant) -> dict:
    """Megatron drop-in in the overlap mode: train FIRST steps, save (the call returns after
    planning; the copies run during the next step's forward and backward, behind the optimizer
    step's gate), train SECOND more steps, finish the save. Run `gpu_megatron_cases.run`'s
    "resume" mode on the same root afterwards."""
    import os

    import safe_ckpt.megatron as safe_megatron
    from safe_ckpt.staging import gates
    from tests.helpers.bodies import gpu_megatron as g
    from tests.helpers.megatron_evidence import evidence, opt_digest

    save_dir = os.path.join(root, "safe")
    model, optimizer, scheduler = g._setup(save_dir, variant, world)
    from megatron.training import get_args

    args = get_args()
    losses = g._train(model, optimizer, scheduler, 0, g.FIRST)
    digest = evidence(opt_digest, optimizer, scheduler)
    args.async_save = True
    args.safe_ckpt_overlap_copy = True
    calls = gates.hook_calls()
    t0 = time.perf_counter()
    handle = safe_megatron.save_checkpoint(g.FIRST, model, optimizer, scheduler, num_floating_point_operations_so_far=0)
    call_s = time.perf_counter() - t0
    losses += g._train(model, optimizer, scheduler, g.FIRST, g.FIRST + g.SECOND)
    results = safe_megatron.finalize_async_saves(blocking=True)
    return {"losses": losses, "opt_digest": digest, "call_s": call_s, "gated_steps": gates.hook_calls() - calls,
            "window": handle.window_stats().__dict__, "saved": len(results)}


def overlap_save_under_the_profiler(rank, world, root, variant) -> dict:
    """The Megatron drop-in's overlapped save (the call, the next training step whose zero_grad
    opens the window and whose optimizer step is gated, and the save's completion) under the
    profiler, against one plain training step: the save adds no host-to-device copy and no NCCL
    work (the step's own batch copies and collectives are the same in both)."""
    import os

    import safe_ckpt.megatron as safe_megatron
    from tests.helpers.bodies import gpu_megatron as g
    from tests.helpers.bodies.gpu_slime_asleep import profile_counts
    from torch.profiler import ProfilerActivity, profile

    model, optimizer, scheduler = g._setup(os.path.join(root, "safe"), variant, world)
    from megatron.training import get_args

    args = get_args()
    g._train(model, optimizer, scheduler, 0, 2)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as plain:
        g._train(model, optimizer, scheduler, 2, 3)
        torch.cuda.synchronize()
    args.async_save = True
    args.safe_ckpt_overlap_copy = True
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as saved:
        handle = safe_megatron.save_checkpoint(3, model, optimizer, scheduler, num_floating_point_operations_so_far=0)
        g._train(model, optimizer, scheduler, 3, 4)
        results = safe_megatron.finalize_async_saves(blocking=True)
        torch.cuda.synchronize()
    args.async_save = False
    stats = handle.window_stats()
    return {"plain": profile_counts(plain), "saved": profile_counts(saved), "results": len(results),
            "window": None if stats is None else stats.__dict__, "return_after": handle.stall_s}
