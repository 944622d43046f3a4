"""slime's asleep save on CPU, in ranks spawned by tests/helpers/mp.py over real gloo, each holding one
mirrored train actor (tests/slime_mirror, slime 624b824a): wake_up waits for the save in flight
(gated writes, no sleeps), and the save's group survives slime's destroy/reload cycles.
The Ray-driven cases are in tests/integrations/test_slime_through_ray_actors.py."""

import pytest

from safe_ckpt.integrations.slime_asleep import awake_reason
from tests.helpers.bodies import slime_asleep as cases
from tests.helpers.mp import run_world, values


def test_wake_up_waits_for_the_asleep_save_then_it_loads(tmp_path):
    for out in values(run_world(2, cases.wake_up_waits_for_the_asleep_save, (str(tmp_path),), timeout_s=300)):
        assert out["returned_before_writing"], out
        # while the writes are held: slime's wake_up not called, nothing committed, still asleep
        assert out["during"] == {"wake_up_calls": 0, "tracker": None, "thread_alive": True, "asleep": True}, out
        assert out["after"] == {"thread_alive": False, "wake_up_calls": 1, "asleep": False, "tracker": "9"}, out
        assert out["mismatches"] == [] and out["iteration"] == 9, out


def test_a_resume_from_outside_the_hooks_waits_for_the_asleep_save(tmp_path):
    for out in values(run_world(2, cases.resume_waits_for_the_asleep_save, (str(tmp_path),), timeout_s=300)):
        # held: the saver not resumed, nothing committed, the actor still asleep
        assert out["during"] == {"resumes": 0, "tracker": None, "thread_alive": True, "asleep": True}, out
        assert out["after"]["resumes"] == 1 and not out["after"]["thread_alive"], out
        assert out["after"]["asleep"] is False and out["after"]["tracker"] == "9", out
        # the next save_model wakes up and sleeps as slime does (sleep: once before the asleep save, once now)
        assert out["after"]["next"] == {"tracker": "10", "wake_up_calls": 1, "sleep_calls": 2}, out
        assert out["mismatches"] == [] and out["iteration"] == 10, out


def test_detached_group_survives_destroy_and_reload_cycles(tmp_path):
    for rank, out in enumerate(values(run_world(2, cases.detached_group_survives_the_cycles, (str(tmp_path),),
                                                timeout_s=300))):
        # awake; then per cycle: asleep, after update_weights' reload, woken up
        assert out["seen"] == [[0, 1], [0, 1], [0, 1], [0, 1], [10, 11], [0, 1], [0, 1]], out
        assert "not registered" in out["registered_after_sleep"], out  # what a registered group suffers


@pytest.mark.parametrize("changes, expected", [
    ({}, None),
    ({"offload_train": False}, "--offload-train is off"),
    ({"safe_ckpt_save_awake": True}, "--safe-ckpt-save-awake"),
    ({"save_hf": "/x/{rollout_id}"}, "--save-hf"),
    ({"overlap_param_gather": True}, "--overlap-param-gather"),
])
def test_awake_reason(tmp_path, changes, expected):
    args = cases.slime_args(str(tmp_path), extra=["--offload-train"])
    for name, value in changes.items():
        setattr(args, name, value)
    reason = awake_reason(args, asleep=True, role="actor")
    assert (reason is None) if expected is None else (expected in reason), reason
    assert "awake" in awake_reason(cases.slime_args(str(tmp_path), extra=["--offload-train"]), False, "actor")
    if "save_hf" in changes:  # a critic has no HF export: it saves asleep
        assert awake_reason(args, asleep=True, role="critic") is None


def test_pinned_ranks_answer_for_slimes_destroyed_wrappers(tmp_path):
    for rank, out in enumerate(values(run_world(2, cases.ranks_of_destroyed_wrappers, (str(tmp_path),),
                                                timeout_s=120))):
        assert "NoneType" in out["unpinned"], out  # what Megatron's rank queries meet while asleep
        assert out["pinned"] == {"single": (0, 1), "both": (rank, 2, rank), "ranks": [0, 1], "world": rank}, out
        assert out["awake"] == {"single": (0, 1), "both": (rank, 2, rank)}, out
        assert out["restored"], out


def test_save_model_returns_while_the_state_dict_is_still_being_built(tmp_path):
    for out in values(run_world(2, cases.save_model_returns_while_the_build_is_held, (str(tmp_path),),
                                timeout_s=300)):
        assert out["returned"] == {"build_held": True, "hold_s_bounded": True, "tracker": None}, out
        assert out["during"] == {"wake_up_calls": 0, "thread_alive": True}, out  # waits, slime's not called
        assert out["woke"] and out["wake_up_calls"] == 1 and out["tracker"] == "7", out
        assert out["rng_moved_meanwhile"] and out["rng_as_at_save_model"], out
        assert out["mismatches"] == [] and out["iteration"] == 7, out


@pytest.mark.parametrize("failing", [None, (1,)], ids=["every_rank", "one_rank"])
def test_a_failed_build_raises_at_wake_up_and_publishes_nothing(tmp_path, failing):
    outs = values(run_world(2, cases.failed_build_raises_at_wake_up, (str(tmp_path), failing), timeout_s=300))
    assert outs[0]["raised"] == outs[1]["raised"], outs  # the same error on every rank
    for out in outs:
        assert out["raised"] is not None and "iteration 5" in out["raised"], out
        assert "state dict construction broke on rank 1" in out["raised"], out
        # the group's timeout here is 30 s: a rank whose own build succeeded does not sit it out
        assert out["waited_s"] < 20, out
        assert out["after_failure"]["tracker"] is None, out
        assert not any("0000005" in e for e in out["after_failure"]["entries"]), out
        assert out["mismatches"] == [] and out["iteration"] == 6, out


