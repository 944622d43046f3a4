"""Megatron's `load_checkpoint` reads the common state (`load_common_state_dict`) just before it
loads (`load`): where the common state is `common.pt`, the first does not unpickle `.metadata`, so
a resume unpickles it once; the common state and the loaded tensors are those saved."""

import torch

import safe_ckpt
from safe_ckpt.encoding import safe_read
from safe_ckpt.loading import contract


def _sharded(tensors: dict) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    out = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}
    out["groups"] = ShardedObject("optimizer.groups", {"lr": 0.25}, (1,), (0,))
    return out


def test_reading_the_common_state_then_loading_unpickles_the_index_once(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(31)
    state = {f"w{i}": torch.randn(300 + 17 * i, generator=g) for i in range(6)}
    path = str(tmp_path / "ckpt")
    saved = _sharded(state)
    saved["iteration"] = 12
    safe_ckpt.save(saved, path)

    parsed = []
    stock = safe_read.metadata_from_bytes
    monkeypatch.setattr(safe_read, "metadata_from_bytes", lambda data, where: parsed.append(where) or stock(data, where))

    common = contract.read_common_state_dict(path)
    assert common["iteration"] == 12 and parsed == []

    template = _sharded({k: torch.full_like(v, float("nan")) for k, v in state.items()})
    loaded = safe_ckpt.load(template, path)
    assert len(parsed) == 1
    assert loaded["iteration"] == 12 and loaded["groups"] == {"lr": 0.25}
    for k, v in state.items():
        assert torch.equal(loaded[k].view(torch.int32), v.view(torch.int32)), k


def test_the_common_state_of_a_save_that_did_not_finish_is_refused(tmp_path):
    """Without `.metadata` (written last) the save did not finish: reading its common state alone
    says so, though `common.pt` is there."""
    import os

    import pytest

    from safe_ckpt.errors import ReadError

    path = str(tmp_path / "ckpt")
    saved = _sharded({"w": torch.randn(64, generator=torch.Generator().manual_seed(32))})
    saved["iteration"] = 7
    safe_ckpt.save(saved, path)
    os.remove(os.path.join(path, ".metadata"))
    with pytest.raises(ReadError, match="did not finish"):
        contract.read_common_state_dict(path)
