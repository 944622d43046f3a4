"""Object-store targets against hostile or concurrent neighbours: a `.metadata` that names a
callable, `gc` during a save, retention keeping the resumed-from checkpoint, and the CLI's
usage errors for kvstore arguments."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

pytest.importorskip("tensorstore")

import safe_ckpt  # noqa: E402
from tests.tools.test_verify_inspect_gc_and_retention import _state  # noqa: E402


def _opts(**kw):
    return safe_ckpt.SaveOptions(**{"chunk_bytes": 32 * 1024, "io_threads": 2, "progress_interval_s": 0, **kw})


class _RunsACommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _plant_hostile_metadata(prefix_dir, marker) -> None:
    (prefix_dir / ".metadata").write_bytes(pickle.dumps(_RunsACommand(f"touch {marker}")))


def test_gc_and_a_resave_never_unpickle_a_hostile_metadata(tmp_path, caplog):
    from safe_ckpt.sinks.tensorstore import KvTarget
    from safe_ckpt.targets.objectstore import gc as kv_gc

    root = tmp_path / "ck"
    url = f"file://{root}/iter_0000001"
    safe_ckpt.save(_state(1), url, options=_opts())
    marker = tmp_path / "MARKER"
    _plant_hostile_metadata(root / "iter_0000001", marker)
    # A stray tagged data file: what gc would remove if it trusted the index.
    stray = root / "iter_0000001" / "__9_0-0123456789abcdef.distcp"
    stray.write_bytes(b"x")

    proc = subprocess.run([sys.executable, "-m", "safe_ckpt", "gc", f"file://{root}"],
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "iter_0000001" in proc.stderr and "skips" in proc.stderr, proc.stderr[-2000:]
    assert not marker.exists()
    with caplog.at_level("WARNING", logger="safe_ckpt"):
        assert kv_gc.collect(KvTarget(f"file://{root}")) == []
    assert "iter_0000001" in caplog.text and stray.exists() and not marker.exists()

    with pytest.raises(safe_ckpt.CommitError, match=r"\.metadata.*os\.system|posix\.system"):
        safe_ckpt.save(_state(2), url, options=_opts())
    assert not marker.exists()
    # Even past the target check (replace="any"), the commit refuses before changing anything.
    with pytest.raises(safe_ckpt.CommitError, match="not a checkpoint safe_ckpt can interpret"):
        safe_ckpt.save(_state(2), url, options=_opts(replace="any"))
    assert not marker.exists()
    assert (root / "iter_0000001" / "metadata.json").exists()


class _GcBeforeCommit:
    """Wraps the kvstore sink: the commit's first listing runs `safe-ckpt gc` on the save root first."""

    def __init__(self, sink, gc) -> None:
        self._sink = sink
        self._gc = gc
        self.collected = None

    def __getattr__(self, name):
        return getattr(self._sink, name)

    def list(self):
        if self.collected is None:
            self.collected = self._gc()
        return self._sink.list()


def test_gc_during_a_save_never_yields_an_ok_checkpoint_without_its_data(tmp_path):
    from safe_ckpt.sinks.tensorstore import KvTarget
    from safe_ckpt.targets.objectstore import gc as kv_gc

    root = tmp_path / "ck"
    wrapped = []

    def factory(sink):
        wrapped.append(_GcBeforeCommit(sink, lambda: kv_gc.collect(KvTarget(f"file://{root}"))))
        return wrapped[0]

    try:
        safe_ckpt.save(_state(3), f"file://{root}/iter_0000001", options=_opts(sink_factory=factory))
    except safe_ckpt.CommitError as exc:
        assert "missing" in str(exc) and ".distcp" in str(exc)
        assert not (root / "iter_0000001" / "metadata.json").exists()
        assert not (root / "iter_0000001" / ".metadata").exists()
        return
    # The save reported OK: gc must have left its files alone (its owner object is fresh), and they load.
    assert wrapped and wrapped[0].collected == []
    from safe_ckpt.tools.verify import verify

    assert verify(str(root / "iter_0000001"), deep=True).ok
    assert not [n for n in os.listdir(root / "iter_0000001") if n.startswith(".safe_ckpt-owner-")]


class _DeletesBeforeCommit(_GcBeforeCommit):
    """What a gc that does not know owner objects (or a person) does: removes one data file."""

    def __init__(self, sink) -> None:
        def remove_one():
            name = sorted(n for n in sink.list() if n.endswith(".distcp"))[0]
            sink.delete(name)
            return [name]

        super().__init__(sink, remove_one)


def test_a_commit_with_a_data_file_missing_publishes_nothing(tmp_path):
    root = tmp_path / "ck"
    wrapped = []

    def factory(sink):
        wrapped.append(_DeletesBeforeCommit(sink))
        return wrapped[0]

    with pytest.raises(safe_ckpt.CommitError, match=r"\.distcp: 1 data file\(s\) of this save are missing") as err:
        safe_ckpt.save(_state(4), f"file://{root}/iter_0000001", options=_opts(sink_factory=factory))
    assert wrapped[0].collected and f"iter_0000001/{wrapped[0].collected[0]}" in str(err.value)
    left = os.listdir(root / "iter_0000001") if (root / "iter_0000001").exists() else []
    assert "metadata.json" not in left and ".metadata" not in left, left