def test_the_resume_guard_imports_nothing_wraps_once_and_replaces_an_earlier_install(monkeypatch):
    import sys
    import types

    from safe_ckpt.integrations.slime_resume_guard import guard_resume

    class Saves:
        def __init__(self):
            self.before = 0

        def before_resume(self):
            self.before += 1

    monkeypatch.delitem(sys.modules, "torch_memory_saver", raising=False)
    assert guard_resume(Saves()) is False and "torch_memory_saver" not in sys.modules  # never imported here
    resumed = []

    class Saver:  # the real singleton's class: resume(tag=None)
        def resume(self, tag=None):
            resumed.append(tag)
            return "resumed"

    module = types.ModuleType("torch_memory_saver")
    module.torch_memory_saver = saver = Saver()
    monkeypatch.setitem(sys.modules, "torch_memory_saver", module)
    first, second = Saves(), Saves()
    assert guard_resume(first) and guard_resume(first)  # the same install twice: one guard
    assert saver.resume("train") == "resumed" and first.before == 1 and resumed == ["train"]
    assert guard_resume(second)  # a later install replaces the earlier guard, not wraps it
    assert saver.resume() == "resumed" and (first.before, second.before) == (1, 1) and resumed == ["train", None]
    assert not hasattr(vars(Saver)["resume"], "_safe_ckpt_asleep")  # the class is left as it was:
    assert Saver().resume() == "resumed" and second.before == 1  # another instance is not guarded


def test_a_resume_that_finishes_waiting_last_does_not_forget_the_next_save(monkeypatch):
    """Two callers wait for the same asleep save: a guarded `resume()` in another thread and
    `save_model`'s hooked wake-up in the actor's thread. The wake-up sees the save done first
    and starts the next asleep save; the resume, returning from its wait afterwards, must not
    take that new save off the books and resume over its reads of the CPU backup."""
    import sys
    import threading
    import types

    from safe_ckpt.integrations.slime_asleep import AsleepSaves
    from safe_ckpt.integrations.slime_resume_guard import guard_resume

    class Handle:  # a save's handle: done once its writes are committed
        def __init__(self):
            self.finished = threading.Event()
            self.returns = threading.Event()  # when a wait() that is under way returns

        def done(self):
            return self.finished.is_set()

        def wait(self, timeout=None):
            if not self.returns.wait(timeout):
                raise TimeoutError

    seen = []

    class Saver:
        def resume(self, tag=None):
            seen.append(saves.inflight is second and second.done())

    module = types.ModuleType("torch_memory_saver")
    module.torch_memory_saver = saver = Saver()
    monkeypatch.setitem(sys.modules, "torch_memory_saver", module)
    saves = AsleepSaves(group=None)
    assert guard_resume(saves)
    first, second = Handle(), Handle()
    saves.inflight, saves.inflight_iteration = first, 9
    onload = threading.Thread(target=saver.resume, name="onload")
    onload.start()
    assert saves.waiting.wait(60), "resume did not wait for the asleep save"
    first.finished.set()  # save 9 committed: the actor's thread sees it first ...
    saves.finish_inflight("save_model")
    saves.inflight, saves.inflight_iteration = second, 10  # ... and starts save 10, as routing does
    first.returns.set()  # only now does the resume's wait return
    onload.join(5)
    alive = onload.is_alive()
    second.finished.set()
    second.returns.set()
    onload.join(60)
    # the resume must not run while save 10 still reads the backup, nor lose track of it
    assert alive or seen == [True], (alive, seen, saves.inflight)


def test_in_slimes_layout_the_asleep_save_equals_the_wake_up_paths(tmp_path):
    """The parameters' region keeps no backup (slime's patched DDP with --offload-train): the
    weights come from slime's TensorBackuper, and the checkpoint equals the wake-up path's."""
    outs = values(run_world(2, cases.asleep_save_equals_the_wake_up_path,
                            (str(tmp_path / "asleep"), str(tmp_path / "awake")), timeout_s=300))
    for out in outs:
        assert out["poisoned_while_asleep"], out  # what reading the parameters while asleep would give
        assert out["asleep"] == {"wake_up_calls": 1, "sleep_calls": 1}, out  # the asleep save woke nothing
        assert out["after_awake"] == {"wake_up_calls": 2}, out
        assert out["residences"] and out["residences"].get("host_copy", 0) > 0, out
        assert out["n_differ"] == 0, out
        assert any("TensorBackuper" in m for m in out["logged"]), out


@pytest.mark.parametrize("ranks_without_copies", [(0, 1), (1,)], ids=["every_rank", "one_rank"])
def test_a_tensor_without_readable_source_takes_slimes_wake_up_path(tmp_path, ranks_without_copies):
    outs = values(run_world(2, cases.no_readable_source_takes_the_wake_up_path,
                            (str(tmp_path), ranks_without_copies), timeout_s=300))
    for rank, out in enumerate(outs):
        assert (out["wake_up_calls"], out["sleep_calls"]) == (1, 2), out  # every rank woke up, or none could
        assert out["tracker"] == "4" and out["mismatches"] == [] and out["iteration"] == 4, out
        if rank in ranks_without_copies:
            assert out["warnings"] and "module.module." in out["warnings"][0], out
        else:
            assert out["warnings"] and f"rank {ranks_without_copies[0]}" in out["warnings"][0], out
