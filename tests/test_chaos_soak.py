"""Chaos soak (off by default: `bash scripts/soak.sh`, or `pytest --soak tests/test_chaos_soak.py -s`).

Saves iterations 1..N through the Megatron adapter (`save_state`, retention keep-last on) from a
world of real gloo rank processes while seeded random faults hit: SIGKILL of a random rank after a
random number of bytes, ENOSPC or EIO in a rank's sink, `safe-ckpt gc` while a rank is held at a
gate mid-write, a second process saving the same iteration while the world's save is held, and
`gc` between saves. After every step it checks what a user relies on:
- the tracker names a checkpoint that stock `megatron.core.dist_checkpointing.load` reads back
  bit-exact, equal to the state saved at that iteration, on every rank;
- the complete checkpoints are exactly what the retention policy promises (the newest
  keep-last, plus the one the world resumed from), and a failed save changed none of them;
- no staging area outlives its dead process past the next `gc`, and `gc` never removes a live
  save's area (a save held while `gc` runs still succeeds).
It prints the counts (saves attempted, faults by kind, checkpoints verified, lost) and fails
if anything was lost. SOAK_STEPS, SOAK_RANKS (2-4) and SOAK_SEED change the run.
"""

from __future__ import annotations

import collections
import errno
import json
import os
import queue as queue_mod
import random
import signal
import time

import pytest
import torch.multiprocessing as mp

from tests import chaos_cases as cc

KINDS = ["none", "enospc", "eio_sync", "kill", "gc_during", "intruder"]
WEIGHTS = [40, 12, 10, 12, 13, 13]
RESULT_WAIT_S = 120.0


class World:
    """The rank processes of one gloo world; restarted after a rank is killed."""

    def __init__(self, ctx, size: int, tmp: str, generation: int, timeout_s: float) -> None:
        self.size = size
        self.init_file = os.path.join(tmp, f"store_{generation}")
        self.commands = [ctx.Queue() for _ in range(size)]
        self.results = ctx.Queue()
        self.arrived = [ctx.Event() for _ in range(size)]
        self.go = [ctx.Event() for _ in range(size)]
        self.procs = [ctx.Process(target=cc.rank_main, args=(r, size, self.init_file, self.commands[r], self.results,
                                                            self.arrived[r], self.go[r], timeout_s))
                      for r in range(size)]
        for p in self.procs:
            p.start()
        ready = self._collect(RESULT_WAIT_S)
        assert all(s == "ready" for s, _ in ready.values()), ready

    def _collect(self, wait_s: float) -> dict:
        got: dict = {}
        deadline = time.monotonic() + wait_s
        while len(got) < self.size and time.monotonic() < deadline:
            try:
                rank, status, value = self.results.get(timeout=0.2)
                got[rank] = (status, value)
            except queue_mod.Empty:
                for r, p in enumerate(self.procs):
                    if r not in got and not p.is_alive():
                        got[r] = ("killed", {"exitcode": p.exitcode})
        for r in range(self.size):
            got.setdefault(r, ("hung", {}))
        return got

    def run(self, cmd: dict, per_rank: dict | None = None) -> dict:
        for e in self.arrived + self.go:
            e.clear()
        for r in range(self.size):
            self.commands[r].put({**cmd, **((per_rank or {}).get(r, {}))})
        return self

    def results_of_step(self) -> dict:
        return self._collect(RESULT_WAIT_S)

    def stop(self) -> None:
        for q in self.commands:
            q.put({"op": "stop"})
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join()


def _tracker(root: str):
    try:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
            return int(f.read())
    except FileNotFoundError:
        return None


def _complete(root: str) -> set[int]:
    from safe_ckpt.commit import is_complete_checkpoint

    return {int(n[5:]) for n in os.listdir(root)
            if n.startswith("iter_") and n[5:].isdigit() and is_complete_checkpoint(os.path.join(root, n))}


def _leftovers(root: str) -> set[str]:
    return {n for n in os.listdir(root) if ".safe_ckpt-" in n}


