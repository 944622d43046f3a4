"""The weights-source selection of slime's asleep save (safe_ckpt/integrations/slime_sources.py),
in-process: slime's TensorBackuper (its mirror, tests/slime_mirror/utils/tensor_backper.py) over
parameters that view one flat buffer, as slime's patched DDP lays them out; and an asleep save
that fails at its build counting at exit like a failed asynchronous save."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from safe_ckpt.residence import classify as residence
from safe_ckpt.integrations import slime_sources
from tests.slime_mirror.utils.tensor_backper import TensorBackuper
from tests.helpers.paths import REPO


def _params(seed=0):
    """Parameters viewing one flat bf16 buffer (slime's `param_data`), with slime's global names."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"module.module.embedding.word_embeddings.weight": (64, 16),
              "module.module.decoder.layers.0.mlp.linear_fc1.weight": (2 * 24, 16),
              "module.module.decoder.layers.0.input_layernorm.weight": (16,)}
    flat = torch.empty(sum(torch.Size(s).numel() for s in shapes.values()) + 7, dtype=torch.bfloat16)
    params, offset = [], 3  # padding before and after, as Megatron's buffers have
    for name, shape in shapes.items():
        n = torch.Size(shape).numel()
        view = flat[offset:offset + n].view(shape)
        view.copy_(torch.randn(shape, generator=g).to(torch.bfloat16))
        params.append((name, torch.nn.Parameter(view, requires_grad=False)))
        offset += n
    return flat, params


