"""The ranks' agreement on the global plan: plans travel without their shards' paths, and a
refused plan's errors still name them, whatever happens to the second exchange that fetches
them. Unit tests on hand-built plans, then 2 gloo ranks through `safe_ckpt.save`."""

import copy
import os
import pickle
import signal

import torch

import safe_ckpt
from safe_ckpt.plan.agreement import PLACES_STAGE, agree
from safe_ckpt.errors import CoordinationError
from safe_ckpt.plan.message import PlanMessage, layout_options
from safe_ckpt.plan.records import UNSENT_PATH, Box, RankPlan, ShardRef
from tests.helpers.mp import run_world

LAYOUT = layout_options(1 << 20, 1)


def _plan(rank: int, dtype=torch.float32, shards: int = 40) -> RankPlan:
    """Rank ``rank`` of 2 holds rows [2r, 2r + 2) of every key."""
    return RankPlan(rank, [ShardRef(f"k{i}", rank, i, dtype, (4, 8), Box((2 * rank, 0), (2, 8)), True, "pageable",
                                    f"state['layers'][{i}]['w']") for i in range(shards)])


def _messages(plans, layouts=None):
    """What every rank receives from the planning exchange."""
    return [pickle.loads(pickle.dumps(PlanMessage(p.without_paths(), None, None, (layouts or {}).get(p.rank, LAYOUT))))
            for p in plans]


class _Exchange:
    """The save's collective as `agree` sees it: every rank's ``obj``, recorded; or a failure."""

    def __init__(self, others, error=None):
        self.others, self.error, self.calls = others, error, []

    def __call__(self, stage, obj):
        self.calls.append((stage, obj))
        if self.error is not None:
            raise self.error
        return [obj, *self.others]


def test_a_rank_plan_travels_without_its_paths_and_copies_faithfully():
    plan = _plan(1)
    assert copy.deepcopy(plan) == plan and pickle.loads(pickle.dumps(plan)) == plan
    sent = pickle.loads(pickle.dumps(plan.without_paths()))
    assert [s.path for s in sent.shards] == [UNSENT_PATH] * 40 and sent.with_paths(plan.paths()) == plan
    # the one UNSENT_PATH object pickles once (at 1217 shards per rank: 231 against 81 KB)
    assert len(pickle.dumps(plan.without_paths())) < 0.6 * len(pickle.dumps(plan))


def test_an_accepted_plan_needs_no_second_exchange():
    plans = [_plan(0), _plan(1)]
    exchange = _Exchange([plans[1].paths()])
    got = agree(_messages(plans), plans[0].paths(), 1 << 20, 1, exchange)
    assert got.plan is not None and got.problems == [] and exchange.calls == []


def test_a_refused_plan_fetches_every_ranks_paths_once_to_name_them():
    plans = [_plan(0), _plan(1, torch.bfloat16)]
    exchange = _Exchange([plans[1].paths()])
    got = agree(_messages(plans), plans[0].paths(), 1 << 20, 1, exchange)
    assert got.plan is None and got.cause is None
    assert exchange.calls == [(PLACES_STAGE, plans[0].paths())]
    assert ("ranks disagree on dtype: torch.float32 at state['layers'][0]['w'] on rank 0; "
            "torch.bfloat16 at state['layers'][0]['w'] on rank 1") in got.problems[0].message
    assert not any(UNSENT_PATH in p.message for p in got.problems)


def test_a_lost_second_exchange_keeps_the_refusal_and_says_why_it_is_unworded():
    plans = [_plan(0), _plan(1, torch.bfloat16)]
    lost = CoordinationError("rank 0 lost contact with its peers", [])
    got = agree(_messages(plans), plans[0].paths(), 1 << 20, 1, _Exchange([], lost))
    assert got.plan is None and got.cause is lost
    assert sorted(p.key for p in got.problems) == sorted(f"k{i}" for i in range(40))
    assert "ranks disagree on dtype" in got.problems[0].message


def test_paths_that_do_not_fit_their_plans_keep_the_refusal_and_name_the_bug():
    plans = [_plan(0), _plan(1, torch.bfloat16)]
    got = agree(_messages(plans), plans[0].paths(), 1 << 20, 1, _Exchange([["one path"]]))
    assert got.plan is None and isinstance(got.cause, ValueError) and "rank 1 sent 1 paths for 40" in str(got.cause)
    assert "ranks disagree on dtype" in got.problems[0].message


def test_a_check_failing_on_one_rank_still_meets_its_peers_in_the_second_exchange(monkeypatch):
    from safe_ckpt.plan import agreement

    def out_of_memory(*args, **kwargs):
        raise MemoryError("cannot cut the chunks")

    monkeypatch.setattr(agreement, "build_global_plan", out_of_memory)
    exchange = _Exchange([None])
    got = agree(_messages([_plan(0), _plan(1)]), _plan(0).paths(), 1 << 20, 1, exchange)
    assert exchange.calls == [(PLACES_STAGE, None)] and isinstance(got.cause, MemoryError)
    assert got.problems[0].message == "internal error: MemoryError: cannot cut the chunks"


