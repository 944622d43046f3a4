"""The lab's staging pool on transparent huge pages (`safe_ckpt_lab.diag.thp`, which
benchmarks/diag/diag_thp.py measures with): an advised private mapping that leases like any other."""

import os

import pytest
import torch


def _vm_flags(address: int) -> list[str]:
    from safe_ckpt_lab.bench.measure import mapping_of

    return mapping_of(address)["VmFlags"].split()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc/self/smaps")
def test_pool_on_huge_pages_is_an_advised_private_mapping_that_leases_like_any_other():
    """The lab's huge-page pool (benchmarks/diag/diag_thp.py measures with it)."""
    from safe_ckpt_lab.diag import thp

    plain = thp.host_buffer(8 << 20, huge_pages=False)
    assert "hg" not in _vm_flags(plain.data_ptr())
    with pytest.raises(ValueError, match="0x8"):
        _vm_flags(8)  # below any mapping
    pool = thp.pool(8 << 20, pinned=False)
    first, second = pool.lease(3 << 20), pool.lease(3 << 20)
    flags = _vm_flags(first.tensor.data_ptr())
    assert "hg" in flags and "sh" not in flags  # MADV_HUGEPAGE, private: anonymous THP, not shmem
    g = torch.Generator().manual_seed(11)
    a, b = (torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=g) for _ in range(2))
    first.tensor.copy_(a)
    second.tensor.copy_(b)
    assert torch.equal(first.tensor, a) and torch.equal(second.tensor, b)  # disjoint ranges
    first.release()
    second.release()
    pool.release()
    assert pool.stats().allocated_bytes == 0
