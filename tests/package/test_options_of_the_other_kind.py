"""Passing a save's options to a load (or a load's to a save) is refused at once, naming the right
class, instead of failing deep inside with an AttributeError."""

import pytest
import torch

import safe_ckpt


def test_a_load_given_save_options_says_it_takes_load_options(tmp_path):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(6, dtype=torch.float32))}
    path = str(tmp_path / "ck")
    safe_ckpt.save(state, path, safe_ckpt.SaveOptions(io_threads=1))  # options positional, as a load takes them
    with pytest.raises(TypeError, match=r"safe_ckpt.LoadOptions, not SaveOptions \(SaveOptions are for saves\)"):
        safe_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(6))}, path,
                       safe_ckpt.SaveOptions(io_threads=2))
    out = safe_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(6))}, path,
                         safe_ckpt.LoadOptions(io_threads=2))
    assert torch.equal(out["w"], torch.arange(6, dtype=torch.float32))


def test_a_save_given_load_options_says_it_takes_save_options(tmp_path):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(6, dtype=torch.float32))}
    with pytest.raises(TypeError, match=r"safe_ckpt.SaveOptions, not LoadOptions \(LoadOptions are for"):
        safe_ckpt.save(state, str(tmp_path / "ck"), options=safe_ckpt.LoadOptions())
    assert not (tmp_path / "ck").exists()


def test_path_usage_error_is_public():
    assert issubclass(safe_ckpt.PathUsageError, (ValueError)) and issubclass(safe_ckpt.PathUsageError, safe_ckpt.CheckpointError)
    assert "PathUsageError" in safe_ckpt.__all__


def test_every_entry_point_refuses_options_of_the_other_kind(tmp_path):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from safe_ckpt.loading import contract
    from safe_ckpt.megatron import training

    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(6, dtype=torch.float32))}
    path = str(tmp_path / "ck")
    safe_ckpt.save(state, path)
    with pytest.raises(TypeError, match="LoadOptions"):
        contract.read_sharded_metadata(path, safe_ckpt.SaveOptions())
    with pytest.raises(TypeError, match="SaveOptions"):  # once: AttributeError, 'LoadOptions' ... 'fsync'
        training.save_state(state, str(tmp_path), str(tmp_path / "iter_0000001"), "1",
                            options=safe_ckpt.LoadOptions())
