"""slime's checkpoint load with `--ckpt-backend safe`, on CPU: real Ray actors (2) mirroring slime's
train actor (tests/slime_mirror), whose `init` loads through slime's `load_checkpoint` and the
`_load_checkpoint_megatron` the init hook rebinds; the state they load is compared bit for bit
with what stock Megatron's `load_checkpoint` (the megatron.training stand-in) gives. Also the
classes admitted from the process's own args, and the fallbacks where slime is another version."""

import logging
import os
import sys
import types

import pytest

ray = pytest.importorskip("ray")

from safe_ckpt.errors import ReadError  # noqa: E402
from safe_ckpt.integrations import slime_load  # noqa: E402
from tests.helpers.slime_arg_types import NotInTheLoadersArgs, RewardSpec, RolloutMode  # noqa: E402
from tests.helpers.bodies.slime_asleep import SPEC, STAND_INS, slime_args  # noqa: E402
from tests.slime_mirror.ray.actor_group import RayTrainGroup, repo_env  # noqa: E402

ITERATION = 3


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": repo_env()})
    yield
    ray.shutdown()


def _each(group, method, *args):
    return ray.get([getattr(a, method).remote(*args) for a in group._actor_handlers])


def _args(save_dir, extra=(), holding=None):
    args = slime_args(save_dir, extra=extra)
    for name, value in (holding or {}).items():
        setattr(args, name, value)
    return args


def _train_and_save(save_dir, holding=None):
    """Two actors train one seeded step and save it through slime's save_model; their digests
    before and after the step."""
    args = _args(save_dir, holding=holding)
    args.mirror_train_step = True
    group = RayTrainGroup(args, 2, SPEC, env_vars=repo_env())
    initial = _each(group, "state_digest")
    ray.get(group.async_train(ITERATION))
    saved = _each(group, "state_digest")
    assert saved != initial  # the step changed the state: a load that reads nothing cannot pass
    group.save_model(ITERATION)
    group.release()
    return saved


def _new_actors(save_dir, extra=(), holding=None):
    """New actors whose init loads --load (= the save root), as slime's next step creates them."""
    args = _args(save_dir, extra, holding)
    args.load = save_dir
    return RayTrainGroup(args, 2, SPEC, env_vars=repo_env(), create=False)


def test_init_loads_through_safe_ckpt_exactly_what_stock_megatron_loads(ray_cluster, tmp_path):
    save_dir = str(tmp_path)
    saved = _train_and_save(save_dir)
    results = {}
    for name, extra in (("safe", ()), ("stock", ("--safe-ckpt-stock-load",))):
        group = _new_actors(save_dir, extra)
        results[name] = {"start": group.create(), "digests": _each(group, "state_digest"),
                         "by_safe_ckpt": _each(group, "loaded_by_safe_ckpt")}
        group.release()
    safe, stock = results["safe"], results["stock"]
    assert safe["by_safe_ckpt"] == [(os.path.abspath(save_dir), ITERATION)] * 2, safe
    assert stock["by_safe_ckpt"] == [None, None], stock  # --safe-ckpt-stock-load: Megatron's own load
    assert safe["start"] == stock["start"] == [ITERATION + 1] * 2
    assert stock["digests"] == saved
    assert safe["digests"] == stock["digests"]  # every model and optimizer tensor, bit for bit


def test_a_class_the_args_hold_loads_and_any_other_is_refused_naming_it_and_the_flag(ray_cluster, tmp_path):
    save_dir = str(tmp_path)
    own = {"rollout_mode": RolloutMode.ASYNC, "reward_specs": [RewardSpec("format", 0.5)]}
    saved = _train_and_save(save_dir, holding={**own, "origin": {"by": NotInTheLoadersArgs()}})
    group = _new_actors(save_dir, holding=own)  # this program's args hold no NotInTheLoadersArgs
    with pytest.raises(ray.exceptions.RayTaskError) as refused:
        group.create()
    group.release()
    message = str(refused.value)
    assert "ReadError" in message and "refused" in message, message
    assert "tests.helpers.slime_arg_types.NotInTheLoadersArgs" in message and "--safe-ckpt-stock-load" in message, message
    group = _new_actors(save_dir, holding={**own, "origin": {"by": NotInTheLoadersArgs("this one's own")}})
    assert group.create() == [ITERATION + 1] * 2
    assert _each(group, "loaded_by_safe_ckpt") == [(os.path.abspath(save_dir), ITERATION)] * 2
    assert _each(group, "state_digest") == saved
    group.release()


# ---- in-process: which classes are admitted, and another slime version ----

