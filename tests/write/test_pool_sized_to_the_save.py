"""The default staging budget is a ceiling: a tiny save gets a pool of what it stages (pinned
memory nobody uses is never allocated), an explicit budget is the pool's exact size, a pool big
enough for the next save is kept, and the log line says which of these it allocated."""

import logging

import torch

import safe_ckpt
from safe_ckpt.staging import pool as pool_mod
from safe_ckpt.units import human_bytes

MiB = 1 << 20


def _st(key, data):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    shape = tuple(data.shape)
    return ShardedTensor(key, data, data.dtype, shape, shape, (0,) * len(shape), axis_fragmentations=None)


def _opts(**kw):
    return safe_ckpt.SaveOptions(io_threads=1, progress_interval_s=0, **kw)


def test_a_tiny_async_save_gets_a_pool_of_what_it_stages_not_the_whole_budget(tmp_path, caplog):
    pool_mod.release()
    g = torch.Generator().manual_seed(11)
    tiny = torch.randn(2, 2, generator=g).t()  # 16 bytes; a transpose is copied through the pool
    try:
        with caplog.at_level(logging.INFO, logger="safe_ckpt"):
            result = safe_ckpt.async_save({"x": _st("x", tiny)}, str(tmp_path / "tiny"), options=_opts()).wait()
        budget = result.extra["staging_budget_bytes"]
        pool = pool_mod._shared["pool"]
        assert budget >= 64 * MiB  # the default budget (at least chunk_bytes) stays what it was
        assert pool.capacity_bytes == MiB and pool.budget_bytes == budget
        assert pool.stats().allocations == 1
        (allocated,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("allocated ")]
        assert allocated.startswith(f"allocated host staging pool of 1.0 MiB (what the save stages, within the "
                                    f"staging budget of {human_bytes(budget)}) in "), allocated

        # an explicit budget is the pool's size, as documented
        safe_ckpt.save({"x": _st("x", tiny)}, str(tmp_path / "given"), options=_opts(staging_budget_bytes=8 * MiB, chunk_bytes=4 * MiB))
        assert pool_mod._shared["pool"].capacity_bytes == 8 * MiB
    finally:
        pool_mod.release()


def test_a_pool_big_enough_is_kept_and_one_too_small_grows_within_the_budget():
    pool_mod.release()
    try:
        assert pool_mod.shared_capacity(64 * MiB, 16) == MiB
        assert pool_mod.shared_capacity(64 * MiB, 3 * MiB + 1) == 4 * MiB
        assert pool_mod.shared_capacity(64 * MiB, 1 << 40) == 64 * MiB
        assert pool_mod.shared_capacity(64 * MiB, None) == 64 * MiB
        first = pool_mod.shared_pool(64 * MiB, 3 * MiB)
        assert first.capacity_bytes == 3 * MiB
        assert pool_mod.shared_pool(64 * MiB, 100) is first  # smaller saves reuse it
        grown = pool_mod.shared_pool(64 * MiB, 5 * MiB)
        assert grown is not first and grown.capacity_bytes == 5 * MiB
        assert pool_mod.shared_pool(4 * MiB, MiB) is not grown  # a lower budget replaces it
        assert pool_mod.shared_pool(64 * MiB).capacity_bytes == 64 * MiB  # no need given: the whole budget
    finally:
        pool_mod.release()


def test_a_pool_replaced_while_leased_stays_with_the_save_using_it():
    """A load's exact budget replaces a smaller pool a running save still holds leases of: the
    save keeps its memory, untouched, and the process's pool is the new one."""
    pool_mod.release()
    try:
        small = pool_mod.shared_pool(64 * MiB, MiB)
        lease = small.lease(8192)
        data = torch.randint(0, 256, (8192,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
        lease.tensor.copy_(data)
        whole = pool_mod.shared_pool(64 * MiB)
        assert whole is not small and whole.capacity_bytes == 64 * MiB and pool_mod._shared["pool"] is whole
        assert torch.equal(lease.tensor, data)  # still the save's, still intact
        lease.release()
        assert small.stats().leased_bytes == 0
    finally:
        pool_mod.release()
