"""A save refuses common state or ShardedObjects the loaders' weights-only unpickler would refuse.

The check is the loaders' own allow-list (torch's types, megatron-core's safe globals, classes
registered with `torch.serialization.add_safe_globals`, `SaveOptions.safe_globals`): refused up
front, naming the entry, the rank and the remedy, with the previous checkpoint kept; what it
admits loads back through stock `megatron.core.dist_checkpointing.load`.
"""

import argparse
import dataclasses
import os

import pytest
import torch

import safe_ckpt
from safe_ckpt_lab.synthetic import bits_equal
from tests.helpers.mp import run_world, values


@dataclasses.dataclass
class RunInfo:
    """A user's own class: not a class the weights-only unpickler rebuilds."""

    name: str
    step: int


def _st(key, data):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    shape = tuple(data.shape)
    return ShardedTensor(key, data, data.dtype, shape, shape, (0,) * len(shape), axis_fragmentations=None)


def _so(key, data):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(key, data, (1,), (0,), replica_id=0)


def _opts(**kw):
    return safe_ckpt.SaveOptions(chunk_bytes=16 * 1024, io_threads=1, progress_interval_s=0, **kw)


def _state(seed, **extra):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(8, 16, generator=g)
    state = {"w": _st("w", weight), "iteration": seed, "args": argparse.Namespace(lr=1e-4, name="run"),
             "sched": {"steps": [1, 2, 3], "scale": torch.randn(3, generator=g)},
             "rng": _so("rng", {"seed": seed, "state": torch.randint(0, 255, (16,), generator=g, dtype=torch.uint8)})}
    state.update(extra)
    return state


def _stock_load(path, like):
    from megatron.core import dist_checkpointing

    template = {"w": _st("w", torch.empty_like(like["w"].data)), "rng": _so("rng", None)}
    return dist_checkpointing.load(template, path)


def _assert_loads_back(path, saved):
    loaded = _stock_load(path, saved)
    assert bits_equal(loaded["w"], saved["w"].data)
    assert loaded["iteration"] == saved["iteration"] and vars(loaded["args"]) == vars(saved["args"])
    assert loaded["sched"]["steps"] == [1, 2, 3] and bits_equal(loaded["sched"]["scale"], saved["sched"]["scale"])
    assert loaded["rng"]["seed"] == saved["rng"].data["seed"]
    assert bits_equal(loaded["rng"]["state"], saved["rng"].data["state"])


def _refused(state, path, asynchronous=False, **kw) -> dict:
    try:
        if asynchronous:
            safe_ckpt.async_save(state, path, options=_opts(**kw)).wait()
        else:
            safe_ckpt.save(state, path, options=_opts(**kw))
    except safe_ckpt.CheckpointError as exc:
        return {"type": type(exc), "message": str(exc), "ranks": exc.failing_ranks}
    return {"type": None}


def _world_body(rank, world_size, root):
    """One gloo rank (stock load needs a process group): every case, results back to the test."""
    out = {}
    path = os.path.join(root, "ck")
    good = _state(1)
    safe_ckpt.save(good, path, options=_opts())
    _assert_loads_back(path, good)
    before = sorted(os.listdir(path))
    for asynchronous in (False, True):
        out[f"common_async={asynchronous}"] = _refused(_state(2, info=RunInfo("run", 2)), path, asynchronous)
        assert sorted(os.listdir(path)) == before  # nothing lost: the previous checkpoint untouched
        _assert_loads_back(path, good)

    nested = _state(3)
    nested["nested"] = {"obj": _so("opt/extra", {"fine": 1, "info": [RunInfo("a", 1)]})}
    out["object"] = _refused(nested, os.path.join(root, "ck_object"))
    out["object_dir_exists"] = os.path.exists(os.path.join(root, "ck_object"))

    registered = _state(4, info=RunInfo("run", 4))
    other = os.path.join(root, "ck_registered")
    safe_ckpt.save(registered, other, options=_opts(safe_globals=(RunInfo,)))
    with torch.serialization.safe_globals([RunInfo]):
        loaded = _stock_load(other, registered)
    out["registered_loads_back"] = loaded["info"] == RunInfo("run", 4) and bits_equal(loaded["w"], registered["w"].data)
    return out


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    (result,) = values(run_world(1, _world_body, (str(tmp_path_factory.mktemp("refuse")),)))
    return result


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_custom_class_in_the_common_state_is_refused_before_anything_is_written(outcome, asynchronous):
    got = outcome[f"common_async={asynchronous}"]
    msg = got.get("message", "")
    assert got["type"] is safe_ckpt.errors.UnloadableStateError, got
    assert issubclass(got["type"], safe_ckpt.ValidationError)
    assert got["ranks"] == [0] and "rank 0" in msg, msg
    assert f"the common state holds {__name__}.RunInfo (at state['info']: a RunInfo)" in msg, msg
    assert "torch.serialization.add_safe_globals" in msg and "builtin types" in msg, msg


