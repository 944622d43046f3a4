"""A save never pairs with another save, never leaves its peers behind on a local failure,
lets interrupts through as themselves, is never silent about an async failure at exit, and
notices host sources changed behind the version counter (real gloo processes, real files)."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.bodies import coordination as cases
from tests.helpers.mp import run_world, values


@pytest.mark.parametrize("mirrored", [True, False])
def test_two_saves_at_once_in_each_process(tmp_path, mirrored):
    root = str(tmp_path)
    out = values(run_world(2, cases.concurrent_saves, (root, mirrored), timeout_s=400))
    for rank, r in enumerate(out):
        assert r["threads_alive"] == [], (rank, r)
        if mirrored:  # rank 0 saves model first, rank 1 ema first: both conflicting saves fail
            for name in ("model", "ema"):
                err = r[name]["error"]
                assert err is not None and "CoordinationError" in err["mro"], (rank, name, r[name])
                assert "model" in err["message"] and "ema" in err["message"], err["message"]
            assert r["published"] == [], (rank, r["published"])
        else:  # the same order everywhere: the later save waits for the earlier, both succeed
            assert r["model"]["error"] is None and r["ema"]["error"] is None, (rank, r)
            assert r["published"] == ["ema", "model"] and all(r["loads"].values()), (rank, r["loads"])
        assert r["after"]["error"] is None and r["after_loads"], (rank, r["after"])
        assert r["leftovers"] == [], r["leftovers"]
    if mirrored:  # the same message on both ranks for each collective that met the wrong save
        assert out[0]["model"]["error"]["message"] == out[1]["ema"]["error"]["message"]
        assert out[0]["ema"]["error"]["message"] == out[1]["model"]["error"]["message"]
    assert sorted(os.listdir(root)) == (["after"] if mirrored else ["after", "ema", "model"])


def test_a_rank_local_failure_after_planning_fails_every_rank_promptly(tmp_path):
    root = str(tmp_path)
    out = values(run_world(2, cases.local_failure_then_save, (root,), timeout_s=300))
    for stage, culprit in (("factory", "cannot build the sink"), ("hook", "post-commit step failed")):
        messages = {r[stage]["error"]["message"] for r in out if r[stage]["error"]}
        for rank, r in enumerate(out):
            err = r[stage]["error"]
            assert err is not None and "CheckpointError" in err["mro"], (stage, rank, err)
            assert err["failing_ranks"] == [1] and culprit in err["message"], (stage, rank, err["message"])
            assert r[stage]["elapsed_s"] < 60, (stage, rank, r[stage]["elapsed_s"])  # not the 300 s timeout
        assert len(messages) == 1, messages
    for r in out:
        assert not r["broken_exists"] and r["leftovers_after_factory"] == [], r
        assert r["good"]["error"] is None and r["good_loads"], r["good"]
        assert r["leftovers"] == [], r["leftovers"]


def test_interrupts_propagate_as_themselves_and_stop_the_writers(tmp_path):
    root = str(tmp_path)
    out = values(run_world(2, cases.interrupts, (root,), timeout_s=300))
    assert out[1]["sigint_handler_is_default"]
    for stage in ("writer", "main"):
        assert out[1][stage]["error"]["type"] == "KeyboardInterrupt", (stage, out[1][stage])
        peer = out[0][stage]["error"]
        assert peer is not None and "CheckpointError" in peer["mro"] and peer["failing_ranks"] == [1], (stage, peer)
        assert "KeyboardInterrupt" in peer["message"], peer["message"]
    for rank, r in enumerate(out):
        assert r["writer_threads_after"] == [] and r["main_threads_after"] == [], (rank, r)
        assert r["published"] == [] and r["leftovers"] == [], (rank, r)
        assert r["good"]["error"] is None and r["good_loads"], (rank, r["good"])


def test_in_place_change_through_data_fails_an_async_save(tmp_path):
    root = str(tmp_path)
    out = values(run_world(2, cases.changed_through_data, (root,), timeout_s=300))
    assert not out[1]["version_moved"]  # what the version counter alone cannot see
    messages = set()
    for rank, r in enumerate(out):
        err = r["torn"]["error"]
        assert err is not None and "SourceModifiedError" in err["mro"], (rank, r["torn"])
        assert err["failing_ranks"] == [1] and "'w'" in err["message"] and "rank 1" in err["message"], err
        messages.add(err["message"])
        assert not r["torn_exists"] and r["leftovers"] == [], (rank, r)
        assert r["good"]["error"] is None and r["good_loads"], (rank, r["good"])
    assert len(messages) == 1


def test_arrival_keys_do_not_accumulate_and_saves_go_on_after_a_failure(tmp_path):
    out = values(run_world(2, cases.store_keys, (str(tmp_path),), timeout_s=300))
    for r in out:
        assert r["errors"][2] == "WriteError" and [e for i, e in enumerate(r["errors"]) if i != 2] == [None] * 5, r
        assert r["counts"][-1] <= r["counts"][1], r["counts"]  # bounded, whatever the number of saves
        assert r["last_loads"]


_UNOBSERVED = textwrap.dedent("""
    import errno, logging, sys
    import torch
    import safe_ckpt
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from safe_ckpt.sinks.faults import Fault, FaultySink
    from safe_ckpt.sinks.posix import PosixSink

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(8))
    state = {"w": ShardedTensor("w", w, w.dtype, (64, 64), (64, 64), (0, 0), axis_fragmentations=None)}
    full = Fault(after_bytes=0, errno=errno.ENOSPC)
    opts = safe_ckpt.SaveOptions(chunk_bytes=16 * 1024, io_threads=1, progress_interval_s=0,
                                 sink_factory=lambda d: FaultySink(PosixSink(d, False), full))
    safe_ckpt.async_save(state, sys.argv[1], options=opts)  # never waited for
""")


def test_an_unobserved_async_failure_is_loud_at_exit(tmp_path):
    script = tmp_path / "unobserved.py"
    script.write_text(_UNOBSERVED)
    target = str(tmp_path / "ckpt_that_failed")
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(script), target], capture_output=True, text=True, timeout=300,
                          env=env)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR") and target in line]
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert errors and "No space left" in proc.stderr, proc.stderr[-3000:]
    assert not os.path.exists(target)


def test_a_new_group_at_a_dead_groups_address_starts_its_own_counts():
    """safe_ckpt numbers the collectives and saves of each group; a group that is gone must
    take its numbers with it, or a new group given its address (on one rank, by chance) would
    go on counting from them there while the other ranks start at 1: every save on it would
    then fail as cross-paired."""
    from safe_ckpt.coord import dist as safe_dist
    from tests.helpers.addresses import new_at_freed_address

    class Group:  # any object a save's group can be; the counts only need it weakly
        pass

    old = Group()
    for _ in range(3):
        safe_dist._next(safe_dist._sequences, old)
    address = id(old)
    del old
    new = new_at_freed_address(address, Group)
    if new is None:
        pytest.skip("this interpreter did not reuse the freed address")
    assert safe_dist._next(safe_dist._sequences, new) == 1
