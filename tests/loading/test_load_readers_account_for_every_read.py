"""A load whose reader threads end without doing their reads (a thread that dies before its first
task, outside any task's error handling) fails naming the reads not done; it never returns the
templates' values as if they had been read."""

import pytest
import torch

import safe_ckpt
from safe_ckpt.errors import CheckpointError
from safe_ckpt.loading import execute


def _saved(tmp_path):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    g = torch.Generator().manual_seed(21)
    state = {f"w{i}": torch.randn(5000 + i, generator=g) for i in range(6)}
    path = str(tmp_path / "ckpt")
    safe_ckpt.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in state.items()}, path)
    like = {k: ShardedTensor.from_rank_offsets(k, torch.full_like(v, 7.0)) for k, v in state.items()}
    return state, path, like


def test_readers_that_end_without_reading_fail_the_load(tmp_path, monkeypatch):
    state, path, like = _saved(tmp_path)
    monkeypatch.setattr(execute.Reader, "_loop", lambda self: None)  # every reader returns at once
    with pytest.raises(CheckpointError, match="reads not done"):
        safe_ckpt.load(like, path, options=safe_ckpt.LoadOptions(io_threads=2))


def test_a_reader_whose_setup_fails_fails_the_load_naming_the_cause(tmp_path, monkeypatch):
    state, path, like = _saved(tmp_path)

    def broken(self, reader):
        raise RuntimeError("injected: the reader thread could not set up")

    monkeypatch.setattr(execute._Worker, "__init__", broken)
    with pytest.raises(CheckpointError, match="injected"):
        safe_ckpt.load(like, path, options=safe_ckpt.LoadOptions(io_threads=2))
    monkeypatch.undo()
    loaded = safe_ckpt.load(like, path, options=safe_ckpt.LoadOptions(io_threads=2))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
