"""Save Megatron-shaped state at 1, 2 and 4 ranks; load it back with stock loaders only."""

import pytest

from safe_ckpt import compat
from tests.helpers.bodies import common as cases
from tests.helpers.mp import run_world, values


@pytest.mark.parametrize("world,tp,load_tp", [(1, 1, 1), (2, 2, 1), (2, 1, 2), (4, 2, 4), (4, 4, 2)])
def test_roundtrip_through_stock_megatron_and_dcp(tmp_path, world, tp, load_tp):
    ckpt = str(tmp_path / "iter_0000042")
    out = values(run_world(world, cases.roundtrip, (tp, load_tp, ckpt)))
    for rank, r in enumerate(out):
        assert r["mismatches"] == [], f"rank {rank}: {r['mismatches'][:10]}"
        assert r["tensors_checked"] > 10
    files = out[0]["files"]
    assert {".metadata", "metadata.json"} <= set(files)
    # the common state goes where the installed megatron-core puts it
    assert ("common.pt" in files) != compat.common_state_as_sharded_object()
    assert any(f.startswith(f"__{world - 1}_") and f.endswith(".distcp") for f in files)
    assert not [f for f in files if ".safe_ckpt-" in f]


def test_roundtrip_with_crc_and_single_thread(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    out = values(run_world(2, cases.roundtrip, (1, 2, ckpt, None, {"zip_crc32": True, "io_threads": 1})))
    assert all(r["mismatches"] == [] for r in out)


def test_data_parallel_reshard_saved_at_four_loaded_at_two(tmp_path):
    """The distributed optimizer's buckets saved by 4 data-parallel ranks load, bit for bit, with
    stock Megatron at 2 ranks (the resharded resume, on Megatron-shaped state)."""
    from tests.helpers.bodies import megatron as m

    ckpt = str(tmp_path / "iter_0000007")
    assert all(r["items"] > 0 for r in values(run_world(4, m.save_data_parallel, (ckpt,))))
    for world in (2,):
        for rank, r in enumerate(values(run_world(world, m.load_data_parallel, (ckpt,)))):
            assert r["mismatches"] == [], f"DP 4 -> {world}, rank {rank}: {r['mismatches'][:10]}"
            assert r["optimizer_entries"] > 0 and r["model_keys"] > 0, r  # something was compared