def test_option_mismatches_fail_every_rank_and_a_failing_check_is_an_internal_error():
    plans = [_plan(0), _plan(1), _plan(2)]
    exchange = _Exchange([[], []])
    got = agree(_messages(plans, {1: layout_options(1 << 19, 1)}), [], 1 << 20, 1, exchange)
    assert [p.key for p in got.problems] == ["<SaveOptions.chunk_bytes>"] and got.problems[0].ranks == (1,)
    # values that do not sort (another library version's options): an error every rank raises alike
    odd = {1: {"chunk_bytes": None, "io_threads": 1}, 2: {"chunk_bytes": 4, "io_threads": 1}}
    got = agree(_messages(plans, odd), [], 1 << 20, 1, exchange)
    assert got.plan is None and got.problems[0].ranks == (0, 1, 2)
    assert got.problems[0].message.startswith("internal error: TypeError"), got.problems[0].message
    assert exchange.calls == [(PLACES_STAGE, None)]  # every rank alike: they all meet there


# ----------------------------------------------------------------- 2 gloo ranks


def _state(rank):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    rows = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    data = rows.bfloat16() if rank == 1 else rows
    return {"layers": [{"w": ShardedTensor("x", data, data.dtype, (2, 4), (4, 4), (2 * rank, 0),
                                           axis_fragmentations=None, replica_id=0)}]}


def _opts():
    return safe_ckpt.SaveOptions(chunk_bytes=16 * 1024, io_threads=1, progress_interval_s=0, collective_timeout_s=60)


def _refused_save(rank, world, target, fault):
    """A save both ranks refuse (their dtypes differ), with ``fault`` on rank 1 in the agreement."""
    from safe_ckpt.plan import agreement
    from safe_ckpt.coord import dist

    if rank == 1 and fault == "dies_before_second_exchange":
        exchange = dist.Coordinator.exchange

        def dying(self, stage, obj):
            if stage == PLACES_STAGE:
                os._exit(3)
            return exchange(self, stage, obj)

        dist.Coordinator.exchange = dying
    if rank == 1 and fault == "out_of_memory_on_one_rank":
        def out_of_memory(*args, **kwargs):
            raise MemoryError("cannot cut the chunks")

        agreement.build_global_plan = out_of_memory
    if rank == 1 and fault == "sigint_while_agreeing":
        # Python's own SIGINT handler, whatever this process inherited (a runner started in the
        # background of a shell passes SIGINT ignored, and an ignored SIGINT is never held)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        build = agreement.build_global_plan

        def interrupted(*args, **kwargs):
            # SIGINT's handler, called as the interpreter calls it on delivery (os.kill's delivery
            # waits for the main thread's next check, which a loaded machine can delay past the hold)
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
            return build(*args, **kwargs)

        agreement.build_global_plan = interrupted
    try:
        safe_ckpt.save(_state(rank), target, options=_opts())
    except BaseException as exc:
        return {"type": type(exc).__name__, "message": str(exc), "cause": type(exc.__cause__).__name__,
                "left": sorted(os.listdir(os.path.dirname(target)))}
    return None


def test_a_peer_lost_while_naming_the_shards_still_gives_the_refusal_and_cleans_up(tmp_path):
    target = str(tmp_path / "ck")
    (s0, r0), (s1, r1) = run_world(2, _refused_save, (target, "dies_before_second_exchange"), timeout_s=120)
    assert s0 == "ok" and s1 == "hung" and r1 == {"exitcode": 3}, (s0, r0, s1, r1)
    assert r0["type"] == "ValidationError" and r0["cause"] == "CoordinationError", r0
    assert "ranks disagree on dtype" in r0["message"] and r0["left"] == [], r0


def test_an_interrupt_while_agreeing_is_held_until_both_ranks_have_the_worded_refusal(tmp_path):
    target = str(tmp_path / "ck")
    (s0, r0), (s1, r1) = run_world(2, _refused_save, (target, "sigint_while_agreeing"), timeout_s=120)
    assert (s0, s1) == ("ok", "ok"), (r0, r1)
    assert r0["type"] == "ValidationError" and r1["type"] == "KeyboardInterrupt", (r0, r1)
    assert "torch.bfloat16 at state['layers'][0]['w'] on rank 1" in r0["message"], r0
    assert r0["left"] == []  # rank 0 removes the staging directory before it raises


def test_a_check_failing_on_one_rank_fails_both_at_once(tmp_path):
    """Rank 0 refuses the plan and asks for the paths; rank 1's own check ran out of memory. Both
    raise well before the 60 s collective timeout: rank 1 meets rank 0 in the second exchange."""
    import time

    target = str(tmp_path / "ck")
    t0 = time.monotonic()
    (s0, r0), (s1, r1) = run_world(2, _refused_save, (target, "out_of_memory_on_one_rank"), timeout_s=120)
    assert time.monotonic() - t0 < 50
    assert (s0, s1) == ("ok", "ok"), (r0, r1)
    assert r0["type"] == "ValidationError" and "ranks disagree on dtype" in r0["message"], r0
    assert r0["cause"] == "TypeError" and r0["left"] == [], r0  # rank 1 sent no paths: the refusal unworded
    assert r1["type"] == "CheckpointError" and "internal error: MemoryError" in r1["message"], r1
