"""`safe_ckpt.load` against stock `dist_checkpointing.load` on CPU, over real gloo ranks (1, 2 and 4):
checkpoints written by safe_ckpt and by stock Megatron's own writer path, loaded at other TP and
DP layouts, strict modes, and templates stock also fills (non-contiguous, other dtype, none,
padded). Each world runs several cases: starting ranks is what takes the time."""

import os

from tests.helpers.bodies import load as load_cases
from tests.helpers.mp import run_world, values


def _check_reshard(name, out, writer, same_tp):
    for rank, r in enumerate(out):
        r = r[name]
        assert r["stock_mismatches"] == [], r["stock_mismatches"][:5]  # the reference itself
        assert r["mismatches"] == [], (name, rank, r["mismatches"][:5])
        assert r["same_as_stock"] == [], (name, rank, r["same_as_stock"][:5])
        assert r["pinned"] and r["device"], name
        report = r["report"]
        assert report["items"] > 0 and report["decoded"] == 0, (name, report)  # stock archives: the fast path too
        if writer == "safe" and same_tp:
            assert report["verified"] > 0, (name, report)
        if writer == "stock":
            assert report["verified"] == 0, (name, report)  # no manifest: nothing to check against


def _check_dp(name, out):
    for rank, r in enumerate(out):
        assert r[name]["mismatches"] == [], (name, rank, r[name]["mismatches"][:5])
        assert r[name]["same_as_stock"] == [], (name, rank, r[name]["same_as_stock"][:5])


def test_one_rank_loads_what_stock_loads(tmp_path):
    cases = [("safe", "reshard", ("safe", 1, 1, "pageable")), ("stock", "reshard", ("stock", 1, 1, "pageable")),
             ("odd", "odd_templates", ("safe",))]
    out = values(run_world(1, load_cases.suite, (str(tmp_path), cases)))
    _check_reshard("safe", out, "safe", True)
    _check_reshard("stock", out, "stock", True)
    assert out[0]["odd"] == {"mismatches": [], "stock_mismatches": [], "same_as_stock": []}, out[0]["odd"]


def test_two_and_four_ranks_reshard_like_stock_and_keep_its_strict_modes(tmp_path):
    root = str(tmp_path)
    cases = [("safe_tp2_to_1", "reshard", ("safe", 2, 1, "pageable")),
             ("stock_tp1_to_2", "reshard", ("stock", 1, 2, "pageable")),
             ("safe_pinned", "reshard", ("safe", 2, 2, "pinned")),
             ("safe_via_pool", "reshard", ("safe", 2, 1, "pool")),
             ("stock_via_pool", "reshard", ("stock", 1, 1, "pool")),
             ("odd", "odd_templates", ("stock",)),
             ("strict", "strictness", ()),
             ("strategy", "via_strategy", ("stock",)),
             ("dp2_safe", "save_dp", ("safe",)), ("dp2_stock", "save_dp", ("stock",))]
    out = values(run_world(2, load_cases.suite, (root, cases)))
    _check_reshard("safe_tp2_to_1", out, "safe", False)
    _check_reshard("stock_tp1_to_2", out, "stock", False)
    if "safe_pinned" in out[0]:
        _check_reshard("safe_pinned", out, "safe", True)
    _check_reshard("safe_via_pool", out, "safe", False)
    _check_reshard("stock_via_pool", out, "stock", True)
    for r in out:
        assert r["strategy"] == {"mismatches": [], "reports": 1, "metadata_keys_equal": True}, r["strategy"]
        assert r["odd"] == {"mismatches": [], "stock_mismatches": [], "same_as_stock": []}, r["odd"]
        strict = r["strict"]
        for mode in ("return_all", "return_unexpected"):
            assert strict[mode]["ours"] == strict[mode]["stock"] and strict[mode]["same_as_stock"] == [], strict[mode]
        assert strict["return_all"]["ours"][0] and strict["return_all"]["ours"][1]  # both kinds of mismatch
        assert strict["ignore_all"] == []
        err = strict["raise_all"]
        assert err is not None and "ValidationError" in err["mro"] and "extra" in err["message"], err
        assert strict["assume_ok_unexpected"] is not None  # the missing key is still missing
    assert out[0]["strict"]["raise_all"]["message"] == out[1]["strict"]["raise_all"]["message"]

    # four ranks: other TP layouts, and the data-parallel sharded optimizer from 2 ranks to 4 and back
    cases = [("safe_tp2_to_4", "reshard", ("safe", 2, 4, "pageable")),
             ("stock_tp4_to_2", "reshard", ("stock", 4, 2, "pageable")),
             ("dp4_safe", "save_dp", ("safe",)), ("dp4_stock", "save_dp", ("stock",)),
             ("dp2_to_4_safe", "load_dp", (os.path.join(root, "dp2_safe"),)),
             ("dp2_to_4_stock", "load_dp", (os.path.join(root, "dp2_stock"),))]
    out = values(run_world(4, load_cases.suite, (root, cases)))
    _check_reshard("safe_tp2_to_4", out, "safe", False)
    _check_reshard("stock_tp4_to_2", out, "stock", False)
    _check_dp("dp2_to_4_safe", out)
    _check_dp("dp2_to_4_stock", out)
    cases = [("dp4_to_2_safe", "load_dp", (os.path.join(root, "dp4_safe"),)),
             ("dp4_to_2_stock", "load_dp", (os.path.join(root, "dp4_stock"),))]
    out = values(run_world(2, load_cases.suite, (root, cases)))
    _check_dp("dp4_to_2_safe", out)
    _check_dp("dp4_to_2_stock", out)