def test_each_view_of_a_parameter_is_answered_from_slimes_copy_of_it():
    flat, params = _params()
    backuper = TensorBackuper.create(source_getter=lambda: iter(params), single_tag=None)
    backuper.backup("actor")
    expected = {name: p.detach().clone() for name, p in params}
    flat.fill_(float("nan"))  # what pause leaves in a region without backup
    matched = slime_sources.match_weights(backuper)
    assert matched.unmatched == () and matched.copies is not None
    copies = matched.copies
    fc1 = dict(params)["module.module.decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = torch.chunk(fc1, 2, dim=0)  # Megatron's GLU factory saves the halves
    for view, want in ((gate, expected[fc1_name := "module.module.decoder.layers.0.mlp.linear_fc1.weight"][:24]),
                       (up, expected[fc1_name][24:]),
                       (dict(params)["module.module.embedding.word_embeddings.weight"][5:9, 3:],
                        expected["module.module.embedding.word_embeddings.weight"][5:9, 3:])):
        got = copies.lookup(view)
        assert got is not None and got.device.type == "cpu" and torch.equal(got, want)
    # not inside one parameter, another dtype, the padding: no answer
    assert copies.lookup(flat[:5]) is None and copies.lookup(flat.view(torch.int16)[3:10]) is None
    assert copies.lookup(flat[-4:]) is None
    # through the residence seam, only while registered
    with residence.host_copies(copies.lookup, slime_sources.COPIES_WHAT):
        c = residence.classify(gate, allow_cpu_backup=True)
        assert c.residence == "host_copy" and torch.equal(c.source, expected[fc1_name][:24])
        assert residence.classify(gate).residence == "pageable"  # without cpu_backup: not asked
    assert residence.classify(gate, allow_cpu_backup=True).residence == "pageable"


def test_copies_that_do_not_fit_are_not_used():
    flat, params = _params()
    backuper = TensorBackuper.create(source_getter=lambda: iter(params), single_tag=None)
    backuper.backup("actor")
    name = params[0][0]
    backuper.get("actor")[name] = backuper.get("actor")[name].float()  # another dtype
    matched = slime_sources.match_weights(backuper)
    assert matched.unmatched == (name,) and "torch.float32" in matched.notes[0]
    assert matched.copies.lookup(params[0][1]) is None and matched.copies.lookup(params[1][1]) is not None
    noop = TensorBackuper.create(source_getter=lambda: iter(params), single_tag="actor")
    noop.backup("actor")
    assert slime_sources.match_weights(noop).copies is None  # its get() would read the live parameters
    fresh = TensorBackuper.create(source_getter=lambda: iter(params), single_tag=None)
    fresh.backup("ref")  # no "actor" copies: slime's wake_up restores those
    assert slime_sources.match_weights(fresh).copies is None and "actor" not in fresh.backup_tags


def test_without_copies_the_weights_of_a_region_without_backup_have_no_source():
    flat, params = _params()

    class Chunk:
        def named_parameters(self):
            return iter(params)

        def named_buffers(self):
            return iter(())

    class Actor:
        role, model, optimizer = "actor", [Chunk()], None
        weights_backuper = TensorBackuper.create(source_getter=lambda: iter(params), single_tag="actor")

    class Args:
        disable_param_buffers_cpu_backup = True
        use_distributed_optimizer = True

    check = slime_sources.check_sources(Actor(), Args())
    assert check.copies is None and len(check.unreadable) == 3
    assert "no readable source while asleep for 3 tensor(s): model[0].module.module.embedding" in check.reason()
    Actor.weights_backuper = TensorBackuper.create(source_getter=lambda: iter(params), single_tag=None)
    Actor.weights_backuper.backup("actor")
    assert slime_sources.check_sources(Actor(), Args()).unreadable == ()


def test_the_ddp_buffers_kept_without_backup_are_never_asked_of_the_memory_saver():
    """slime's patched DDP allocates param_data and grad_data without CPU backup; asked about such a
    paused allocation, torch_memory_saver 0.0.10 calls exit(1), so every tensor touching one is
    classified without asking it."""
    flat, params = _params()
    grads = torch.zeros(flat.numel(), dtype=torch.float32)

    class Buffer:
        param_data, grad_data = flat, grads

    class Chunk:
        buffers, expert_parallel_buffers = [Buffer()], []

    class Args:
        disable_param_buffers_cpu_backup = True
        disable_grad_buffers_cpu_backup = True
        use_distributed_optimizer = True

    regions = slime_sources.regions_without_backup([Chunk()], Args())
    assert regions is not None and regions.what == "the DDP param_data and the DDP grad_data"
    fc1 = params[1][1]
    assert regions.holds(fc1) and regions.holds(torch.chunk(fc1, 2)[1]) and regions.holds(grads[5:9])
    assert not regions.holds(torch.zeros(4, dtype=torch.bfloat16)) and not regions.holds(flat[:0])
    other = Args()
    other.disable_grad_buffers_cpu_backup = False
    only_params = slime_sources.regions_without_backup([Chunk()], other)
    assert only_params.what == "the DDP param_data" and not only_params.holds(grads)
    other.disable_param_buffers_cpu_backup = False
    assert slime_sources.regions_without_backup([Chunk()], other) is None
    with slime_sources.guarded(regions):
        assert residence._known_without_backup(grads[3:]) == regions.what
    assert residence._known_without_backup(grads[3:]) is None


BREAK = {
    "build": """
        from megatron.training import checkpointing as mck
        def broken(*a, **k):
            raise RuntimeError("state dict construction broke")
        mck.generate_state_dict = broken
    """,
    "write": """
        import errno
        actor.arm_fault({"after_bytes": 10_000, "errno": errno.ENOSPC})
    """,
}


def test_a_model_chunk_not_wrapped_in_ddp_has_no_buffers_and_checks_cleanly():
    """An unwrapped module's `buffers` is nn.Module's method, not Megatron's list of DDP buffers:
    it holds no region without backup, and the check goes on (it used to fail and wake the actor)."""

    class Args:
        disable_param_buffers_cpu_backup = True
        disable_grad_buffers_cpu_backup = True
        use_distributed_optimizer = True

    regions = slime_sources.regions_without_backup([torch.nn.Linear(4, 4)], Args())
    assert regions is None or not regions.holds(torch.zeros(4))


@pytest.mark.parametrize("step", ["build", "write"])
def test_an_asleep_save_that_fails_makes_the_exiting_process_exit_1(tmp_path, step):
    """No wake_up follows (the run ends): the failure, at the state dict's build or at a later
    step (a write), must not be lost in a log line."""
    script = textwrap.dedent(f"""
        import os, socket, sys
        sys.path[:0] = [{REPO!r}, {os.path.join(REPO, "tests", "stand_ins")!r}]
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        from tests.helpers.bodies.slime_asleep import _actor
        actor = _actor(0, 1, {str(tmp_path)!r}, extra=["--tensor-model-parallel-size", "1"])
    """) + textwrap.dedent(BREAK[step]) + textwrap.dedent("""
        actor.sleep()
        actor.save_model(5)  # returns at once; the build fails in its thread
        print("save_model returned", flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert "save_model returned" in done.stdout, done.stderr[-3000:]
    assert done.returncode == 1, (done.returncode, done.stderr[-3000:])
    cause = "state dict construction broke" if step == "build" else "No space left"
    assert cause in done.stderr and "exiting with status 1" in done.stderr, done.stderr[-3000:]
    assert not os.path.exists(tmp_path / "latest_checkpointed_iteration.txt")