@pytest.mark.soak
@pytest.mark.timeout(2400)  # 200 steps take ~10 minutes on an idle 2-core machine; longer under load
def test_chaos_soak(tmp_path):
    from safe_ckpt.tools import gc as gc_tool

    steps = int(os.environ.get("SOAK_STEPS", "200"))
    size = int(os.environ.get("SOAK_RANKS", "2"))
    rng = random.Random(int(os.environ.get("SOAK_SEED", "20261203")))
    root = str(tmp_path / "save")
    os.makedirs(root)
    ctx = mp.get_context("spawn")
    generation = 0
    world = World(ctx, size, str(tmp_path), generation, timeout_s=20.0)
    intruder_cmds, intruder_results = ctx.Queue(), ctx.Queue()
    intruder = ctx.Process(target=cc.intruder_main, args=(intruder_cmds, intruder_results))
    intruder.start()
    assert intruder_results.get(timeout=RESULT_WAIT_S)[1] == "ready"

    counts = collections.Counter()
    last_good = None
    resumed_from = None  # the tracker when the current world started: retention must keep it
    dead_leftovers: set[str] = set()  # staging areas whose process was killed, not yet collected
    t0 = time.monotonic()
    try:
        for it in range(1, steps + 1):
            kind = rng.choices(KINDS, WEIGHTS)[0]
            victim = rng.randrange(size)
            fault = None
            if kind == "enospc":
                fault = {"after_bytes": rng.randrange(0, 150_000), "errno": errno.ENOSPC}
            elif kind == "eio_sync":
                fault = {"on": "sync", "errno": errno.EIO}
            elif kind == "kill":
                fault = {"after_bytes": rng.randrange(0, 150_000), "kill_signal": signal.SIGKILL}
            gate = kind in ("gc_during", "intruder")
            complete_before, leftovers_before = _complete(root), _leftovers(root)
            counts["saves attempted"] += 1
            counts[f"fault: {kind}"] += 1
            world.run({"op": "save", "root": root, "iteration": it},
                      {victim: {"fault": fault, "gate": gate}})
            if gate:
                assert world.arrived[victim].wait(RESULT_WAIT_S), f"iteration {it}: the gated rank never wrote"
                if kind == "gc_during":
                    removed = gc_tool.collect(root)
                    counts["gc runs"] += 1
                    dead_leftovers -= set(map(os.path.basename, removed))
                else:
                    intruder_cmds.put({"op": "save", "root": root, "iteration": it})
                    _, status, value = intruder_results.get(timeout=RESULT_WAIT_S)
                    counts[f"intruder {'refused' if status == 'error' else 'saved'}"] += 1
                world.go[victim].set()
            results = world.results_of_step()
            statuses = {s for s, _ in results.values()}
            killed = "killed" in statuses
            ok = statuses == {"ok"}
            assert "hung" not in statuses, f"iteration {it}: a rank hung: {results}"
            if kind in ("none", "gc_during") or (kind == "intruder" and not killed):
                # no fault touched this save's own sink: it must succeed (gc and the intruder
                # must leave a live save alone)
                assert ok, f"iteration {it} ({kind}) failed: {json.dumps(results, default=str)[:3000]}"
            if not ok and not killed:
                # every rank raised, and the same error
                errors = [v for s, v in results.values() if s == "error"]
                assert len(errors) == size, f"iteration {it}: some ranks succeeded alone: {results}"
                assert len({e["message"] for e in errors}) == 1, f"iteration {it}: ranks disagree: {errors}"
            if ok:
                last_good = it
                counts["saves succeeded"] += 1
            if killed:
                counts["worlds restarted"] += 1
                world.stop()
                generation += 1
                dead_leftovers |= _leftovers(root) - leftovers_before
                world = World(ctx, size, str(tmp_path), generation, timeout_s=20.0)
                resumed_from = _tracker(root)

            # the tracker names the last successful save, which loads bit-exact on every rank
            assert _tracker(root) == last_good, f"iteration {it} ({kind}): tracker {_tracker(root)} != {last_good}"
            if last_good is not None:
                loaded = world.run({"op": "load", "root": root, "iteration": last_good}).results_of_step()
                for r, (status, value) in loaded.items():
                    assert status == "ok" and value["mismatches"] == [], \
                        f"iteration {it} ({kind}), rank {r}: tracked iteration {last_good} does not load back: " \
                        f"{str(value.get('mismatches') or value.get('message'))[:1500]}"
                counts["checkpoints verified"] += 1

            complete = _complete(root)
            if ok:
                expect = set(sorted(complete_before | {it})[-cc.KEEP_LAST:])
                if resumed_from in complete_before | {it}:
                    expect.add(resumed_from)
            else:
                expect = complete_before  # a failed save publishes nothing and removes nothing
            lost = expect - complete
            counts["lost"] += len(lost)
            assert not lost, f"iteration {it} ({kind}): lost {sorted(lost)}"
            assert complete == expect, f"iteration {it} ({kind}): complete {sorted(complete)}, retention promises {sorted(expect)}"

            if rng.random() < 0.2:
                removed = set(map(os.path.basename, gc_tool.collect(root)))
                counts["gc runs"] += 1
                dead_leftovers -= removed
                assert not (_leftovers(root) & dead_leftovers), f"iteration {it}: gc left dead saves' areas"
            assert _leftovers(root) <= dead_leftovers, \
                f"iteration {it}: leftovers of live or finished saves: {_leftovers(root) - dead_leftovers}"
        gc_tool.collect(root)
        assert not _leftovers(root), _leftovers(root)
    finally:
        world.stop()
        intruder_cmds.put({"op": "stop"})
        intruder.join(timeout=20)
        if intruder.is_alive():
            intruder.kill()
        counts["seconds"] = round(time.monotonic() - t0)
        print("\nchaos soak:", json.dumps(dict(sorted(counts.items())), indent=1))
    assert counts["lost"] == 0
    assert counts["saves succeeded"] > steps // 4 and counts["worlds restarted"] > 0
