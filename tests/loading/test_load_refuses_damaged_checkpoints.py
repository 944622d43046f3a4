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


def test_a_save_root_passed_to_load_is_named_with_the_checkpoint_its_tracker_names(tmp_path):
    """`safe_ckpt.load` reads one checkpoint, as stock load does; given the save root above it, the
    error says so and names the directory to pass (not "a save that did not finish")."""
    import pytest
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor

    import safe_ckpt

    root = tmp_path / "run"
    (root / "iter_0000042").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("42")
    template = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4), replica_id=0)}
    with pytest.raises(safe_ckpt.ReadError, match=r"save root whose tracker names iter_0000042: load .*iter_0000042"):
        safe_ckpt.load(template, str(root))
    (root / "latest_checkpointed_iteration.txt").unlink()
    with pytest.raises(safe_ckpt.ReadError, match="holds checkpoints, not one: load one of iter_0000042"):
        safe_ckpt.load(template, str(root))
    (root / "iter_0000042").rmdir()
    with pytest.raises(safe_ckpt.ReadError, match="did not finish"):
        safe_ckpt.load(template, str(root))
