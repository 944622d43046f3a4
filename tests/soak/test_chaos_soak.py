"""Chaos soak (off by default: `bash scripts/soak.sh`, or `pytest --soak tests/soak/test_chaos_soak.py -s`).

Saves iterations 1..N through the Megatron adapter (`save_state`, retention keep-last on) from a
world of real gloo rank processes while seeded random faults hit. On a directory: SIGKILL of a
random rank after a random number of bytes, ENOSPC or EIO in a rank's sink, `safe-ckpt gc` while
a rank is held at a gate mid-write, a second process saving the same iteration while the world's
save is held, `gc` between saves, and faults at each step of the publish (a `KeyboardInterrupt`
before or after a rename, exchange or fsync, a SIGINT, EIO instead of the call), on new
iterations and on re-saves of the tracked one (the atomic exchange). On an object store (a local
moto S3 server, `test_chaos_soak_object_store`): EIO on a data write, SIGKILL, `gc` during a held
save, and the commit's last write unconfirmed (landed; landed and the store cannot be asked;
lost). After every step it checks what a user relies on:
- the tracker names a checkpoint that stock `megatron.core.dist_checkpointing.load` reads back
  bit-exact, equal to the state saved last under that iteration, on every rank;
- the complete checkpoints are exactly what the retention policy promises (the newest
  keep-last, plus the one the world resumed from), a failed save changed none of them, and a
  publish that was interrupted after the swap finished (tracker written) on every rank;
- no staging area (or object-store leftover) outlives its dead process past the next `gc`, and
  `gc` never removes a live save's (a save held while `gc` runs still succeeds).
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
import tempfile
import time

import pytest
import torch.multiprocessing as mp

from tests.helpers.bodies import chaos as cc
from tests.helpers.s3server import s3_server  # noqa: F401  (fixture)

KINDS = ["none", "enospc", "eio_sync", "kill", "gc_during", "intruder", "publish", "resave"]
WEIGHTS = [22, 8, 8, 10, 10, 10, 18, 14]
KV_KINDS = ["none", "data_eio", "kill", "gc_during", "ambiguous_landed", "ambiguous_unknown", "ambiguous_lost"]
KV_WEIGHTS = [30, 10, 10, 12, 14, 12, 12]
PUBLISH_FAULTS = [("interrupt", "before"), ("interrupt", "after"), ("sigint", "before"), ("eio", "before")]
PUBLISH_STEPS = 8  # more than a publish makes: a fault past its last step does not fire
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

    def run(self, cmd: dict, per_rank: dict | None = None) -> "World":
        for e in self.arrived + self.go:
            e.clear()
        for r in range(self.size):
            self.commands[r].put({**cmd, **((per_rank or {}).get(r, {}))})
        return self

    def results_of_step(self) -> dict:
        got = self._collect(RESULT_WAIT_S)
        # a rank that raised its own interrupt: its save is judged with its peers'
        return {r: ("interrupted", v) if s == "error" and v.get("type") in ("KeyboardInterrupt", "SystemExit")
                else (s, v) for r, (s, v) in got.items()}

    def stop(self) -> None:
        for q in self.commands:
            q.put({"op": "stop"})
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join()


class PosixStore:
    """A save root on the local filesystem."""

    def __init__(self, root: str) -> None:
        self.root = root
        os.makedirs(root)

    def tracker(self):
        try:
            with open(os.path.join(self.root, "latest_checkpointed_iteration.txt")) as f:
                return int(f.read())
        except FileNotFoundError:
            return None

    def complete(self) -> set[int]:
        from safe_ckpt.targets.directory.leftovers import is_complete_checkpoint

        return {int(n[5:]) for n in os.listdir(self.root)
                if n.startswith("iter_") and n[5:].isdigit() and is_complete_checkpoint(os.path.join(self.root, n))}

    def leftovers(self) -> set[str]:
        return {n for n in os.listdir(self.root) if ".safe_ckpt-" in n}

    def gc(self) -> set[str]:
        from safe_ckpt.targets.directory import gc as gc_tool

        return set(map(os.path.basename, gc_tool.collect(self.root)))

    def loadable_dir(self, iteration: int) -> str:
        return cc.iter_dir(self.root, iteration)


class S3Store:
    """A save root under a bucket of the local S3 server, given to the ranks as an `s3://` URL
    (the endpoint comes from AWS_ENDPOINT_URL_S3, as in training)."""

    def __init__(self, server, tmp: str) -> None:
        from safe_ckpt.sinks.tensorstore import KvTarget

        self.spec = {**server.bucket("soak"), "aws_credentials": {"type": "environment"}}
        self.root = "s3://soak/run"
        self.target = KvTarget("run", self.spec)
        self.local = tempfile.mkdtemp(prefix="downloads-", dir=tmp)

    def tracker(self):
        from safe_ckpt.sinks.tensorstore import open_sink

        try:
            return int(open_sink(self.target).read("latest_checkpointed_iteration.txt"))
        except FileNotFoundError:
            return None

    def complete(self) -> set[int]:
        from safe_ckpt.targets.objectstore import root as kv_root

        try:
            return set(kv_root.iterations(self.target))
        except FileNotFoundError:
            return set()

    def leftovers(self) -> set[str]:
        from safe_ckpt.targets.objectstore import gc as kv_gc
        from safe_ckpt.errors import PathUsageError

        try:
            return set(kv_gc.find(self.target))
        except PathUsageError:  # nothing saved yet
            return set()

    def gc(self) -> set[str]:
        from safe_ckpt.targets.objectstore import gc as kv_gc
        from safe_ckpt.errors import PathUsageError

        try:
            return set(kv_gc.collect(self.target))
        except PathUsageError:
            return set()

    def loadable_dir(self, iteration: int) -> str:
        from safe_ckpt.tools.copy import copy

        local = tempfile.mkdtemp(prefix=f"iter_{iteration:07d}-", dir=self.local)
        copy(f"run/iter_{iteration:07d}", local, src_spec=self.spec)
        return local


def _posix_fault(kind: str, rng: random.Random):
    if kind == "enospc":
        return {"after_bytes": rng.randrange(0, 150_000), "errno": errno.ENOSPC}
    if kind == "eio_sync":
        return {"on": "sync", "errno": errno.EIO}
    if kind == "kill":
        return {"after_bytes": rng.randrange(0, 150_000), "kill_signal": signal.SIGKILL}
    if kind == "publish" or (kind == "resave" and rng.random() < 0.75):
        what, when = rng.choice(PUBLISH_FAULTS)
        return {"publish": {"step": rng.randrange(PUBLISH_STEPS), "kind": what, "when": when,
                            "no_exchange": kind == "resave" and rng.random() < 0.5}}
    return None


def _kv_fault(kind: str, rng: random.Random):
    if kind in ("data_eio", "kill") or kind.startswith("ambiguous"):
        return {"kv": kind}
    return None


def _soak(tmp_path, store, kinds, weights, make_fault, with_intruder: bool):
    steps = int(os.environ.get("SOAK_STEPS", "200"))
    size = int(os.environ.get("SOAK_RANKS", "2"))
    rng = random.Random(int(os.environ.get("SOAK_SEED", "20261203")))
    ctx = mp.get_context("spawn")
    generation = 0
    world = World(ctx, size, str(tmp_path), generation, timeout_s=20.0)
    intruder_cmds, intruder_results, intruder = ctx.Queue(), ctx.Queue(), None
    if with_intruder:
        intruder = ctx.Process(target=cc.intruder_main, args=(intruder_cmds, intruder_results))
        intruder.start()
        assert intruder_results.get(timeout=RESULT_WAIT_S)[1] == "ready"

    counts = collections.Counter()
    last_good = None
    versions: dict[int, int] = {}  # iteration -> how many re-saves of it were published
    resumed_from = None  # the tracker when the current world started: retention must keep it
    dead_leftovers: set[str] = set()  # leftovers of killed saves, not yet collected
    t0 = time.monotonic()
    try:
        for it in range(1, steps + 1):
            kind = rng.choices(kinds, weights)[0]
            victim = rng.randrange(size)
            fault = make_fault(kind, rng)
            if fault is not None and ("publish" in fault or fault.get("kv", "").startswith("ambiguous")):
                victim = 0  # rank 0 publishes
            target = it
            if kind == "resave":
                if last_good is None:
                    kind, fault = "none", None
                else:
                    target = last_good  # the world went back to its tracked iteration and saves it again
            version = versions.get(target, -1) + 1 if kind == "resave" else 0
            gate = kind in ("gc_during", "intruder")
            complete_before, leftovers_before = store.complete(), store.leftovers()
            counts["saves attempted"] += 1
            counts[f"fault: {kind}" + (f" {fault['publish']['kind']}/{fault['publish']['when']}"
                                       if fault and "publish" in fault else "")] += 1
            world.run({"op": "save", "root": store.root, "iteration": target, "version": version},
                      {victim: {"fault": fault, "gate": gate}})
            if gate:
                assert world.arrived[victim].wait(RESULT_WAIT_S), f"iteration {it}: the gated rank never wrote"
                if kind == "gc_during":
                    dead_leftovers -= store.gc()
                    counts["gc runs"] += 1
                else:
                    intruder_cmds.put({"op": "save", "root": store.root, "iteration": it})
                    _, status, value = intruder_results.get(timeout=RESULT_WAIT_S)
                    counts[f"intruder {'refused' if status == 'error' else 'saved'}"] += 1
                world.go[victim].set()
            results = world.results_of_step()
            statuses = {r: s for r, (s, _) in results.items()}
            killed = "killed" in statuses.values()
            assert "hung" not in statuses.values(), f"iteration {it}: a rank hung: {results}"
            # published: every rank succeeded, or the victim raised its interrupt after the others had
            published = all(s == "ok" or (s == "interrupted" and r == victim) for r, s in statuses.items())
            fired = results[0][1].get("publish_fault_fired") if results[0][0] == "ok" else None
            if "interrupted" in statuses.values():
                counts["interrupted" + (", published" if published else ", not published")] += 1
            if kind in ("none", "gc_during") or (kind == "intruder" and not killed):
                # no fault touched this save's own sink: it must succeed (gc and the intruder
                # must leave a live save alone)
                assert published and "interrupted" not in statuses.values(), \
                    f"iteration {it} ({kind}) failed: {json.dumps(results, default=str)[:3000]}"
            if fault and "publish" in fault and fault["publish"]["kind"] != "eio" and fired is not False:
                # an interrupt never fails a save on the other ranks once the checkpoint is in place;
                # before the swap it fails it everywhere: either way the ranks agree on the outcome
                assert published or all(s != "ok" for s in statuses.values()), f"iteration {it}: {results}"
            errors = {r: v for r, (s, v) in results.items() if s == "error"}
            if not published and not killed:
                # every rank raised, and the same error (the victim's own interrupt aside)
                assert all(s != "ok" for s in statuses.values()), \
                    f"iteration {it}: some ranks succeeded alone: {results}"
                assert len({e["message"] for e in errors.values()}) <= 1, f"iteration {it}: ranks disagree: {errors}"
            ambiguous_kept = not published and any("cannot be asked whether it landed" in e["message"]
                                                   for e in errors.values())
            if published:
                last_good = target
                versions[target] = version
                counts["saves succeeded"] += 1
            elif ambiguous_kept:
                versions[target] = version  # a whole checkpoint the tracker does not name
                counts["ambiguous commits kept"] += 1
            if killed:
                counts["worlds restarted"] += 1
                world.stop()
                generation += 1
                dead_leftovers |= store.leftovers() - leftovers_before
                world = World(ctx, size, str(tmp_path), generation, timeout_s=20.0)
                resumed_from = store.tracker()

            # the tracker names the last successful save, which loads bit-exact on every rank
            assert store.tracker() == last_good, f"iteration {it} ({kind}): tracker {store.tracker()} != {last_good}"
            for check in sorted(({last_good} | ({target} if ambiguous_kept else set())) - {None}):
                directory = store.loadable_dir(check)
                loaded = world.run({"op": "load", "dir": directory, "iteration": check,
                                    "version": versions.get(check, 0)}).results_of_step()
                for r, (status, value) in loaded.items():
                    assert status == "ok" and value["mismatches"] == [], \
                        f"iteration {it} ({kind}), rank {r}: iteration {check} does not load back as saved: " \
                        f"{str(value.get('mismatches') or value.get('message'))[:1500]}"
                counts["checkpoints verified"] += 1

            complete = store.complete()
            if published:
                expect = set(sorted(complete_before | {target})[-cc.KEEP_LAST:])
                if resumed_from in complete_before | {target}:
                    expect.add(resumed_from)
            elif ambiguous_kept:
                expect = complete_before | {target}  # its data kept; the next save's retention counts it
            else:
                expect = complete_before  # a failed save publishes nothing and removes nothing
            lost = expect - complete
            counts["lost"] += len(lost)
            assert not lost, f"iteration {it} ({kind}): lost {sorted(lost)}"
            assert complete == expect, \
                f"iteration {it} ({kind}): complete {sorted(complete)}, retention promises {sorted(expect)}"

            if rng.random() < 0.2:
                dead_leftovers -= store.gc()
                counts["gc runs"] += 1
                assert not (store.leftovers() & dead_leftovers), f"iteration {it}: gc left dead saves' leftovers"
            assert store.leftovers() <= dead_leftovers, \
                f"iteration {it}: leftovers of live or finished saves: {store.leftovers() - dead_leftovers}"
        store.gc()
        assert not store.leftovers(), store.leftovers()
    finally:
        world.stop()
        if intruder is not None:
            intruder_cmds.put({"op": "stop"})
            intruder.join(timeout=20)
            if intruder.is_alive():
                intruder.kill()
        counts["seconds"] = round(time.monotonic() - t0)
        print("\nchaos soak:", json.dumps(dict(sorted(counts.items())), indent=1))
    assert counts["lost"] == 0
    assert counts["saves succeeded"] > steps // 4 and counts["worlds restarted"] > 0


@pytest.mark.soak
@pytest.mark.timeout(2400)  # 200 steps take ~10 minutes on an idle 2-core machine; longer under load
def test_chaos_soak(tmp_path):
    _soak(tmp_path, PosixStore(str(tmp_path / "save")), KINDS, WEIGHTS, _posix_fault, with_intruder=True)


@pytest.mark.soak
@pytest.mark.timeout(3600)
def test_chaos_soak_object_store(tmp_path, s3_server, monkeypatch):
    pytest.importorskip("tensorstore")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)  # the rank processes inherit it
    _soak(tmp_path, S3Store(s3_server, str(tmp_path)), KV_KINDS, KV_WEIGHTS, _kv_fault, with_intruder=False)
