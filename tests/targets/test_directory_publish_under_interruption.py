"""The local-directory commit path under interruption and concurrency: an in-place publish
never shows a mixed checkpoint as complete, two saves starting together cannot both pass,
gc leaves a running save's tracker temporary and anything behind a symbolic link alone, a
stale leftover is never half-deleted under its own name, and a heartbeat survives one failure."""

import os
import random
import threading

import pytest

from safe_ckpt.targets.directory import claim, publish as commit, leftovers
from safe_ckpt.targets.directory import prepare as dir_prepare, root as dir_root, inplace
from safe_ckpt import names
from safe_ckpt.errors import CommitError
from safe_ckpt.targets.directory import gc as gc_tool


def _data(seed: int, n_bytes: int = 4096) -> bytes:
    return random.Random(seed).randbytes(n_bytes)


def _old_checkpoint(target, n_shards: int) -> dict[str, bytes]:
    target.mkdir(parents=True)
    files = {".metadata": _data(1), "metadata.json": b'{"sharded_backend": "torch_dist"}', "common.pt": _data(2)}
    files.update({f"__{r}_0.distcp": _data(10 + r) for r in range(n_shards)})
    for name, data in files.items():
        (target / name).write_bytes(data)
    return files


def _stage(area, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        with open(os.path.join(area.staging_dir, name), "wb") as f:
            f.write(data)


def test_interrupted_in_place_publish_never_reads_as_complete(tmp_path, monkeypatch):
    target = tmp_path / "iter_0000020"
    _old_checkpoint(target, n_shards=3)
    area = dir_prepare.prepare(str(target), dir_prepare.new_save_id())
    new = {".metadata": _data(3), "__0_0.distcp": _data(20), "__1_0.distcp": _data(21)}
    _stage(area, new)
    real_replace, calls = os.replace, []

    def crash_on_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(commit.os, "replace", crash_on_second)
    with pytest.raises(CommitError, match="simulated crash.*holds no checkpoint now"):
        inplace.publish_into(area, last=".metadata", fsync=False)
    monkeypatch.setattr(commit.os, "replace", real_replace)
    # new __0_0 beside old __1_0 and __2_0: the directory must not read as a checkpoint
    assert (target / "__0_0.distcp").read_bytes() == new["__0_0.distcp"]
    assert (target / "__1_0.distcp").read_bytes() == _data(11)
    assert not leftovers.is_complete_checkpoint(str(target))
    area.claim.release()


def test_in_place_publish_removes_the_earlier_saves_extra_shards(tmp_path):
    target = tmp_path / "iter_0000030"
    old = _old_checkpoint(target, n_shards=3)
    area = dir_prepare.prepare(str(target), dir_prepare.new_save_id())
    new = {".metadata": _data(4), "__0_0.distcp": _data(30), "__1_0.distcp": _data(31)}
    _stage(area, new)
    inplace.publish_into(area, last=".metadata", fsync=True)
    names = sorted(os.listdir(target))
    assert names == sorted([".metadata", "metadata.json", "common.pt", "__0_0.distcp", "__1_0.distcp"])
    for name, data in new.items():
        assert (target / name).read_bytes() == data
    assert (target / "common.pt").read_bytes() == old["common.pt"]  # Megatron's own file stays
    assert not os.path.lexists(area.staging_dir)


def test_two_saves_starting_together_cannot_both_prepare(tmp_path, monkeypatch):
    target = str(tmp_path / "ck")
    real_check, real_lock = dir_prepare.check_target, getattr(dir_prepare, "parent_lock", None)
    first_in, second_arrived = threading.Event(), threading.Event()
    entered = []

    def gated_check(final_dir, replace):
        real_check(final_dir, replace)
        entered.append(threading.current_thread().name)
        if len(entered) == 1:
            first_in.set()
            # the second save reaches this point too (no lock) or has started waiting for the lock
            assert second_arrived.wait(30)
        else:
            second_arrived.set()

    def noted_lock(parent, *args, **kwargs):
        if first_in.is_set():
            second_arrived.set()
        return real_lock(parent, *args, **kwargs)

    monkeypatch.setattr(dir_prepare, "check_target", gated_check)
    monkeypatch.setattr(dir_prepare, "parent_lock", noted_lock, raising=False)
    outcome = {}

    def save(name):
        try:
            outcome[name] = dir_prepare.prepare(target, dir_prepare.new_save_id())
        except CommitError as exc:
            outcome[name] = exc

    a = threading.Thread(target=save, args=("a",), name="a")
    a.start()
    assert first_in.wait(30)
    b = threading.Thread(target=save, args=("b",), name="b")
    b.start()
    a.join(30)
    b.join(30)
    assert isinstance(outcome["a"], dir_prepare.StagingArea)
    assert isinstance(outcome["b"], CommitError) and "is running" in str(outcome["b"])
    outcome["a"].claim.release()


def test_prepare_proceeds_where_the_filesystem_has_no_locks(tmp_path, monkeypatch):
    import errno
    import fcntl

    real_flock = fcntl.flock

    def no_locks(fd, op):
        if op & fcntl.LOCK_EX and os.path.samefile(f"/proc/self/fd/{fd}", tmp_path):
            raise OSError(errno.ENOLCK, "no locks")
        return real_flock(fd, op)

    monkeypatch.setattr(dir_prepare.fcntl, "flock", no_locks)
    area = dir_prepare.prepare(str(tmp_path / "ck"), dir_prepare.new_save_id())
    assert os.path.isdir(area.staging_dir)
    area.claim.release()


def test_gc_leaves_a_running_saves_tracker_temporary_alone(tmp_path, monkeypatch):
    root = str(tmp_path)
    dir_root.write_tracker(root, 100)
    stale = os.path.join(root, names.TRACKER_FILE + names.STAGING_MARK + "0123456789abcdef")
    with open(stale, "w") as f:
        f.write("90")
    os.utime(stale, (1, 1))  # a crashed save's, long ago
    real_replace, removed = os.replace, []

    def gc_first(src, dst):
        if os.path.basename(dst) == names.TRACKER_FILE:
            removed.extend(gc_tool.collect(root))
        real_replace(src, dst)

    monkeypatch.setattr(commit.os, "replace", gc_first)
    dir_root.write_tracker(root, 200)
    monkeypatch.setattr(commit.os, "replace", real_replace)
    assert open(os.path.join(root, names.TRACKER_FILE)).read() == "200"
    assert removed == [stale] and not os.path.lexists(stale)
    assert [n for n in os.listdir(root) if names.STAGING_MARK in n] == []


def test_gc_does_not_follow_a_symbolic_link_out_of_root(tmp_path):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    precious = elsewhere / ".precious.safe_ckpt-deleting-abc"
    precious.mkdir(parents=True)
    (precious / "data").write_bytes(_data(5))
    (root / "link").symlink_to(elsewhere, target_is_directory=True)
    own = root / "sub" / ".x.safe_ckpt-deleting-def"
    own.mkdir(parents=True)
    assert gc_tool.collect(str(root)) == [str(own)]
    assert (precious / "data").read_bytes() == _data(5) and not own.exists()


def test_a_stale_leftover_removal_cut_short_leaves_no_half_deleted_directory_under_its_name(tmp_path, monkeypatch):
    target = tmp_path / "ck"
    staging = tmp_path / ".ck.safe_ckpt-staging-0123456789abcdef"  # no owner record: a dead save's
    staging.mkdir()
    for i in range(3):
        (staging / f"__{i}_0.distcp").write_bytes(_data(40 + i))
    cut = []

    def cut_short(path, ignore_errors=False):  # the remover dies after deleting one file
        cut.append(path)
        os.unlink(os.path.join(path, sorted(os.listdir(path))[0]))

    monkeypatch.setattr(leftovers.shutil, "rmtree", cut_short)
    swept = leftovers.sweep(leftovers.leftovers_of(str(target)))
    assert swept.removed == [str(staging)] and not os.path.lexists(staging)
    [doomed] = cut
    assert names.DELETING_MARK in os.path.basename(doomed) and len(os.listdir(doomed)) == 2
    monkeypatch.undo()
    assert leftovers.sweep(leftovers.leftovers_of(str(target))).removed == [doomed]
    assert os.listdir(tmp_path) == []


def test_heartbeat_survives_a_failed_refresh(tmp_path, monkeypatch):
    staging = tmp_path / ".ck.safe_ckpt-staging-0123456789abcdef"
    staging.mkdir()
    real_utime, refreshed = os.utime, threading.Event()
    calls = []

    def flaky(path, *args, **kwargs):
        if os.path.basename(path) != names.OWNER_FILE:
            return real_utime(path, *args, **kwargs)
        calls.append(path)
        if len(calls) == 1:
            raise OSError(116, "Stale file handle")
        real_utime(path, *args, **kwargs)
        refreshed.set()

    monkeypatch.setattr(claim.os, "utime", flaky)
    held = claim.Claim(str(staging), claim.Owner.here("0123456789abcdef", str(tmp_path / "ck")), heartbeat_s=0.01)
    try:
        assert refreshed.wait(30), "the heartbeat stopped after one failed refresh"
    finally:
        held.release()


def test_gc_waits_for_a_save_between_creating_and_claiming_its_staging_directory(tmp_path, monkeypatch):
    target = str(tmp_path / "ck")
    real_claim, real_sweep, real_lock = dir_prepare.Claim, gc_tool.sweep, getattr(gc_tool, "parent_lock", None)
    in_window, gc_started = threading.Event(), threading.Event()

    def slow_claim(*args, **kwargs):  # the staging directory exists and has no owner record yet
        in_window.set()
        assert gc_started.wait(30)
        return real_claim(*args, **kwargs)

    def noted_sweep(*args, **kwargs):
        try:
            return real_sweep(*args, **kwargs)
        finally:
            gc_started.set()

    def noted_lock(parent, *args, **kwargs):
        gc_started.set()
        return real_lock(parent, *args, **kwargs)

    monkeypatch.setattr(dir_prepare, "Claim", slow_claim)
    monkeypatch.setattr(gc_tool, "sweep", noted_sweep)
    monkeypatch.setattr(gc_tool, "parent_lock", noted_lock, raising=False)
    outcome = {}

    def save():
        try:
            outcome["save"] = dir_prepare.prepare(target, dir_prepare.new_save_id())
        except Exception as exc:  # noqa: BLE001 (the test reports it)
            outcome["save"] = exc

    a = threading.Thread(target=save)
    a.start()
    assert in_window.wait(30)
    b = threading.Thread(target=lambda: outcome.setdefault("gc", gc_tool.collect(str(tmp_path))))
    b.start()
    a.join(30)
    b.join(30)
    area = outcome["save"]
    assert isinstance(area, dir_prepare.StagingArea), area
    assert outcome["gc"] == [] and os.path.isdir(area.staging_dir)
    area.claim.release()


def test_gc_force_takes_a_fresh_owner_of_another_host_as_stale_but_never_a_locked_one(tmp_path, capsys):
    import json

    from safe_ckpt.cli import main

    elsewhere = claim.Owner("e" * 16, str(tmp_path / "ck"), 4242, "other-host", "other-host/boot/ns")
    dead_remote = tmp_path / f".ck{names.STAGING_MARK}{'e' * 16}"
    dead_remote.mkdir()
    (dead_remote / names.OWNER_FILE).write_text(json.dumps(elsewhere.__dict__))  # a heartbeat just now
    running = dir_prepare.prepare(str(tmp_path / "other"), dir_prepare.new_save_id())  # holds its lock
    assert main(["gc", str(tmp_path)]) == 0 and dead_remote.is_dir()  # fresh: it may still be running
    assert main(["gc", "--force", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"removed {dead_remote}" in out and not dead_remote.exists()
    assert os.path.isdir(running.staging_dir)
    commit.abort(running)
