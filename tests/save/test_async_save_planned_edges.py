"""Edges of `async_save(..., SaveOptions(return_after="planned"))`: a copy window left for a trigger
that never comes, an interrupt at the window's opening, the integrity manifest with a small pool,
what a kept handle holds. Real ranks, stock `megatron.core.dist_checkpointing.load`."""

import pytest

from tests.helpers.mp import run_world, values


def _bodies():
    from tests.helpers.bodies import zero_stall_overlap_edges

    return zero_stall_overlap_edges


def test_a_deferred_window_opens_when_its_handle_is_waited_for_or_the_next_save_starts(tmp_path):
    (out,) = values(run_world(1, _bodies().deferred_window_opened_by_whoever_waits, (str(tmp_path),)))
    assert out["wait"] and out["exception"] and out["done"] and out["wait_window_closed"], out
    assert out["second"] is None and out["both_saved"], out




@pytest.mark.parametrize("copy_start", ["now", "deferred"])
def test_an_interrupt_while_the_window_opens_is_raised_by_the_call_that_opened_it(tmp_path, copy_start):
    (out,) = values(run_world(1, _bodies().interrupt_at_the_opening, (str(tmp_path), copy_start)))
    assert out["raised_by"] == "the opening call", out
    assert out["handle_error"] in (None, "KeyboardInterrupt"), out
    assert not out["published"] and out["open_windows"] == 0 and out["next_saved"], out


def test_with_the_integrity_manifest_and_a_pool_smaller_than_the_state_the_save_returns_once_staged(tmp_path):
    (out,) = values(run_world(1, _bodies().integrity_manifest_with_a_small_pool, (str(tmp_path),)))
    assert out["error"] is None, out["error"]
    assert len(out["why"]) == 1 and "staging_budget_bytes" in out["why"][0], out
    assert out["digests_match"] and out["content_equal"], out


def test_a_kept_handle_holds_no_saved_tensor_once_its_window_settled(tmp_path):
    (out,) = values(run_world(1, _bodies().kept_handle_holds_no_source, (str(tmp_path),)))
    for mode, kept in out.items():
        assert not kept["source_alive"] and kept["sources_left"] == 0 and not kept["sums"], (mode, out)
        assert kept["stats_bytes"] == 4 * (1 << 19), (mode, out)


def test_a_synchronous_save_given_return_after_planned_says_it_applies_to_async_saves_only(tmp_path):
    (out,) = values(run_world(1, _bodies().sync_save_asked_to_return_after_planning, (str(tmp_path),)))
    assert len(out["lines"]) == 1 and "asynchronous saves only" in out["lines"][0], out
    assert out["saved"], out
