"""A publish interrupted or failing after the checkpoint was swapped or renamed into place.

Once the swap (renameat2 exchange), the two renames, or the rename to a new name has happened,
the save either finishes (the checkpoint durable, the tracker written, success on every rank; an
interrupt is re-raised on its rank only then, with a log line saying what was published) or puts
the previous checkpoint back and fails on every rank. It never deletes by a name whose content
changed. Two real gloo ranks, real files; the fault is injected on rank 0 at the exact step.
"""

from __future__ import annotations

import os

from safe_ckpt.targets.directory import claim, publish as commit
from safe_ckpt import names
from safe_ckpt.targets.directory import gc as gc_tool
from tests.helpers.bodies import publish as pc
from tests.helpers.mp import run_world, values

CASES = [("exchange", "raise_interrupt"), ("exchange", "sigint"), ("exchange", "eio"),
         ("two_renames", "raise_interrupt"), ("two_renames", "eio"),
         ("rename", "raise_interrupt"), ("rename", "sigint"), ("rename", "eio"),
         ("publish_into", "raise_interrupt")]


def _tracker(root) -> str | None:
    try:
        return open(os.path.join(root, names.TRACKER_FILE)).read()
    except FileNotFoundError:
        return None


def _leftovers(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if ".safe_ckpt-" in n)


def test_a_publish_interrupted_or_failing_after_the_swap_never_loses_the_previous_checkpoint(tmp_path):
    ranks = values(run_world(2, pc.all_scenarios, (str(tmp_path), CASES), timeout_s=400))
    problems = []
    for path, fault in CASES:
        name = f"{path}/{fault}"
        r0, r1 = ranks[0][name], ranks[1][name]
        root = tmp_path / f"{path}-{fault}"
        target = pc.iter_dir(str(root), r0["target"])

        def check(ok: bool, what: str) -> None:
            if not ok:
                problems.append(f"{name}: {what} (rank 0: {r0['type']}: {r0['message'][:300]}; "
                                f"rank 1: {r1['type']}: {r1['message'][:300]})")

        check(r0["fired"], "the fault was not injected")
        if fault == "eio":
            # rolled back: the save fails on every rank, the name holds what it held before
            check(r0["type"] == r1["type"] != "ok" and r0["message"] == r1["message"], "ranks disagree")
            check("EIO" in r0["message"], "the error does not name the failure")
            if path == "rename":
                check(not os.path.exists(target), "a failed save left its checkpoint under the new name")
            else:
                check(os.path.isdir(target) and pc.matches(target, 1, 2), "the previous checkpoint is gone")
            check(_tracker(root) == "2", f"the tracker moved: {_tracker(root)!r}")
        else:
            # finished: published everywhere, the tracker written, then the interrupt on its rank
            check(r0["type"] == "KeyboardInterrupt", "rank 0 did not re-raise its interrupt")
            check(r1["type"] == "ok", "rank 1 failed a save that was published")
            check(os.path.isdir(target) and pc.matches(target, 2, 2), "the new checkpoint is not in place")
            if path != "publish_into":
                check(_tracker(root) == str(r0["target"]), f"the tracker was not written: {_tracker(root)!r}")
                check(any("published" in line and "interrupt" in line for line in r0["log"]),
                      f"no log line says the checkpoint was published: {r0['log']}")
            check(not os.path.exists(os.path.join(target, names.OWNER_FILE)), "the owner record stayed")
        check(_leftovers(root) == [], f"leftovers: {_leftovers(root)}")
        gc_tool.collect(str(root))
        if fault == "eio" and path != "rename":
            check(pc.matches(target, 1, 2), "gc removed the previous checkpoint")
    assert not problems, "\n".join(problems)


def test_a_roll_back_that_fails_too_deletes_nothing_and_says_where_each_checkpoint_is(tmp_path, monkeypatch):
    import errno

    import pytest

    import safe_ckpt

    target = str(tmp_path / "ck")
    safe_ckpt.save(pc.state(1, 0, 1), target, options=pc.options())
    real_fsync, real_exchange, calls = commit.fsync_path, commit._exchange, []

    def fsync_path(path, directory=False):
        if directory and os.path.abspath(path) == str(tmp_path):
            raise OSError(errno.EIO, "injected EIO syncing the parent directory")
        return real_fsync(path, directory=directory)

    def exchange(a, b):
        calls.append((a, b))
        if len(calls) > 1:
            raise OSError(errno.EIO, "injected EIO exchanging back")
        return real_exchange(a, b)

    monkeypatch.setattr(commit, "fsync_path", fsync_path)
    monkeypatch.setattr(commit, "_exchange", exchange)
    with pytest.raises(safe_ckpt.CommitError, match="putting the previous checkpoint back failed too") as err:
        safe_ckpt.save(pc.state(2, 0, 1), target, options=pc.options())
    monkeypatch.undo()
    aside = [n for n in _leftovers(tmp_path) if names.REPLACED_MARK in n]
    assert len(aside) == 1 and aside[0] in str(err.value)
    assert pc.matches(tmp_path / aside[0], 1, 1) and pc.matches(target, 2, 1)  # both kept