def test_a_custom_class_in_a_sharded_object_names_its_key_and_path(outcome):
    got = outcome["object"]
    msg = got.get("message", "")
    assert got["type"] is safe_ckpt.errors.UnloadableStateError, got
    assert "rank 0" in msg and "key 'opt/extra'" in msg, msg
    assert (f"ShardedObject 'opt/extra/shard_0_1' holds {__name__}.RunInfo "
            f"(at state['nested']['obj'].data['info'][0]: a RunInfo)") in msg, msg
    assert not outcome["object_dir_exists"]


def test_a_class_admitted_on_both_sides_saves_and_loads_back_through_stock_load(outcome):
    assert outcome["registered_loads_back"]


def test_the_megatron_strategies_admit_the_optimizer_classes_on_both_sides_by_default():
    """`--optimizer-cpu-offload` keeps optimizer classes in its param groups: the strategies built
    without options admit them on save and on load alike, so such a save is neither refused nor
    unloadable through the other strategy."""
    from safe_ckpt.megatron.loading import SafeTorchDistLoadStrategy, optimizer_classes
    from safe_ckpt.megatron.strategy import SafeTorchDistSaveStrategy

    saved, loaded = SafeTorchDistSaveStrategy().options.safe_globals, SafeTorchDistLoadStrategy().options.safe_globals
    assert torch.optim.AdamW in saved and set(optimizer_classes()) <= set(saved)
    assert set(saved) == set(loaded)


class _Recorded:
    """Records every rebuild: the save's check must never run a class's code."""

    rebuilt: list = []

    def __init__(self, value):
        self.value = value

    def __setstate__(self, state):
        _Recorded.rebuilt.append(state)
        self.__dict__.update(state)


def test_the_check_reads_the_globals_without_rebuilding_anything_or_touching_torchs_allow_list():
    """Admitted classes are not rebuilt (no user code on the save's path, no tensor storage built)
    and torch's process-wide allow-list never holds them, so another thread's
    torch.load(weights_only=True) during a save refuses what it refused before."""
    from safe_ckpt import compat, weights_only

    payload = compat.torch_save_bytes({"x": _Recorded(3), "t": torch.randn(8)})
    registry = torch.serialization._marked_safe_globals_set if hasattr(torch.serialization, "_marked_safe_globals_set") \
        else None
    added = []
    real_add = torch.serialization.add_safe_globals

    def watching(classes):
        added.extend(classes)
        return real_add(classes)

    torch.serialization.add_safe_globals = watching
    try:
        assert weights_only.unloadable(payload, safe_globals=(_Recorded,)) is None
        refusal = weights_only.unloadable(payload)
    finally:
        torch.serialization.add_safe_globals = real_add
    assert refusal is not None and refusal.refused_global.endswith("_Recorded"), refusal
    assert _Recorded.rebuilt == [] and _Recorded not in added
    assert _Recorded not in torch.serialization.get_safe_globals(), registry


def test_the_check_refuses_numpy_arrays_the_loaders_cannot_rebuild():
    """numpy makes a dtype's class only while unpickling, so a scan of the pickle's globals alone
    cannot see it: a float32 array (which the loaders refuse) is refused, a uint32 one (which
    megatron-core admits) passes, as each loads."""
    import numpy as np

    from safe_ckpt import compat, weights_only

    for array, loads in ((np.zeros(2, dtype=np.float32), False), (np.zeros(2, dtype=np.uint32), True)):
        payload = compat.torch_save_bytes({"x": array})
        try:
            weights_only.load(payload, map_location="cpu")
            loaded = True
        except Exception:
            loaded = False
        assert loaded is loads
        assert (weights_only.unloadable(payload) is None) is loads, array.dtype
