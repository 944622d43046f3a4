"""Rank 0 builds `.metadata` and `metadata.json` while its writers still write (they depend on
the plan only), so the commit after the last fsync only adds the manifest and publishes."""

import threading

import pytest
import torch

import safe_ckpt
from safe_ckpt.encoding import small_files as commit_files
from safe_ckpt_lab.synthetic import bits_equal
from tests.helpers.hooked_sinks import HookedSink


def _state(seed: int):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    g = torch.Generator().manual_seed(seed)
    tensors = {f"w{i}": torch.randn(64, 64, generator=g) for i in range(12)}
    state = {k: ShardedTensor(k, v, v.dtype, tuple(v.shape), tuple(v.shape), (0, 0), axis_fragmentations=None)
             for k, v in tensors.items()}
    return tensors, state


class _GatedSink(HookedSink):
    """Item writes wait for ``gate`` (at most ``timeout_s``): the save's writers are still busy."""

    def __init__(self, root, gate: threading.Event, timeout_s: float):
        super().__init__(root)
        self.gate, self.timeout_s, self.timed_out = gate, timeout_s, False

    def before_write(self):
        if not self.gate.wait(self.timeout_s):
            self.timed_out = True


def _load(path, tensors):
    import torch.distributed.checkpoint as dcp

    out = {k: torch.empty_like(v) for k, v in tensors.items()}
    dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return all(bits_equal(out[k], v) for k, v in tensors.items())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_index_is_built_while_the_writers_still_write(tmp_path, monkeypatch, mode):
    tensors, state = _state(21)
    gate, sinks = threading.Event(), []
    built_early = []
    build = commit_files.build_metadata

    def build_and_open_the_gate(*a, **k):
        built_early.append(not gate.is_set())
        gate.set()  # only this opens the gate before its timeout: the writers were waiting
        return build(*a, **k)

    monkeypatch.setattr(commit_files, "build_metadata", build_and_open_the_gate)

    def factory(root):
        sinks.append(_GatedSink(root, gate, timeout_s=5.0))
        return sinks[-1]

    path = tmp_path / "ck"
    opts = safe_ckpt.SaveOptions(io_threads=2, chunk_bytes=16 * 1024, progress_interval_s=0, sink_factory=factory)
    if mode == "sync":
        safe_ckpt.save(state, str(path), options=opts)
    else:
        safe_ckpt.async_save(state, str(path), options=opts).wait(60)
    assert built_early == [True]
    assert not sinks[0].timed_out
    assert (path / ".metadata").exists() and _load(path, tensors)


def test_an_early_build_that_fails_is_built_again_at_the_commit(tmp_path, monkeypatch):
    tensors, state = _state(22)
    calls = []
    build = commit_files.build_metadata

    def fails_once(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("no memory for the index just now")
        return build(*a, **k)

    monkeypatch.setattr(commit_files, "build_metadata", fails_once)
    path = tmp_path / "ck"
    safe_ckpt.save(state, str(path), options=safe_ckpt.SaveOptions(io_threads=2, chunk_bytes=16 * 1024))
    assert len(calls) == 2 and _load(path, tensors)


def test_an_index_that_cannot_be_built_fails_the_commit_and_publishes_nothing(tmp_path, monkeypatch):
    _, state = _state(23)

    def always_fails(*a, **k):
        raise ValueError("index refused")

    monkeypatch.setattr(commit_files, "build_metadata", always_fails)
    path = tmp_path / "ck"
    with pytest.raises(safe_ckpt.CheckpointError, match="index refused") as info:
        safe_ckpt.save(state, str(path), options=safe_ckpt.SaveOptions(io_threads=2, chunk_bytes=16 * 1024))
    assert "commit" in str(info.value)
    assert not path.exists() or not (path / ".metadata").exists()
    assert [p.name for p in tmp_path.iterdir()] in ([], ["ck"])
