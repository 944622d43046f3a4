"""A planned save with a pool of exactly the rank's saved bytes (what zero stall needs, as the docs
say): every chunk fits at once, so the window closes before any write, also where large chunks
would carry device grid sums (those then stay off: the host hashes them)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from tests.helpers.mp import run_world, values

N = 2 << 20  # fp32 elements: 8 MiB per tensor, one chunk each


def pool_of_the_saved_bytes(rank, world, root, device_checksums: bool) -> dict:
    import safe_ckpt
    from tests.helpers.bodies.zero_stall_overlap import _held_first_write, _sharded

    g = torch.Generator().manual_seed(7 + rank)
    tensors = {"w": torch.randn(N, generator=g), "m": torch.randn(N, generator=g)}
    release = threading.Event()
    saved_bytes = sum(t.numel() * 4 for t in tensors.values())
    opts = safe_ckpt.SaveOptions(chunk_bytes=N * 4, io_threads=1, progress_interval_s=0,
                                 staging_budget_bytes=saved_bytes, return_after="planned",
                                 device_checksums=device_checksums,
                                 sink_factory=lambda d: _held_first_write(release)(d), collective_timeout_s=60.0)
    handle = safe_ckpt.async_save(_sharded(tensors), os.path.join(root, "ck"), options=opts)
    closed = handle.wait_window_closed(20.0)  # the first write is held: only the pool decides
    release.set()
    handle.wait(timeout=60.0)
    return {"closed_while_first_write_held": closed, "saved_bytes": saved_bytes}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device_checksums", [False, True])
def test_a_pool_of_the_saved_bytes_lets_the_window_close_before_any_write(tmp_path, device_checksums):
    (out,) = values(run_world(1, pool_of_the_saved_bytes, (str(tmp_path), device_checksums)))
    print(f"device_checksums={device_checksums}: {out}")
    assert out["closed_while_first_write_held"], out
