"""A planned save of a contiguous uint8 tensor whose first byte is 4-byte aligned but whose storage
starts one byte past an aligned address (storage offset 3): its int32 view is refused, so the window
takes no grid sums for it and the host hashes the chunk; the save succeeds and loads back equal."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.mp import run_world, values

N = 8 << 20  # bytes: one chunk at the window's grid size


def misaligned_storage(rank, world, root, device_checksums: bool) -> dict:
    import safe_ckpt
    from tests.helpers.bodies.zero_stall_overlap import _sharded

    buf = bytearray(N + 64)
    base = torch.frombuffer(buf, dtype=torch.uint8, offset=1)
    skip = (-base.data_ptr()) % 4
    t = base[skip:skip + N]
    t.copy_(torch.randint(0, 256, (N,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9)))
    path = os.path.join(root, "ck")
    opts = safe_ckpt.SaveOptions(chunk_bytes=N, io_threads=1, progress_interval_s=0, return_after="planned",
                                 device_checksums=device_checksums)
    out = {"storage_offset": t.storage_offset(), "data_ptr_mod4": t.data_ptr() % 4}
    try:
        safe_ckpt.async_save(_sharded({"b": t}), path, options=opts).wait(timeout=60.0)
        loaded = safe_ckpt.load(_sharded({"b": torch.empty(N, dtype=torch.uint8)}), path)
        out["error"], out["equal"] = None, torch.equal(loaded["b"], t)
    except Exception as exc:  # noqa: BLE001 - the defect
        out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device_checksums", [False, True])
def test_a_misaligned_storage_host_tensor_saves_on_a_cpu_only_run(tmp_path, device_checksums):
    if torch.cuda.is_available():
        pytest.skip("the simulated copy stream is the CPU-only path")
    (out,) = values(run_world(1, misaligned_storage, (str(tmp_path), device_checksums)))
    print(f"device_checksums={device_checksums}: {out}")
    assert out["error"] is None and out["equal"], out