def test_gc_removes_a_dead_saves_keys_once_its_owner_object_is_stale(tmp_path):
    import json

    from safe_ckpt.targets.objectstore import publish as kvcommit
    from safe_ckpt.sinks.tensorstore import KvTarget
    from safe_ckpt.targets.objectstore import gc as kv_gc

    prefix = tmp_path / "ck" / "iter_0000002"
    prefix.mkdir(parents=True)
    fresh, dead = "aaaaaaaa11112222", "bbbbbbbb33334444"
    for save_id, age_s in ((fresh, 10.0), (dead, 2 * kvcommit.OWNER_STALE_S)):
        (prefix / f"__0_0-{save_id}.distcp").write_bytes(os.urandom(64))
        (prefix / f".safe_ckpt-owner-{save_id}").write_text(json.dumps(
            {"save_id": save_id, "written_at_unix_s": __import__("time").time() - age_s,
             "stale_after_s": kvcommit.OWNER_STALE_S}))
    removed = kv_gc.collect(KvTarget(f"file://{tmp_path}/ck"))
    assert removed == sorted([f"iter_0000002/__0_0-{dead}.distcp", f"iter_0000002/.safe_ckpt-owner-{dead}"])
    assert sorted(os.listdir(prefix)) == sorted([f"__0_0-{fresh}.distcp", f".safe_ckpt-owner-{fresh}"])


def test_the_timeout_remedy_names_the_command_line_flag_too():
    from concurrent.futures import Future

    from safe_ckpt.errors import WriteError
    from safe_ckpt.sinks.tensorstore import bounded

    with pytest.raises(WriteError, match=r"SaveOptions\.kvstore_request_timeout_s.*--request-timeout-s"):
        bounded(Future(), 0.01, "file:///x/key")


def _main_rc(argv, capsys) -> tuple[int, str]:
    from safe_ckpt.cli import main

    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse refusing an argument
        rc = exc.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["gc", "x", "--kvstore-spec", '"x"'], "--kvstore-spec must be a JSON object"),
    (["gc", "x", "--kvstore-spec", '{"driver": "nope"}'], "--kvstore-spec is not a TensorStore kvstore spec"),
    (["copy", "x", "y", "--dst-spec", '["x"]'], "--dst-spec must be a JSON object"),
    (["copy", "x", "y", "--src-spec", '{"driver": "nope"}'], "--src-spec is not a TensorStore kvstore spec"),
    (["copy", "x", "y", "--src-spec", "{"], "--src-spec is not valid JSON"),
    (["gc", "x", "--request-timeout-s", "-1"], "--request-timeout-s: must be positive"),
    (["verify", "x", "--request-timeout-s", "0"], "--request-timeout-s: must be positive"),
    (["demo", "--ranks", "0"], "--ranks: must be positive"),
    (["demo", "--size-mb", "0"], "--size-mb: must be positive"),
])
def test_bad_kvstore_and_number_arguments_are_usage_errors(argv, message, capsys, tmp_path):
    rc, err = _main_rc(argv, capsys)
    assert rc == 2, (rc, err)
    assert message in err and "Traceback" not in err, err
    assert not os.path.exists("y")


def test_retention_on_a_kvstore_root_keeps_the_checkpoint_the_run_resumed_from(tmp_path):
    from safe_ckpt.megatron.training import save_state
    from safe_ckpt.targets.retention import Retention
    from safe_ckpt.sinks.tensorstore import KvTarget
    from safe_ckpt.targets.objectstore import root as kv_root

    root = f"file://{tmp_path}/run"
    for it in (1, 2, 3):  # an earlier run's checkpoints; it resumed from 2
        safe_ckpt.save(_state(it), f"{root}/iter_{it:07d}", options=_opts())
    kv_root.write_tracker(KvTarget(root), 2)
    for it in (4, 5):
        save_state(_state(it), root, f"{root}/iter_{it:07d}", str(it), options=_opts(), retention=Retention(keep_last=1))
    assert sorted(kv_root.iterations(KvTarget(root))) == [2, 5]
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text() == "5"
    from safe_ckpt.tools.verify import verify

    assert verify(str(tmp_path / "run" / "iter_0000002"), deep=True).ok


def test_a_save_refused_at_planning_leaves_no_owner_object(tmp_path):
    root = tmp_path / "ck"
    url = f"file://{root}/iter_0000001"
    safe_ckpt.save(_state(5), url, options=_opts())
    with pytest.raises(safe_ckpt.CheckpointError):
        # the same prefix, but a plan that does not cover the tensor: half of "w" has no writer
        import torch
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        half = ShardedTensor.from_rank_offsets("w", torch.randn(4, 3, generator=torch.Generator().manual_seed(5)),
                                               (0, 0, 2))
        safe_ckpt.save({"w": half}, url, options=_opts(replace="any"))
    assert not [n for n in os.listdir(root / "iter_0000001") if n.startswith(".safe_ckpt-owner-")]
