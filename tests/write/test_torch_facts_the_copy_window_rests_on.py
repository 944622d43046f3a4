"""The torch behaviours the copy window's gates and checks rest on. A torch upgrade that changes
one of them fails here, naming the assumption (see safe_ckpt/staging/window.py and gates.py)."""

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook


def _adamw(**kw):
    g = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.randn(4096, generator=g))
    w.grad = torch.randn(4096, generator=g)
    opt = torch.optim.AdamW([w], lr=0.1, **kw)
    opt.step()
    w.grad = torch.randn(4096, generator=g)
    return w, opt


def test_fused_adamw_changes_its_tensors_without_moving_a_version_counter():
    """Why the window cannot rely on version counters: `--optimizer-cpu-offload`'s CPU Adam is
    `torch.optim.AdamW(fused=True)`, which rewrites param and state in place, counters untouched."""
    w, opt = _adamw(fused=True)
    state = opt.state[w]
    before = [t.detach().clone() for t in (w, state["exp_avg"], state["exp_avg_sq"])]
    versions = [t._version for t in (w, state["exp_avg"], state["exp_avg_sq"])]
    opt.step()
    after = [t.detach() for t in (w, state["exp_avg"], state["exp_avg_sq"])]
    assert all(not torch.equal(a, b) for a, b in zip(before, after))
    assert [t._version for t in (w, state["exp_avg"], state["exp_avg_sq"])] == versions


def test_foreach_adamw_moves_the_version_counters():
    w, opt = _adamw(foreach=True)
    v = w._version
    opt.step()
    assert w._version > v


def test_writes_through_data_move_no_counter_and_views_share_the_base_counter():
    base = torch.randn(100)
    view = base[10:20]
    base[0:5].add_(1)
    assert view._version == base._version == 1  # a write anywhere in a buffer moves every view's counter
    p = torch.nn.Parameter(torch.randn(10))
    p.data = base[20:30]  # as Megatron's param buffer does
    before = p._version
    base[20:30].add_(1)
    assert p._version == before  # the Parameter has its own counter
    v = base._version
    base[40:50].data.copy_(torch.ones(10))
    assert base._version == v  # `.data` writes are invisible to counters


def test_the_global_step_pre_hook_fires_for_outer_then_inner_optimizers():
    """Megatron's HybridDeviceOptimizer is a torch Optimizer whose step steps inner CPU AdamWs:
    the global pre-hook fires before each, the outer first (so the first firing can gate all)."""

    class Hybrid(torch.optim.Optimizer):
        def __init__(self, params):
            params = list(params)
            super().__init__(params, defaults={})
            self.inner = [torch.optim.AdamW([p], fused=True) for p in params]

        def step(self, closure=None):
            for o in self.inner:
                o.step()

    seen = []
    handle = register_optimizer_step_pre_hook(lambda o, a, k: seen.append(type(o).__name__))
    try:
        ps = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]
        for p in ps:
            p.grad = torch.randn(4)
        Hybrid(ps).step()
    finally:
        handle.remove()
    assert seen == ["Hybrid", "AdamW", "AdamW"]


def test_removing_a_global_pre_hook_during_a_step_breaks_the_step():
    """Why the gates' hook is never removed."""
    handles = {}

    def first(o, a, k):
        handles["first"].remove()

    handles["first"] = register_optimizer_step_pre_hook(first)
    handles["second"] = register_optimizer_step_pre_hook(lambda o, a, k: None)
    w = torch.nn.Parameter(torch.randn(10))
    w.grad = torch.randn(10)
    try:
        with pytest.raises(RuntimeError, match="mutated during iteration"):
            torch.optim.AdamW([w]).step()
    finally:
        handles["second"].remove()