def test_classes_admitted_from_args_are_the_classes_of_their_values_only():
    import argparse
    import functools
    import pathlib

    args = argparse.Namespace(
        mode=RolloutMode.SYNC, specs=[RewardSpec("a", 1.0), (RewardSpec("b", 2.0),)],
        nested={"path": pathlib.PurePosixPath("/x"), frozenset({RolloutMode.ASYNC}): None},
        sub=argparse.Namespace(deeper={1, 2}, origin=NotInTheLoadersArgs()),
        plain=[1, "s", 2.5, None, True, b"x", range(3), object()],
        a_class=RewardSpec, a_function=slime_args, a_builtin=len, a_module=os,
        a_partial=functools.partial(slime_args, "/x"), a_lambda=lambda: None)
    args.itself = args  # cycles end
    admitted = set(slime_load.classes_in_args(args))
    assert admitted == {RolloutMode, RewardSpec, pathlib.PurePosixPath, argparse.Namespace, NotInTheLoadersArgs}


@pytest.fixture()
def stand_in_checkpointing(monkeypatch):
    """megatron.training's stand-in imported in this process for the test only."""
    before = {n for n in sys.modules if n.startswith("megatron.training")}
    monkeypatch.syspath_prepend(STAND_INS)
    from megatron.training import checkpointing

    yield checkpointing
    for name in [n for n in sys.modules if n.startswith("megatron.training") and n not in before]:
        del sys.modules[name]


def _fake_checkpoint_module(monkeypatch, name, **attrs):
    module = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(module, k, v)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_another_slime_version_keeps_stock_load_with_a_warning(monkeypatch, caplog, stand_in_checkpointing):
    import argparse

    mck = stand_in_checkpointing
    args = argparse.Namespace(ckpt_backend="safe")
    caplog.set_level(logging.INFO, logger="safe_ckpt")
    assert not slime_load.install_load(args, "no_such_slime.backends.megatron_utils.checkpoint")
    nameless = _fake_checkpoint_module(monkeypatch, "fake_slime_checkpoint_nameless")
    assert not slime_load.install_load(args, nameless.__name__)
    other = _fake_checkpoint_module(monkeypatch, "fake_slime_checkpoint_other", _load_checkpoint_megatron=len)
    assert not slime_load.install_load(args, other.__name__) and other._load_checkpoint_megatron is len
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and all("stays" in w for w in warnings), warnings
    assert "no_such_slime" in warnings[0] and "_load_checkpoint_megatron" in warnings[1], warnings

    same = _fake_checkpoint_module(monkeypatch, "fake_slime_checkpoint", _load_checkpoint_megatron=mck.load_checkpoint)
    assert slime_load.install_load(args, same.__name__)
    assert same._load_checkpoint_megatron is not mck.load_checkpoint
    assert slime_load.install_load(args, same.__name__)  # a second install wraps stock, not itself
    assert same._load_checkpoint_megatron._safe_ckpt_stock is mck.load_checkpoint
    args.safe_ckpt_stock_load = True
    assert not slime_load.install_load(args, same.__name__)
    assert same._load_checkpoint_megatron is mck.load_checkpoint
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("goes through safe_ckpt" in m for m in infos) and any("--safe-ckpt-stock-load" in m and "stays" in m
                                                                     for m in infos), infos


def test_the_routed_load_passes_the_options_and_adds_the_flag_to_a_refusal(monkeypatch, stand_in_checkpointing):
    import argparse

    import safe_ckpt.megatron.loading as loading

    mck = stand_in_checkpointing
    module = _fake_checkpoint_module(monkeypatch, "fake_slime_checkpoint_routed",
                                     _load_checkpoint_megatron=mck.load_checkpoint)
    args = argparse.Namespace(ckpt_backend="safe", load="/ckpt", safe_ckpt_io_threads=3, mode=RolloutMode.SYNC)
    assert slime_load.install_load(args, module.__name__)
    calls = []

    def fake(*a, safe_ckpt_options=None, **kw):
        calls.append((a, kw, safe_ckpt_options))
        if kw.get("refuse"):
            raise ReadError("/ckpt/iter_0000003/common.pt: refused: it references x.Y, which neither torch's "
                            "weights-only loader nor megatron-core's safe globals allow")
        return 7, 0

    monkeypatch.setattr(loading, "load_checkpoint", fake)
    assert module._load_checkpoint_megatron(ddp_model=[1], optimizer=2, opt_param_scheduler=3,
                                            checkpointing_context={}, skip_load_to_model_and_opt=False) == (7, 0)
    (a, kw, options), = calls
    assert kw == dict(ddp_model=[1], optimizer=2, opt_param_scheduler=3, checkpointing_context={},
                      skip_load_to_model_and_opt=False)
    assert options.io_threads == 3 and RolloutMode in options.safe_globals
    with pytest.raises(ReadError, match=r"x\.Y.*--safe-ckpt-stock-load"):
        module._load_checkpoint_megatron(refuse=True)
