"""CPU dry run of tests/gpu/test_real_slime_source.py's path through slime's own code (no GPU).

One job: before GPU time is spent, show that slime's actor and model modules import with the
test's stubs against this environment's megatron-core, and that slime's real `sleep`,
`save_model` and `wake_up` on the test's hand-built actor take safe_ckpt's asleep path, with
slime's group cycle (`monkey_patch_torch_dist`, `register_default_process_group`) wrapping
megatron-core's model-parallel groups over gloo, destroying them at sleep and rebuilding them at
wake-up. A tiny GPTModel on CPU, no optimizer; the device-only parts are replaced here, and only
here: torch_memory_saver's pause/resume (recorded), slime's `clear_memory`/`print_memory`,
pinned host memory, and the CUDA RNG state. slime tears WORLD down only when its backend is an
accelerator's; here the gloo WORLD is made to count as one, so `sleep()` destroys WORLD and every
group, starts a new gloo WORLD on the same store, and `wake_up()` rebuilds them, as with NCCL.

slime's shipped layout is stood for as far as the CPU allows: the args as slime's `parse_args`
sets them with --offload-train (`disable_{param,grad}_buffers_cpu_backup`), and the recording
memory saver overwrites every model parameter with NaN at `pause()` (what a region without backup
loses) and leaves it so at `resume()`: the asleep save must take the weights from slime's own
TensorBackuper (checked by loading them back with stock `dist_checkpointing.load`), and slime's
`wake_up` restores them. With `--slime-megatron DIR` (scripts/slime_megatron_patch.py's copy, put
first on the path) it also builds one `_ParamAndGradBuffer` of that Megatron with the CPU stand-in
torch_memory_saver (tests/stand_ins_tms) and checks that `param_data` and `grad_data` land in the
regions without backup and that every parameter views `param_data`.

Needs Python 3.12 with torch, megatron-core 0.19.2 (ships megatron.training), ray, transformers,
torch_memory_saver (imports without CUDA), and a slime export:
  scripts/export_slime.sh /path/to/slime.git .slime
  python3.12 -m venv /tmp/py312env && /tmp/py312env/bin/pip install torch megatron-core==0.19.2 \
      ray transformers numpy packaging psutil tqdm httpx pytest xxhash .whl/torch_memory_saver-*.whl
  /tmp/py312env/bin/python scripts/slime_real_dryrun.py .slime [--slime-megatron DIR]
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class RecordingMemorySaver:
    """Records pause/resume; ``lost`` (the parameters, in slime's layout) is overwritten at pause."""

    def __init__(self, lost=()) -> None:
        self.calls: list[str] = []
        self.lost = list(lost)

    def pause(self, *a) -> None:
        self.calls.append("pause")
        for t in self.lost:
            t.data.fill_(float("nan"))

    def resume(self, *a) -> None:
        self.calls.append("resume")


def check_patched_buffers(megatron_dir: str) -> str:
    """The ported hunks, on CPU: one `_ParamAndGradBuffer` with slime's flags, the stand-in saver."""
    import torch
    import torch.distributed as dist

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    stand_in = os.path.join(here, "tests", "stand_ins_tms")
    real = sys.modules.pop("torch_memory_saver", None)  # slime's import: the patch imports the stand-in instead
    sys.path.insert(0, stand_in)
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # the buffer allocates on the current device
    try:
        from megatron.core import mpu
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
        from megatron.core.process_groups_config import ProcessGroupCollection
        from torch_memory_saver import torch_memory_saver as tms

        assert os.path.abspath(sys.modules["megatron.core"].__file__).startswith(os.path.abspath(megatron_dir)), \
            "megatron.core was imported before the patched copy could come first"
        mpu.initialize_model_parallel()
        params = [torch.nn.Parameter(torch.randn(8, 4).bfloat16()), torch.nn.Parameter(torch.randn(16).bfloat16())]
        names = {p: f"p{i}" for i, p in enumerate(params)}
        buf = _ParamAndGradBuffer(DistributedDataParallelConfig(use_distributed_optimizer=True), torch.bfloat16,
                                  torch.float32, [(p, names[p]) for p in params], mpu.get_data_parallel_group(),
                                  40_000_000, names, 1.0, [0, 1], False, ProcessGroupCollection.use_mpu_process_groups(),
                                  disable_grad_buffers_cpu_backup=True, disable_param_buffers_cpu_backup=True)
        regions = {r.tag: (r.cpu_backup, {s.data_ptr() for s in r.storages}) for r in tms._impl.regions}
        assert regions["param_buffer"] == (False, {buf.param_data.untyped_storage().data_ptr()}), regions
        assert regions["grad_buffer"] == (False, {buf.grad_data.untyped_storage().data_ptr()}), regions
        assert all(p.untyped_storage().data_ptr() == buf.param_data.untyped_storage().data_ptr() for p in params)
        mpu.destroy_model_parallel()
    finally:
        torch.cuda.current_device = current_device
        sys.path.remove(stand_in)
        if real is not None:
            sys.modules["torch_memory_saver"] = real
    return "param_data and grad_data in torch_memory_saver regions without backup; every parameter views param_data"


def main(src: str, slime_megatron: str | None = None) -> None:
    import torch
    import torch.distributed as dist

    from tests.helpers.bodies import gpu_megatron as g
    from tests.gpu import test_real_slime_source as t

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    slime = t.import_slime(src)
    print("slime", t.slime_commit(src), "stubbed", slime["stubbed"], "megatron", t.megatron_used())
    root = tempfile.mkdtemp(prefix="slime_dryrun_")
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=0, world_size=1)
    if slime_megatron:
        print("ok:", check_patched_buffers(slime_megatron))
    from slime.utils import distributed_utils
    from slime.utils import reloadable_process_group as rpg

    rpg.monkey_patch_torch_dist()  # what slime's actor init does before Megatron builds its groups
    distributed_utils.init_gloo_group()
    rpg.register_default_process_group(timeout=datetime.timedelta(minutes=10))
    # slime tears WORLD down (to a temporary gloo WORLD) only for an accelerator backend: let this
    # gloo WORLD count as one, so sleep() destroys WORLD and every group as it does NCCL's on the GPU
    rpg._uses_accelerator_backend = lambda backend: True
    state = rpg.default_process_group_states[os.getpid()]

    from megatron.core import mpu
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import get_args

    save_dir = os.path.join(root, "safe")
    argv = [a for a in g.MODEL_ARGS if a != "--bf16"]
    sys.argv = ["dryrun", *argv, "--global-batch-size", "2", "--save", save_dir, "--use-cpu-initialization"]
    parse_and_validate_args()
    args = get_args()
    mpu.initialize_model_parallel()
    wrapped = rpg.ReloadableProcessGroup.GROUPS.get(os.getpid(), [])
    assert wrapped and isinstance(mpu.get_data_parallel_group(), rpg.ReloadableProcessGroup), "groups not wrapped"
    model = [g._model_provider()]

    # CPU stand-ins for the device-only parts (the GPU test uses the real ones)
    empty_like = torch.empty_like
    torch.empty_like = lambda *a, pin_memory=False, **k: empty_like(*a, **k)
    torch.cuda.get_rng_state = lambda *a, **k: torch.zeros(16, dtype=torch.uint8)
    actor_module = slime["actor"]
    import slime.utils.tensor_backper as backuper_module

    backuper_module.accelerator.synchronize = lambda *a, **k: None
    tms = actor_module.torch_memory_saver = RecordingMemorySaver(lost=list(model[0].parameters()))
    actor_module.clear_memory = lambda *a, **k: None
    actor_module.print_memory = lambda *a, **k: None

    t.slime_actor_args(args, save_dir)
    args.disable_grad_buffers_cpu_backup = args.disable_param_buffers_cpu_backup = True  # slime's parse_args
    args.no_save_optim = True  # no optimizer on CPU
    actor = t.hand_built_actor(actor_module, args, model, None, None)
    before = {k: v.clone() for k, v in model[0].state_dict().items() if isinstance(v, torch.Tensor)}

    from safe_ckpt.integrations import slime as integration
    from safe_ckpt.integrations.slime_asleep import installed

    integration.install(args)
    saves = installed(actor_module.MegatronTrainRayActor)
    assert saves is not None and slime["model"].save_checkpoint._safe_ckpt_asleep is saves, "install missed slime"

    actor.sleep()
    assert saves.asleep and tms.calls == ["pause"], tms.calls
    assert mpu.get_data_parallel_group().group is None, "slime's sleep left the groups up"
    assert state.accelerator_world_destroyed and state.generation == 1, state
    assert all(p.isnan().all() for p in model[0].parameters()), "the stand-in pause kept the weights"
    actor.save_model(g.FIRST, force_sync=True)
    assert tms.calls == ["pause"], f"save_model woke the actor: {tms.calls}"
    tracker = open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")).read().strip()
    assert tracker == str(g.FIRST), tracker
    actor.wake_up()
    assert tms.calls == ["pause", "resume"] and not saves.asleep, tms.calls
    assert mpu.get_data_parallel_group().group is not None, "wake_up did not rebuild the groups"
    assert not state.accelerator_world_destroyed and state.generation == 2, state
    after = model[0].state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "weights changed across the cycle"
    # what the asleep save wrote, read back with stock torch.distributed.checkpoint (no process group:
    # Megatron's loader would go through slime's wrapped collectives, which want an accelerator)
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from tests.helpers.megatron_evidence import _read_dcp

    stored = _read_dcp(os.path.join(save_dir, "iter_%07d" % g.FIRST))
    checked = 0
    for sh in model[0].sharded_state_dict().values():
        if not isinstance(sh, ShardedTensor) or not sh.data.is_floating_point():
            continue
        box = tuple(slice(o, o + n) for o, n in zip(sh.global_offset, (1,) * sh.prepend_axis_num + tuple(sh.data.shape)))
        assert torch.equal(stored[sh.key][box].reshape(sh.data.shape), sh.data), f"{sh.key}: not slime's weights"
        checked += 1
    assert checked, "no weights checked"

    # as slime's loop saves between rollouts (no force_sync): save_model returns while the writes go on
    actor.sleep()
    actor.save_model(g.FIRST + 1)
    hold_s = saves.last_hold_s
    handle = saves.inflight
    assert handle is not None, "no asleep save in flight after save_model"
    handle.wait(timeout=300)
    actor.wake_up()
    assert tms.calls == ["pause", "resume", "pause", "resume"], tms.calls
    tracker = open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")).read().strip()
    assert tracker == str(g.FIRST + 1), tracker

    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(os.path.join(save_dir, "iter_%07d" % g.FIRST))
    print(f"ok: the asleep save wrote slime's TensorBackuper weights ({checked} tensors, the parameters NaN while "
          "asleep), read back with stock DCP")
    print(f"ok: WORLD and {len(wrapped)} wrapped groups destroyed and rebuilt twice; save_model held "
          f"{hold_s:.3f} s asleep without force_sync (no resume); tracker {tracker}; common state {sorted(common)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("src", nargs="?", default=os.environ.get("SLIME_SRC", ".slime"))
    parser.add_argument("--slime-megatron", default=None, help="scripts/slime_megatron_patch.py's copy of megatron")
    cli = parser.parse_args()
    if cli.slime_megatron:  # first on the path before anything imports megatron
        sys.path.insert(0, cli.slime_megatron)
    main(cli.src, cli.slime_megatron)
