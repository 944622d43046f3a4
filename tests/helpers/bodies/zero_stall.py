"""Rank bodies of the copy-window tests that save through the public API (run in spawned ranks, see mp.py)."""

from __future__ import annotations

import threading

import torch

WAIT_S = 60.0


def fused_cpu_adam_step_between_item_writes(rank, world, root) -> dict:
    """`safe_ckpt.async_save` of host-resident AdamW state (param and exp_avg, as
    `--optimizer-cpu-offload` keeps them), then the next training step's fused CPU AdamW (what
    Megatron's HybridDeviceOptimizer runs: `torch.optim.AdamW(fused=True)`) while the save is
    between two items' writes: the first item written, the next not yet read. Returns what stock
    `megatron.core.dist_checkpointing.load` reads back, chunk by chunk, against the values before
    and after the step."""
    import os

    import safe_ckpt
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from safe_ckpt.staging import gates
    from tests.helpers.hooked_sinks import HookedSink

    n, chunks = 1 << 18, 4  # 1 MiB per tensor, saved in 256 KiB chunks
    g = torch.Generator().manual_seed(4242 + rank)
    w = torch.nn.Parameter(torch.randn(n, generator=g))
    w.grad = torch.randn(n, generator=g)
    opt = torch.optim.AdamW([w], lr=0.1, fused=True)
    opt.step()  # the state exists, as after any earlier step
    m = opt.state[w]["exp_avg"]
    w.grad = torch.randn(n, generator=g)
    before = {"w": w.detach().clone(), "m": m.clone()}

    between, go = threading.Event(), threading.Event()

    class BetweenItems(HookedSink):
        opened = 0

        def open(self, relative_path, size_bytes):
            BetweenItems.opened += 1
            if BetweenItems.opened == 2:  # the first item is written; the next is not yet read
                between.set()
                go.wait(WAIT_S)
            return super().open(relative_path, size_bytes)

    def sharded():
        return {"w": ShardedTensor.from_rank_offsets("w", w.detach(), replica_id=0),
                "m": ShardedTensor.from_rank_offsets("m", m, replica_id=0)}

    path = os.path.join(root, "ck")
    opts = safe_ckpt.SaveOptions(chunk_bytes=n * 4 // chunks, io_threads=1, progress_interval_s=0,
                                 sink_factory=lambda d: BetweenItems(d))
    handle = safe_ckpt.async_save(sharded(), path, options=opts)
    assert between.wait(WAIT_S), "the save never reached its second item"

    stepped = threading.Event()
    step_errors: list = []

    def step():
        try:
            opt.step()  # the next training step's optimizer, while the save is still writing
        except BaseException as exc:
            step_errors.append(repr(exc))
        finally:
            stepped.set()

    threading.Thread(target=step, daemon=True).start()
    # Today the step runs at once. With the host gate, it waits in its pre-hook until w and m are
    # written, which needs the held write to go on: wait for whichever comes first.
    held = False
    for _ in range(int(WAIT_S * 100)):
        if stepped.wait(0.01):
            break
        if any(window.gate_blocked.is_set() for window in gates.open_windows()):
            held = True
            break
    go.set()
    assert stepped.wait(WAIT_S), "the optimizer step never ran"
    out = {"step_errors": step_errors, "step_waited_for_the_save": held, "versions": [w._version, m._version]}
    try:
        out["result_files"] = len(handle.wait(timeout=WAIT_S).files)
    except safe_ckpt.CheckpointError as exc:
        out["save_error"] = f"{type(exc).__name__}: {exc}"
        return out
    target = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(n), replica_id=0),
              "m": ShardedTensor.from_rank_offsets("m", torch.empty(n), replica_id=0)}
    loaded = dist_checkpointing.load(target, path)
    after = {"w": w.detach(), "m": m}
    size = n // chunks
    out["chunks"] = {
        key: ["pre-step" if torch.equal(loaded[key][k * size:(k + 1) * size], before[key][k * size:(k + 1) * size])
              else "post-step" if torch.equal(loaded[key][k * size:(k + 1) * size], after[key][k * size:(k + 1) * size])
              else "neither" for k in range(chunks)]
        for key in ("w", "m")}
    out["live_changed"] = not torch.equal(after["w"], before["w"])
    return out


