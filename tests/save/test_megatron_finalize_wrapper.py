"""`safe_ckpt.megatron.finalizing_too` makes Megatron's `maybe_finalize_async_save` finish
safe_ckpt's asynchronous saves too, before Megatron's own queue, with the same blocking flag."""

import safe_ckpt.megatron as sm
from safe_ckpt.megatron import training


def test_the_wrapped_finalize_finishes_safe_ckpt_saves_first_and_wrapping_twice_changes_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(training, "finalize_async_saves", lambda blocking=True: calls.append(("safe", blocking)))

    def stock(blocking=False, terminate=False):
        calls.append(("stock", blocking, terminate))
        return "stock result"

    wrapped = sm.finalizing_too(stock)
    assert sm.finalizing_too(wrapped) is wrapped
    assert wrapped(blocking=True, terminate=True) == "stock result"
    assert wrapped(False) == "stock result"
    assert calls == [("safe", True), ("stock", True, True), ("safe", False), ("stock", False, False)]


def test_a_failed_safe_ckpt_save_still_lets_megatron_finish_its_own_and_is_raised(monkeypatch):
    import pytest

    from safe_ckpt.errors import WriteError

    def failing(blocking=True):
        raise WriteError("the save failed")

    monkeypatch.setattr(training, "finalize_async_saves", failing)
    stock_calls = []
    wrapped = sm.finalizing_too(lambda blocking=False, terminate=False: stock_calls.append((blocking, terminate)))
    with pytest.raises(WriteError, match="the save failed"):
        wrapped(blocking=True, terminate=True)
    assert stock_calls == [(True, True)]
