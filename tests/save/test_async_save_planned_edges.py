"""Edges of `async_save(..., SaveOptions(return_after="planned"))`: a copy window left for a trigger
that never comes, an interrupt at the window's opening, the integrity manifest with a small pool,
what a kept handle holds. Real ranks, stock `megatron.core.dist_checkpointing.load`."""

from tests.helpers.mp import run_world, values


def _bodies():
    from tests.helpers.bodies import zero_stall_overlap_edges

    return zero_stall_overlap_edges


def test_a_deferred_window_opens_when_its_handle_is_waited_for_or_the_next_save_starts(tmp_path):
    (out,) = values(run_world(1, _bodies().deferred_window_opened_by_whoever_waits, (str(tmp_path),)))
    assert out["wait"] and out["exception"] and out["done"] and out["wait_window_closed"], out
    assert out["second"] is None and out["both_saved"], out
