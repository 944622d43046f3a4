"""Body of the GPU asleep-save test (tests/gpu/test_slime_offloaded_actors.py): a real GPTModel with Megatron's
DistributedOptimizer whose whole training state lives in a real torch_memory_saver region with a
CPU backup, trained, put to sleep (paused), saved asleep by safe_ckpt's slime path, while a
rollout stand-in then takes the freed GPU memory; woken up, trained on. A fresh process resumes
from the asleep checkpoint with stock `load_checkpoint`; both must match an uninterrupted run bit
for bit. Needs CUDA, torch_memory_saver with CPU backup, and Megatron-LM's `megatron.training`.

The asleep save runs as slime's actor runs it (`slime_asleep.start_asleep_save` on the detached
gloo group, with the ranks pinned to the groups as they were before sleep), under
torch.profiler: host-to-device copies, kernels and NCCL calls during the save are counted.

With ``resume_at_once`` the save starts through the actor's own route (`AsleepSaves.routing`, as
slime's `save` reaches it) and `torch_memory_saver.resume()` is called right after, with no wait, as
the driver's `onload()` would: the resume guard must hold it until the save is durable, and the
checkpoint must still resume bit for bit (without the guard the resume copies the backup back and
frees it while the writers read it).
"""

from __future__ import annotations

import os
import time

import torch

TAG = "train"
ROLLOUT_FILL = 0.8  # share of the free GPU memory the rollout stand-in takes while the state sleeps


def _memory_saver():
    from torch_memory_saver import torch_memory_saver

    try:
        torch_memory_saver.hook_mode = "torch"  # before its first use in this process
    except (AttributeError, AssertionError):
        pass
    return torch_memory_saver


def profile_counts(prof) -> dict:
    """Device activity in a profile: host-to-device copies, kernels, NCCL (by event name)."""
    from torch.autograd import DeviceType

    htod = kernels = nccl = dtoh = 0
    kernel_names = []
    for e in prof.events():
        name = e.name or ""
        if "nccl" in name.lower():
            nccl += 1
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        if "HtoD" in name:
            htod += 1
        elif "DtoH" in name:
            dtoh += 1
        elif not name.startswith(("Memcpy", "Memset")):
            kernels += 1
            kernel_names.append(name)
    return {"HtoD": htod, "DtoH": dtoh, "kernels": kernels, "nccl": nccl, "kernel_names": kernel_names[:10]}


def run(rank, world, root, variant, resume_at_once=False) -> dict:
    """Train FIRST in a pauseable region, pause, save asleep, fill the freed memory, resume, train SECOND."""
    from torch.profiler import ProfilerActivity, profile

    from safe_ckpt.integrations import slime_asleep, slime_groups
    from tests.helpers.bodies import gpu_megatron as g

    # megatron.core's inference code sets torch_memory_saver's hook mode when it is first
    # imported, which fails once a region has been used: import it before the first region
    import megatron.core  # noqa: F401
    import megatron.training  # noqa: F401

    tms = _memory_saver()
    save_dir = os.path.join(root, "safe")
    with tms.region(tag=TAG, enable_cpu_backup=True):  # as slime's preload mode: the whole state pauseable
        model, optimizer, scheduler = g._setup(save_dir, variant, world)
        from megatron.training import get_args

        args = get_args()
        out = {"losses_first": g._train(model, optimizer, scheduler, 0, g.FIRST)}
    torch.cuda.synchronize()
    from tests.helpers.megatron_evidence import evidence, opt_digest

    out["opt_digest"] = evidence(opt_digest, optimizer, scheduler)  # awake: the state the save must hold
    slime_groups.install_detached_support()
    group = slime_groups.create_detached_gloo(120.0)  # at install, awake
    snapshot = slime_groups.snapshot_groups()  # what the actor's sleep() records first
    free_awake = torch.cuda.mem_get_info()[0]
    tms.pause(TAG)  # slime's sleep (its group teardown is the CPU tests' business)
    out["freed_bytes"] = torch.cuda.mem_get_info()[0] - free_awake

    if resume_at_once:
        out.update(_resume_at_once(tms, args, model, optimizer, scheduler, group, snapshot, g.FIRST))
        with tms.region(tag=TAG, enable_cpu_backup=True):
            out["losses_second"] = g._train(model, optimizer, scheduler, g.FIRST, g.FIRST + g.SECOND)
        out["tracker"] = open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")).read().strip()
        return out

    start = time.monotonic()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        handle = slime_asleep.start_asleep_save(args, model, optimizer, scheduler, g.FIRST, group, snapshot)
        out["save_model_held_s"] = time.monotonic() - start
        result = handle.wait()
        torch.cuda.synchronize()
    out["durable_s"] = time.monotonic() - start
    out["asleep_save_profile"] = profile_counts(prof)
    out["bytes_by_residence"] = dict(result.bytes_by_residence)

    # the rollout stand-in: takes most of the memory the paused state gave back, and writes it
    free = torch.cuda.mem_get_info()[0]
    filler = torch.empty(int(free * ROLLOUT_FILL), dtype=torch.uint8, device="cuda")
    filler.fill_(0xA5)
    torch.cuda.synchronize()
    out["rollout_bytes"] = filler.numel()
    del filler
    torch.cuda.empty_cache()

    tms.resume(TAG)  # slime's wake_up: the backup copied back
    with tms.region(tag=TAG, enable_cpu_backup=True):
        out["losses_second"] = g._train(model, optimizer, scheduler, g.FIRST, g.FIRST + g.SECOND)
    out["tracker"] = open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")).read().strip()
    return out


def _resume_at_once(tms, args, model, optimizer, scheduler, group, snapshot, iteration) -> dict:
    """Start the asleep save as slime's `save` does inside `save_model`, then resume at once."""
    from safe_ckpt.integrations import slime_asleep, slime_resume_guard

    saves = slime_asleep.AsleepSaves(group)
    saves.snapshot, saves.asleep = snapshot, True
    guarded = slime_resume_guard.guard_resume(saves)  # what install and every hooked sleep() do

    def awake_save(*_a, **_k):
        raise AssertionError("the save took the awake path")

    start = time.monotonic()
    saves.bracket = slime_asleep.Bracket(start, False)
    inflight = saves.routing(awake_save)(iteration, model, optimizer, scheduler)
    saves.bracket = None
    held_s = time.monotonic() - start
    in_flight_at_resume = not inflight.done()
    tms.resume(TAG)  # the driver's onload(): not hooked, only the guard stands in its way
    resumed_s = time.monotonic() - start
    return {"guarded": guarded, "save_model_held_s": held_s, "resume_returned_s": resumed_s,
            "done_when_resumed": inflight.done(),
            "in_flight_at_resume": in_flight_at_resume, "resume_waited_s": saves.last_wake_wait_s,
            "asleep_after": saves.asleep, "bytes_by_residence": dict(inflight.wait(0).bytes_by_residence)}
