"""A save never reports success over a wrong checkpoint, and nothing beside it (gc, another save
of the same target, a crash while replacing, retention) loses the last good checkpoint.

Concurrency is gated by the sink itself: the interfering action runs inside a writer's first
write, so it always happens while the save is writing."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import threading

import pytest
import torch

import safe_ckpt
from safe_ckpt.targets.directory import claim, publish as commit
from safe_ckpt.targets.directory import prepare as dir_prepare, root as dir_root, leftovers
from safe_ckpt import names
from safe_ckpt.sinks.posix import PosixSink
from safe_ckpt_lab.synthetic import bits_equal
from safe_ckpt.targets.directory import gc as gc_tool
from tests.helpers.hooked_sinks import HookedSink
from tests.helpers.mp import describe_exception, run_world, values

ROWS, COLS, TENSORS = 64, 64, 4


def _rows(seed: int, rank: int, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank * 10 + i)
    return torch.randn(ROWS, COLS, generator=g)


def _state(seed: int, rank: int = 0, world: int = 1) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    for i in range(TENSORS):
        data = _rows(seed, rank, i)
        out[f"w{i}"] = ShardedTensor(f"w{i}", data, data.dtype, tuple(data.shape), (ROWS * world, COLS),
                                     (ROWS * rank, 0), axis_fragmentations=None)
    return out


def _matches(path: str, seed: int, world: int = 1) -> bool:
    """Whether the checkpoint at ``path`` loads (stock DCP) bit-exact as save ``seed`` wrote it."""
    import torch.distributed.checkpoint as dcp

    out = {f"w{i}": torch.empty(ROWS * world, COLS) for i in range(TENSORS)}
    dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return all(bits_equal(out[f"w{i}"], torch.cat([_rows(seed, r, i) for r in range(world)]))
               for i in range(TENSORS))


def _opts(**kw) -> safe_ckpt.SaveOptions:
    base = dict(chunk_bytes=8 * 1024, io_threads=2, progress_interval_s=0, collective_timeout_s=120)
    base.update(kw)
    return safe_ckpt.SaveOptions(**base)


def _leftovers(parent) -> list[str]:
    return sorted(n for n in os.listdir(parent) if ".safe_ckpt-" in n)


class _OnFirstWrite(HookedSink):
    """Runs ``hook(sink)`` in the writer's thread before the save's first item write."""

    def __init__(self, root, hook):
        super().__init__(root)
        self.hook, self.fired, self.lock = hook, False, threading.Lock()

    def before_write(self):
        with self.lock:
            if self.fired:
                return
            self.fired = True
        self.hook(self)


class _CutShort(PosixSink):
    """A data file loses its last byte once closed (as if something else truncated it)."""

    def __init__(self, root):
        super().__init__(root, fsync=False)

    def open(self, relative_path, size_bytes):
        inner = super().open(relative_path, size_bytes)
        real_close = inner.close

        def close():
            real_close()
            os.truncate(inner.path, max(0, os.path.getsize(inner.path) - 1))

        inner.close = close
        return inner


# ------------------------------------------------------------------ a live save, two ranks


def _attempt(record: dict, name: str, state: dict, target: str, opts) -> None:
    try:
        safe_ckpt.save(state, target, options=opts)
        record[name] = None
    except BaseException as exc:
        record[name] = describe_exception(exc)
    torch.distributed.barrier()


def _live_save_body(rank, world, root):
    target = os.path.join(root, "ck")
    record = {}
    safe_ckpt.save(_state(1, rank, world), target, options=_opts())
    torch.distributed.barrier()

    seen = {}

    def run_gc(sink):  # from rank 1's process: rank 0's process owns the staging directory
        seen["gc_removed"] = gc_tool.collect(root)
        seen["staging_after_gc"] = os.path.isdir(sink.root)

    def start_another_save(sink):
        try:
            area = dir_prepare.prepare(target, dir_prepare.new_save_id())
            seen["prepare"] = "allowed"
            commit.abort(area)
        except safe_ckpt.CommitError as exc:
            seen["prepare"] = str(exc)
        seen["staging_after_prepare"] = os.path.isdir(sink.root)

    for name, seed, hook in (("with_gc", 2, run_gc), ("with_prepare", 3, start_another_save)):
        hooked = (lambda d, hook=hook: _OnFirstWrite(d, hook)) if rank == 1 else None
        _attempt(record, name, _state(seed, rank, world), target, _opts(sink_factory=hooked))
    record["seen"] = seen

    def remove_staging(sink):
        # Gone at once, as `rmtree` alone is not while the other rank still creates files in it
        # (it then fails with ENOTEMPTY and leaves the directory half there)
        aside = os.path.join(os.path.dirname(sink.root), "removed-by-the-test")
        os.rename(sink.root, aside)
        shutil.rmtree(aside, ignore_errors=True)

    removed = (lambda d: _OnFirstWrite(d, remove_staging)) if rank == 1 else None
    _attempt(record, "staging_removed", _state(4, rank, world), target, _opts(sink_factory=removed))

    _attempt(record, "file_cut_short", _state(5, rank, world), target,
             _opts(sink_factory=_CutShort if rank == 1 else None))
    record["leftovers"] = _leftovers(root)
    return record


def test_a_live_save_is_protected_and_a_damaged_one_is_never_published(tmp_path):
    records = values(run_world(2, _live_save_body, (str(tmp_path),), timeout_s=300))
    seen = records[1]["seen"]
    # gc and a second save of the same target, from another process, leave the running save alone
    assert [(r["with_gc"], r["with_prepare"]) for r in records] == [(None, None), (None, None)]
    assert seen["staging_after_gc"] and seen["gc_removed"] == []
    assert seen["staging_after_prepare"]
    assert "another save of" in seen["prepare"] and "is running" in seen["prepare"]
    # a staging directory removed anyway, or a staged file cut short: every rank fails, the
    # failing rank and the file are named, and the checkpoint published before is what loads
    for name in ("staging_removed", "file_cut_short"):
        errors = [r[name] for r in records]
        assert all(e is not None and "CheckpointError" in e["mro"] for e in errors), errors
        assert errors[0]["message"] == errors[1]["message"]
        assert 1 in errors[0]["failing_ranks"]
    assert "gone" in records[0]["staging_removed"]["message"]
    cut = records[0]["file_cut_short"]["message"]
    assert "rank 1 [CommitError]" in cut and "__1_" in cut and "bytes, not the" in cut
    assert _matches(tmp_path / "ck", 3, world=2)
    assert not os.path.exists(os.path.join(tmp_path, "ck", names.OWNER_FILE))
    assert records[0]["leftovers"] == []


def test_the_owner_record_and_heartbeat_end_with_the_save(tmp_path):
    target = tmp_path / "ck"
    safe_ckpt.save(_state(5), str(target), options=_opts())
    assert not (target / names.OWNER_FILE).exists() and _matches(target, 5)
    assert not [t for t in threading.enumerate() if t.name.startswith("safe_ckpt-heartbeat")]
    assert _leftovers(tmp_path) == []


def test_a_claim_this_process_dropped_unreleased_does_not_block_the_next_save(tmp_path):
    import gc

    target = tmp_path / "ck"
    area = dir_prepare.prepare(str(target), dir_prepare.new_save_id())  # a failed save that never aborted
    with pytest.raises(safe_ckpt.CommitError, match="another save of"):
        dir_prepare.prepare(str(target), dir_prepare.new_save_id())  # while it is still held
    del area
    gc.collect()
    safe_ckpt.save(_state(6), str(target), options=_opts())
    assert _matches(target, 6) and _leftovers(tmp_path) == []


def test_the_posix_sink_does_not_make_a_removed_root_again(tmp_path):
    root = tmp_path / "staging"
    root.mkdir()
    sink = PosixSink(str(root), fsync=False)
    sink.write_file("sub/dir/a", b"kept")  # directories below the root are made as needed
    assert (root / "sub" / "dir" / "a").read_bytes() == b"kept"
    shutil.rmtree(root)
    for attempt in (lambda: sink.open("__0_0.distcp", 10), lambda: sink.write_file("sub/b", b"x")):
        with pytest.raises(FileNotFoundError, match="is gone"):
            attempt()
    assert not root.exists()


# ------------------------------------------------------------------ the stale-owner rule


def _fake_staging(parent, name: str, owner: claim.Owner | None, age_s: float = 0.0) -> str:
    path = os.path.join(parent, f".{name}{names.STAGING_MARK}{owner.save_id if owner else 'none0000'}")
    os.makedirs(path)
    open(os.path.join(path, "__0_0.distcp"), "wb").write(b"partial")
    if owner is not None:
        record = os.path.join(path, names.OWNER_FILE)
        with open(record, "w") as f:
            json.dump(owner.__dict__, f)
        if age_s:
            t = os.stat(record).st_mtime - age_s
            os.utime(record, (t, t))
    return path


def test_gc_and_prepare_remove_only_stale_staging_directories(tmp_path):
    here = claim.Owner.here("a" * 16, str(tmp_path / "ck"))
    exited = subprocess.Popen(["true"])
    exited.wait()
    elsewhere = claim.Owner("b" * 16, str(tmp_path / "ck"), 1, "another-host", "another-host/x/y")
    dead_here = _fake_staging(tmp_path, "ck", claim.Owner(**{**here.__dict__, "pid": exited.pid, "save_id": "c" * 16}))
    old_elsewhere = _fake_staging(tmp_path, "ck", claim.Owner(**{**elsewhere.__dict__, "save_id": "d" * 16}),
                                  age_s=claim.STALE_AFTER_S + 30)
    no_record = _fake_staging(tmp_path, "ck", None)
    live_elsewhere = _fake_staging(tmp_path, "ck", elsewhere)
    # a running process of this machine (the one that started this test), though it holds no lock
    live_here = _fake_staging(tmp_path, "ck", claim.Owner(**{**here.__dict__, "pid": os.getppid()}))

    with pytest.raises(safe_ckpt.CommitError, match="another save of .* is running") as info:
        dir_prepare.prepare(str(tmp_path / "ck"), dir_prepare.new_save_id())
    assert "another-host" in str(info.value) and f"process {os.getppid()}" in str(info.value)
    assert not any(os.path.exists(p) for p in (dead_here, old_elsewhere, no_record))
    assert os.path.isdir(live_elsewhere) and os.path.isdir(live_here)

    later = os.stat(os.path.join(live_elsewhere, names.OWNER_FILE)).st_mtime + claim.STALE_AFTER_S + 1
    assert not claim.liveness(live_elsewhere, now=later).live
    assert gc_tool.collect(str(tmp_path)) == []
    # a record this old is stale even where its pid runs (the pid may belong to another process now)
    assert gc_tool.collect(str(tmp_path), stale_after_s=0) == sorted([live_elsewhere, live_here])


# ------------------------------------------------------------------ replacing without renameat2


def _saved_then_killed_between_renames(target: str) -> None:
    safe_ckpt.save(_state(1), target, options=_opts())
    commit._exchange = lambda a, b: False  # a filesystem without RENAME_EXCHANGE
    rename = os.rename

    def rename_then_die(src, dst):
        rename(src, dst)
        if names.REPLACED_MARK in os.path.basename(dst):
            os.kill(os.getpid(), signal.SIGKILL)

    os.rename = rename_then_die
    safe_ckpt.save(_state(2), target, options=_opts())


@pytest.fixture(scope="module")
def killed_between_renames(tmp_path_factory):
    root = tmp_path_factory.mktemp("killed")
    proc = multiprocessing.get_context("spawn").Process(target=_saved_then_killed_between_renames,
                                                         args=(str(root / "ck"),))
    proc.start()
    proc.join(240)
    assert proc.exitcode == -signal.SIGKILL
    return root


@pytest.mark.parametrize("recovery", ["gc", "prepare"])
def test_a_replace_killed_between_its_renames_gets_the_old_checkpoint_back(killed_between_renames, tmp_path,
                                                                            recovery):
    root = tmp_path / "copy"
    shutil.copytree(killed_between_renames, root)
    target = root / "ck"
    left = _leftovers(root)
    assert not target.exists() and len(left) == 2  # the name is empty; old aside, new staged
    assert any(names.REPLACED_MARK in n for n in left) and any(names.STAGING_MARK in n for n in left)
    if recovery == "gc":
        removed = gc_tool.collect(str(root))
        assert [os.path.basename(p) for p in removed] == [n for n in left if names.STAGING_MARK in n]
        assert _matches(target, 1) and _leftovers(root) == []
    else:
        area = dir_prepare.prepare(str(target), dir_prepare.new_save_id())
        assert _matches(target, 1) and _leftovers(root) == [os.path.basename(area.staging_dir)]
        commit.abort(area)
        safe_ckpt.save(_state(3), str(target), options=_opts())  # and a save replaces it as usual
        assert _matches(target, 3) and _leftovers(root) == []


def test_a_failed_second_rename_puts_the_old_checkpoint_back(tmp_path, monkeypatch):
    target = tmp_path / "ck"
    safe_ckpt.save(_state(1), str(target), options=_opts())
    monkeypatch.setattr(commit, "_exchange", lambda a, b: False)
    rename = os.rename

    def second_fails(src, dst):
        if names.STAGING_MARK in os.path.basename(src):
            raise OSError(5, "injected EIO renaming the new checkpoint in")
        rename(src, dst)

    monkeypatch.setattr(commit.os, "rename", second_fails)
    with pytest.raises(safe_ckpt.CheckpointError, match="injected EIO"):
        safe_ckpt.save(_state(2), str(target), options=_opts())
    monkeypatch.undo()
    assert _matches(target, 1) and _leftovers(tmp_path) == []


def test_gc_keeps_an_aside_copy_while_the_name_holds_no_complete_checkpoint(tmp_path):
    target = tmp_path / "ck"
    safe_ckpt.save(_state(1), str(target), options=_opts())
    aside = tmp_path / f".ck{names.REPLACED_MARK}{'e' * 16}"
    os.rename(target, aside)
    target.mkdir()
    (target / "notes.txt").write_text("someone else's")
    assert gc_tool.collect(str(tmp_path)) == []
    assert _matches(aside, 1) and (target / "notes.txt").read_text() == "someone else's"


# ------------------------------------------------------------------ targets: links, long names


def test_a_symlinked_target_is_refused_and_left_as_it_was(tmp_path):
    real = tmp_path / "real"
    safe_ckpt.save(_state(1), str(real), options=_opts())
    link = tmp_path / "latest"
    link.symlink_to(real)
    with pytest.raises(safe_ckpt.CommitError, match="symbolic link"):
        safe_ckpt.save(_state(2), str(link), options=_opts())
    assert link.is_symlink() and _matches(real, 1) and _leftovers(tmp_path) == []


def test_gc_reports_a_linked_leftover_only_as_what_it_removed(tmp_path):
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "data").write_text("not gc's")
    link = tmp_path / f".x{names.STAGING_MARK}{'f' * 16}"
    link.symlink_to(kept)
    assert gc_tool.collect(str(tmp_path)) == [str(link)]
    assert not os.path.lexists(link) and (kept / "data").read_text() == "not gc's"


def test_a_target_name_of_240_characters_saves_replaces_and_recovers(tmp_path, monkeypatch):
    name = "iter_" + "x" * 235
    target = tmp_path / name
    safe_ckpt.save(_state(1), str(target), options=_opts())
    assert _matches(target, 1)
    safe_ckpt.save(_state(2), str(target), options=_opts())
    assert _matches(target, 2) and _leftovers(tmp_path) == []
    # a replace killed between its renames: the name is empty, the old checkpoint aside and the
    # new one staged, whose owner record (its process gone) is all that names the target
    aside = leftovers.hidden_path(str(target), names.REPLACED_MARK, "0" * 16)
    staged = leftovers.staging_dir_for(str(target), "0" * 16)
    assert max(len(os.path.basename(aside)), len(os.path.basename(staged))) <= 255
    os.rename(target, aside)
    exited = subprocess.Popen(["true"])
    exited.wait()
    os.mkdir(staged)
    with open(os.path.join(staged, names.OWNER_FILE), "w") as f:
        json.dump({**claim.Owner.here("0" * 16, str(target)).__dict__, "pid": exited.pid}, f)
    assert gc_tool.collect(str(tmp_path)) == [staged] and _matches(target, 2)
    assert _leftovers(tmp_path) == []


# ------------------------------------------------------------------ retention


def _fake_checkpoint(root, iteration: int, complete: bool = True) -> str:
    path = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(path)
    open(os.path.join(path, "__0_0.distcp"), "wb").write(os.urandom(64))
    if complete:
        for name in (".metadata", "metadata.json"):
            open(os.path.join(path, name), "wb").write(b"{}")
    return path


def _iters(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("iter_"))


def test_retention_keeps_lineage_and_touches_only_complete_checkpoints(tmp_path):
    from safe_ckpt.targets.retention import Retention, prune

    for it in (100, 200, 250, 300, 400, 500):
        _fake_checkpoint(tmp_path, it)
    _fake_checkpoint(tmp_path, 150, complete=False)  # a user's directory, not a checkpoint
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "iter_0000050").symlink_to(elsewhere)
    # resumed from 200; 300-500 are an abandoned run's, newer than the current 250
    assert prune(str(tmp_path), 250, Retention(keep_last=2), resumed_from=200) == [100]
    assert _iters(tmp_path) == [f"iter_{i:07d}" for i in (50, 150, 200, 250, 300, 400, 500)]
    assert (tmp_path / "iter_0000050").is_symlink() and elsewhere.is_dir()
    assert prune(str(tmp_path), 250, Retention(keep_last=1, remove_newer=True), resumed_from=200) == [300, 400, 500]
    assert _iters(tmp_path) == [f"iter_{i:07d}" for i in (50, 150, 200, 250)]
    assert _leftovers(tmp_path) == []


def test_save_state_never_removes_the_checkpoint_the_run_resumed_from(tmp_path):
    from safe_ckpt.megatron import save_state
    from safe_ckpt.targets.retention import Retention

    root = str(tmp_path)
    for it in (100, 200, 300, 400, 500):
        _fake_checkpoint(root, it)
    _fake_checkpoint(root, 150, complete=False)
    dir_root.write_tracker(root, 200)  # the run resumes from 200, then saves 250 and 260
    for it in (250, 260):
        save_state(_state(it), root, os.path.join(root, f"iter_{it:07d}"), str(it), options=_opts(),
                   retention=Retention(keep_last=2))
    assert _iters(root) == [f"iter_{i:07d}" for i in (150, 200, 250, 260, 300, 400, 500)]
    assert _matches(os.path.join(root, "iter_0000260"), 260)
    assert open(os.path.join(root, names.TRACKER_FILE)).read() == "260"
