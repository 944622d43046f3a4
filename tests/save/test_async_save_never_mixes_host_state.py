"""`safe_ckpt.async_save` with host-resident optimizer state and the next step's fused CPU Adam
(`--optimizer-cpu-offload`) landing between two items' writes: the checkpoint must hold the
state as it was when the save began, or the save must fail; never a mix."""

from tests.helpers.mp import run_world, values


def test_a_fused_cpu_adam_step_between_item_writes_never_tears_the_checkpoint(tmp_path):
    """A fused AdamW step (what --optimizer-cpu-offload runs on the host) moves no version counter
    and the per-item recheck sees only changes during an item's write: the host gate makes the
    step wait until the host sources are written."""
    (out,) = values(run_world(1, _cases().fused_cpu_adam_step_between_item_writes, (str(tmp_path),)))
    assert out["step_errors"] == [], out
    assert out["versions"] == [0, 0]  # the fused step is invisible to version counters
    if "save_error" in out:  # failing the save is acceptable; publishing a mix is not
        assert "SourceModifiedError" in out["save_error"], out
        return
    assert out["live_changed"] and out["step_waited_for_the_save"], out
    assert out["chunks"] == {"w": ["pre-step"] * 4, "m": ["pre-step"] * 4}, (
        f"the save succeeded with a torn checkpoint (stock dist_checkpointing.load): {out['chunks']}")


def test_a_failed_write_releases_the_step_waiting_at_the_host_gate(tmp_path):
    (out,) = values(run_world(1, _cases().failed_write_releases_the_host_gate, (str(tmp_path),)))
    assert out["blocked"] and not out["stepped_before_failure"], out  # the step waited for the writes
    assert out["stepped_after_failure"], out  # and went on when the save failed, not at the gate's timeout
    assert out["save_error"] and "injected: the device went away" in out["save_error"], out
    assert not out["published"] and out["open_windows"] == 0, out


def test_a_step_held_past_the_timeout_abandons_the_save_with_a_timeout_error(tmp_path):
    (out,) = values(run_world(1, _cases().gate_timeout_abandons_the_save, (str(tmp_path),)))
    assert out["save_error"] and out["save_error"].startswith("StagingTimeoutError"), out  # not SourceModifiedError
    assert "host tensors are written from their own memory" in out["save_error"], out
    assert out["writes_after_release"] <= 1 and not out["published"], out  # the writers stopped


def _cases():
    from tests.helpers.bodies import zero_stall as zero_stall_cases

    return zero_stall_cases
