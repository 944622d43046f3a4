"""Hostile inputs at 2 and 4 ranks: the same error on every rank, naming key and ranks; nothing committed."""

import pytest

from tests.helpers.bodies import common as cases
from tests.helpers.mp import run_world, values


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def outcomes(request, tmp_path_factory):
    world = request.param
    root = str(tmp_path_factory.mktemp(f"hostile{world}"))
    return world, values(run_world(world, cases.hostile, (root,)))


@pytest.mark.parametrize("case", cases.HOSTILE_CASES)
def test_hostile_input_is_refused_everywhere(outcomes, case):
    world, per_rank = outcomes
    records = [r[case] for r in per_rank]
    messages = set()
    for rank, rec in enumerate(records):
        err = rec["error"]
        assert err is not None, f"rank {rank} accepted hostile input {case!r}"
        assert "ValidationError" in err["mro"] and "CheckpointError" in err["mro"], err
        assert repr(rec["key"]) in err["message"], err["message"]
        assert err["failing_ranks"] == rec["expected_ranks"], (err["failing_ranks"], err["message"])
        assert not rec["committed"] and rec["leftovers"] == [], rec
        messages.add(err["message"])
    assert len(messages) == 1, "ranks raised different errors"
