"""GPU: `integrity.json` over GPU-resident state whose large chunks the GPU checksums (the host then
hashes those bytes for the SHA-256 only), with and without checksum threads, sync and async: byte for
byte Megatron's, and accepted by stock `load(..., verify_integrity=True)` where megatron-core has it."""

import pytest

from tests.helpers.mp import run_world, values

pytestmark = pytest.mark.gpu

MODES = {"sync_fused": dict(checksum_threads=0), "sync_threads": dict(checksum_threads=4),
         "async_threads": dict(checksum_threads=4)}


def gpu_integrity(rank, world, root) -> dict:
    import os

    import torch

    import safe_ckpt
    from safe_ckpt import compat
    from safe_ckpt.integrity import GRID_PREFIX, Manifest
    from safe_ckpt.names import MANIFEST_FILE
    from safe_ckpt_lab.synthetic import StateSpec, build_state, reference_tensors
    from tests.helpers.bodies.common import small_options
    from tests.helpers.bodies.gpu import GPU_SPEC
    from tests.helpers.bodies.megatron import _stock_verified_load, megatron_integrity_json

    torch.cuda.set_device(0)
    spec = StateSpec(**dict(GPU_SPEC, hidden=1031, ffn=4124, vocab=8200, bucket_numel=3_000_001))
    refs = reference_tensors(spec, world)
    out = {}
    for mode, kw in MODES.items():
        path = os.path.join(root, mode)
        state = build_state(rank, world, tp=world, spec=spec, device="cuda", references=refs)
        opts = small_options(chunk_bytes=12 << 20, staging_budget_bytes=128 << 20, device_checksums=True,
                             integrity_manifest=True, **kw)
        if mode.startswith("async"):
            safe_ckpt.async_save(state, path, options=opts).wait()
        else:
            safe_ckpt.save(state, path, options=opts)
        torch.distributed.barrier()
        with open(os.path.join(path, "integrity.json"), "rb") as f:
            written = f.read()
        with open(os.path.join(path, MANIFEST_FILE), "rb") as f:
            items = Manifest.parse(f.read()).items
        r = {"same": written == megatron_integrity_json(path),
             "grid_items": sum(1 for i in items if i.algorithm.startswith(GRID_PREFIX))}
        if compat.stock_integrity_manifest():
            r["load"] = _stock_verified_load(rank, world, spec, refs, path)
        out[mode] = r
    return out


def test_integrity_json_over_device_checksummed_state(tmp_path):
    (r,) = values(run_world(1, gpu_integrity, (str(tmp_path),)))
    for mode, m in r.items():
        assert m["same"], mode
        assert m["grid_items"] > 0, (mode, m)  # the device-summed path was taken
        if "load" in m:
            assert m["load"] == {"mismatches": []}, (mode, m["load"])
