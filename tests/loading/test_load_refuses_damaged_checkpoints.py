"""Damaged and hostile checkpoints: `safe_ckpt.load` refuses each one with the same error on every
rank (naming the file, key and remedy), runs no code from it, and never hangs (a FIFO in place of
a data file included)."""

import pytest

from tests.helpers.bodies import load_hostile as cases
from tests.helpers.mp import run_world, values


def _assert_same_error(case, out, kind):
    errors = [r["error"] for r in out]
    assert all(e is not None for e in errors), (case, errors)
    assert len({e["message"] for e in errors}) == 1, (case, [e["message"] for e in errors])
    assert all(kind in e["mro"] and "CheckpointError" in e["mro"] for e in errors), (case, errors[0])
    message = errors[0]["message"]
    assert message.startswith("safe_ckpt: load of ") and "rank" in message, message
    for name in out[0]["expect"].get("names", []):
        assert name in message, (case, name, message)
    assert not any(r["code_ran"] for r in out), case


KINDS = {"missing_key": "ValidationError", "shape_mismatch": "ValidationError"}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    return values(run_world(2, cases.every_case, (str(tmp_path_factory.mktemp("hostile")),), timeout_s=400))


@pytest.mark.parametrize("case", cases.CASES)
def test_hostile_checkpoint_is_refused_on_every_rank(refusals, case):
    # rank 0 damaged the checkpoint: only it knows what the message should name
    out = [{**r[case], "expect": refusals[0][case]["expect"]} for r in refusals]
    _assert_same_error(case, out, KINDS.get(case, "ReadError"))
    if case == "object_class":
        assert all(r["with_remedy"] for r in out)
    if case == "corrupt_payload":
        assert any(r["unchecked_mismatches"] for r in out)  # the damage is real; only the check caught it
    if case == "integrity_json":
        assert all(r["unchecked_mismatches"] == [] for r in out)
