"""A save pointed at a save root (the folder holding `iter_*` checkpoints and the tracker) instead
of an iteration directory is refused whatever `SaveOptions.replace` says, naming what it would
delete and what to pass instead; every checkpoint in the root stays loadable."""

import os

import pytest
import torch

import safe_ckpt
from safe_ckpt.errors import CommitError
from safe_ckpt.names import TRACKER_FILE, iteration_dir


def _state(seed):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    t = torch.randn(3000, generator=torch.Generator().manual_seed(seed))
    return t, {"w": ShardedTensor.from_rank_offsets("w", t)}


@pytest.mark.parametrize("replace", ["checkpoint", "any"])
@pytest.mark.parametrize("holds", ["iteration", "tracker"])
def test_a_save_into_a_save_root_is_refused_and_the_root_is_untouched(tmp_path, replace, holds):
    root = tmp_path / "run"
    kept, state = _state(1)
    iteration = root / iteration_dir(7)
    safe_ckpt.save(state, str(iteration))
    if holds == "tracker":  # the tracker alone (its checkpoint elsewhere) is enough to know the root
        os.rename(iteration, tmp_path / "elsewhere")
    (root / TRACKER_FILE).write_text("7")
    before = sorted(os.listdir(root))
    _, other = _state(2)
    with pytest.raises(CommitError, match="is a save root") as refused:
        safe_ckpt.save(other, str(root), options=safe_ckpt.SaveOptions(replace=replace))
    assert "iter_" in str(refused.value) and "replace every checkpoint" in str(refused.value)
    assert sorted(os.listdir(root)) == before
    if holds == "iteration":
        loaded = safe_ckpt.load({"w": _state(0)[1]["w"]}, str(iteration))
        assert torch.equal(loaded["w"], kept)


@pytest.mark.parametrize("replace", ["checkpoint", "any"])
def test_a_save_into_an_object_store_save_root_is_refused(tmp_path, replace):
    """The same through a kvstore (a `file://` prefix standing for a bucket's)."""
    root = tmp_path / "bucket"
    kept, state = _state(3)
    url = f"file://{root}"
    safe_ckpt.save(state, f"{url}/{iteration_dir(5)}")
    (root / TRACKER_FILE).write_text("5")
    _, other = _state(4)
    with pytest.raises(CommitError, match="is a save root"):
        safe_ckpt.save(other, url, options=safe_ckpt.SaveOptions(replace=replace))
    loaded = safe_ckpt.load({"w": _state(0)[1]["w"]}, f"{url}/{iteration_dir(5)}")
    assert torch.equal(loaded["w"], kept)