def failed_write_releases_the_host_gate(rank, world, root) -> dict:
    """An `async_save` of host-resident AdamW state whose second file cannot be opened while the
    next step's fused AdamW waits at the host gate: the failure releases the step at once (it does
    not wait out the gate's timeout), the save raises the write's error and publishes nothing."""
    import errno
    import os

    import safe_ckpt
    from megatron.core.dist_checkpointing import ShardedTensor
    from safe_ckpt.staging import gates
    from tests.helpers.hooked_sinks import HookedSink

    n = 1 << 18
    g = torch.Generator().manual_seed(77 + rank)
    w = torch.nn.Parameter(torch.randn(n, generator=g))
    w.grad = torch.randn(n, generator=g)
    opt = torch.optim.AdamW([w], lr=0.1, fused=True)
    opt.step()
    m = opt.state[w]["exp_avg"]
    held, fail = threading.Event(), threading.Event()

    class FailsSecondOpen(HookedSink):
        opened = 0

        def open(self, relative_path, size_bytes):
            FailsSecondOpen.opened += 1
            if FailsSecondOpen.opened == 2:
                held.set()
                fail.wait(WAIT_S)
                raise OSError(errno.EIO, "injected: the device went away", relative_path)
            return super().open(relative_path, size_bytes)

    path = os.path.join(root, "ck")
    opts = safe_ckpt.SaveOptions(chunk_bytes=n, io_threads=1, progress_interval_s=0,
                                 collective_timeout_s=WAIT_S, sink_factory=lambda d: FailsSecondOpen(d))
    sharded = {"w": ShardedTensor.from_rank_offsets("w", w.detach(), replica_id=0),
               "m": ShardedTensor.from_rank_offsets("m", m, replica_id=0)}
    handle = safe_ckpt.async_save(sharded, path, options=opts)
    assert held.wait(WAIT_S), "the save never reached its second file"
    stepped = threading.Event()
    threading.Thread(target=lambda: (opt.step(), stepped.set()), daemon=True).start()
    blocked = False
    for _ in range(int(WAIT_S * 100)):  # the step must reach the gate and block there
        if any(window.gate_blocked.is_set() for window in gates.open_windows()):
            blocked = True
            break
        if stepped.wait(0.01):
            break
    stepped_before_failure = stepped.is_set()
    fail.set()
    out = {"blocked": blocked, "stepped_before_failure": stepped_before_failure,
           "stepped_after_failure": stepped.wait(WAIT_S / 2)}
    try:
        handle.wait(timeout=WAIT_S)
        out["save_error"] = None
    except safe_ckpt.CheckpointError as exc:
        out["save_error"] = f"{type(exc).__name__}: {exc}"
    out["published"] = os.path.exists(path)
    out["open_windows"] = len(gates.open_windows())
    return out


def gate_timeout_abandons_the_save(rank, world, root) -> dict:
    """An `async_save` of host-resident AdamW state to a target that holds every write, the next
    step at the host gate past `collective_timeout_s`: the step goes on, the save fails with
    `StagingTimeoutError` (the cause, not the step's later write), and the writers stop."""
    import os

    import safe_ckpt
    from megatron.core.dist_checkpointing import ShardedTensor
    from tests.helpers.hooked_sinks import HookedSink

    n = 1 << 18
    g = torch.Generator().manual_seed(91 + rank)
    w = torch.nn.Parameter(torch.randn(n, generator=g))
    w.grad = torch.randn(n, generator=g)
    opt = torch.optim.AdamW([w], lr=0.1)
    opt.step()
    release, writes = threading.Event(), []

    class Held(HookedSink):
        def before_write(self):
            writes.append(release.is_set())
            release.wait(WAIT_S)

    opts = safe_ckpt.SaveOptions(chunk_bytes=n * 4 // 8, io_threads=1, progress_interval_s=0,
                                 collective_timeout_s=1.0, sink_factory=lambda d: Held(d))
    sharded = {"w": ShardedTensor.from_rank_offsets("w", w.detach(), replica_id=0),
               "m": ShardedTensor.from_rank_offsets("m", opt.state[w]["exp_avg"], replica_id=0)}
    handle = safe_ckpt.async_save(sharded, os.path.join(root, "ck"), options=opts)
    opt.step()  # waits at the gate for 1 s, then the save is abandoned and the step goes on
    release.set()
    out = {"writes_before_release": writes.count(False)}
    try:
        handle.wait(timeout=WAIT_S)
        out["save_error"] = None
    except safe_ckpt.CheckpointError as exc:
        out["save_error"] = f"{type(exc).__name__}: {exc}"
    out["writes_after_release"] = writes.count(True)
    out["items"] = 16
    out["published"] = os.path.exists(os.path.join(root, "ck"))
    return out
