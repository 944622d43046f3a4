"""slime's writers of saved tensors outside an optimizer step wait for an overlapped save's copies
once `safe_ckpt.integrations.slime.install` ran: the weight switch (`TensorBackuper.restore`, slime
mirror) and torch_memory_saver's `pause` (stand-in)."""

from tests.helpers.mp import run_world, values


def test_a_weight_switch_right_after_an_overlapped_save_waits_and_the_checkpoint_holds_the_actor(tmp_path):
    from tests.helpers.bodies import zero_stall_overlap

    (out,) = values(run_world(1, zero_stall_overlap.slime_restore_waits_for_the_window, (str(tmp_path),)))
    assert out["restore_blocked"] and out["unchanged_while_held"], out
    assert out["restored"] and out["checkpoint_is_actor"], out
    assert out["pause_guarded"], out
