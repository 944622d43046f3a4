"""`async_save` with `return_after="planned"`: the call returns right after planning, the copies run
while training goes on, the next optimizer step waits for what is still uncopied, and a write no
gate orders fails the save instead of tearing it. Real ranks, real fused AdamW steps, stock
`megatron.core.dist_checkpointing.load` to read the checkpoints back."""

import pytest

from tests.helpers.mp import run_world, values


def _cases():
    from tests.helpers.bodies import zero_stall_overlap

    return zero_stall_overlap


def test_a_fused_adamw_step_right_after_the_call_waits_and_the_checkpoint_is_the_pre_step_state(tmp_path):
    (out,) = values(run_world(1, _cases().step_right_after_the_call, (str(tmp_path), 1)))
    assert out["step_blocked"] and out["unchanged_while_held"], out  # the pool of one chunk held the copies
    assert out["step_errors"] == [], out
    assert out["checkpoint_is_pre_step"] == [True, True], out
    assert out["live_is_post_step"], out
    assert out["window"]["blocked_gates"] >= 1 and out["window"]["pending_bytes"] == 0, out


def test_with_a_pool_as_large_as_the_state_the_next_step_never_waits(tmp_path):
    (out,) = values(run_world(1, _cases().step_right_after_the_call, (str(tmp_path), 8)))
    assert out["window_closed_before_step"], out  # every copy landed while the first write was held
    assert not out["step_blocked"] and out["window"]["blocked_gates"] == 0, out
    assert out["step_errors"] == [] and out["checkpoint_is_pre_step"] == [True, True], out


def test_a_write_through_data_before_the_copies_fails_the_save_and_publishes_nothing(tmp_path):
    (out,) = values(run_world(1, _cases().uncovered_write_right_after_the_call, (str(tmp_path),)))
    assert out["error"] is not None and out["error"].startswith("SourceModifiedError"), out
    assert "'w'" in out["error"] and "rank 0" in out["error"], out["error"]
    assert not out["published"] and out["tracker"] == "1" and out["first_intact"] == [True, True], out
    assert out["open_windows"] == 0, out


@pytest.mark.parametrize("faulty_rank", [0, 1])
def test_a_write_fault_on_one_rank_fails_every_rank_and_releases_every_gate(tmp_path, faulty_rank):
    outs = values(run_world(2, _cases().write_fault_on_one_rank, (str(tmp_path), faulty_rank)))
    for rank, out in enumerate(outs):
        assert out["blocked"] and out["stepped"] and out["step_errors"] == [], (rank, out)
        assert out["error"] is not None and "injected: the device went away" in out["error"], (rank, out)
        assert f"rank {faulty_rank}" in out["error"], (rank, out["error"])
        assert not out["published"] and out["open_windows"] == 0, (rank, out)


def test_with_the_integrity_manifest_every_file_is_still_written_front_to_back(tmp_path):
    """The window copies small sources first; the manifest hashes each file in order."""
    (out,) = values(run_world(1, _cases().integrity_manifest_with_small_sources_first, (str(tmp_path),)))
    assert out["error"] is None, out["error"]
    assert out["digests_match"] and all(out["digests_match"].values()), out
    assert out["content_equal"], out


def test_before_update_waits_at_most_the_timeout_then_the_save_is_abandoned(tmp_path):
    (out,) = values(run_world(1, _cases().before_update_past_the_timeout, (str(tmp_path),)))
    assert out["blocked_gates"] == 1 and out["gate_s"] >= 0.9, out  # it waited, boundedly
    assert out["error"] is not None and out["error"].startswith("StagingTimeoutError"), out
    assert "staging_budget_bytes" in out["error"] and "SaveHandle.before_update()" in out["error"], out["error"]
    assert not out["published"] and out["window_closed"], out


def test_large_chunks_get_grid_sums_in_the_window_and_a_flipped_byte_is_caught(tmp_path):
    """Writers hashing payloads on the host hold the GIL the training thread needs while the window
    is open; the window sums large chunks on their copy stream instead, as the staged save does."""
    (out,) = values(run_world(1, _cases().big_chunks_get_grid_sums_in_the_window, (str(tmp_path),)))
    big = {fqn: a for fqn, a in out["algorithms"].items() if fqn.startswith("big")}
    assert big and all(a.startswith("grid32+") for a in big.values()), out["algorithms"]
    assert all(not a.startswith("grid32+") for fqn, a in out["algorithms"].items() if fqn.startswith("small")), out
    assert out["equal"] and out["stock_equal"] and out["verified"] == out["items"] > 0, out
    assert out["after_flip"] is not None and "checksum mismatch" in out["after_flip"], out["after_flip"]
