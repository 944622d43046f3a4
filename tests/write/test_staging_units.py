"""Staging without a device: strided host chunks written in place as runs, and the pool's wait
callback (called once, before a real wait, outside the pool's lock)."""

import torch


def test_strided_host_chunks_are_written_in_place_as_runs():
    from safe_ckpt.staging.pool import PinnedPool
    from safe_ckpt.staging.stager import Stager

    g = torch.Generator().manual_seed(4)
    fused = torch.randn(4, 2048, 64, generator=g)
    gate, up = torch.chunk(fused, 2, dim=1)  # 4 runs of 256 KiB each
    pool = PinnedPool(1 << 20, pinned=False)
    stager = Stager(pool)
    for half in (gate, up):
        staged = stager.stage(half)
        views = staged.ready()
        assert len(views) == 4
        assert b"".join(bytes(v) for v in views) == half.contiguous().numpy().tobytes()
        staged.release()
    assert pool.stats().allocations == 0  # no staging copy was needed
    # too fragmented (a transpose): copied through the pool instead
    t = torch.randn(300, 40, generator=g).t()
    staged = stager.stage(t)
    (view,) = staged.ready()
    assert bytes(view) == t.contiguous().numpy().tobytes()
    staged.release()
    assert pool.stats().allocations == 1


def test_pool_calls_on_wait_only_before_a_real_wait_and_outside_its_lock():
    import threading

    from safe_ckpt.staging.pool import PinnedPool

    pool = PinnedPool(64 * 1024, pinned=False)
    calls = []

    def on_wait():
        calls.append(pool._cond._is_owned())  # must be False: the callback may take other locks

    first = pool.lease(48 * 1024, on_wait=on_wait)
    assert calls == []  # room was there: no wait, no call
    threading.Timer(0.2, first.release).start()
    second = pool.lease(48 * 1024, timeout_s=10, on_wait=on_wait)
    assert calls == [False]  # called once, before waiting, without the pool's lock
    second.release()
