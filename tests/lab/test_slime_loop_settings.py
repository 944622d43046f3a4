"""The slime-loop bench's one-setting-changed saves: each setting is in force during its save and
the library is as before afterwards, also when the save fails (a later round would otherwise
measure a changed library without saying so)."""

import os
import sys
import types

import pytest

from tests.helpers.paths import BENCHMARKS

sys.path.insert(0, BENCHMARKS)

from diag.backup_writes import tweaked_asleep_saves  # noqa: E402

from safe_ckpt.write import item_writes, pipeline  # noqa: E402
from safe_ckpt.megatron import training  # noqa: E402


def library_state(args):
    return (pipeline.RECHECKED_RESIDENCES, item_writes.FUSED_PIECE_BYTES,
            training.options_from_args(args).checksums, getattr(args, "safe_ckpt_io_threads", None),
            getattr(args, "safe_ckpt_writer_nice", None))


def test_each_setting_holds_during_its_save_only(tmp_path):
    args = types.SimpleNamespace()
    before = library_state(args)
    during = []

    def save():
        during.append(library_state(args))
        return {"durable_s": 1.0, "timings": {"plan_s": 0.1, "write_s": 0.8}}

    rows = tweaked_asleep_saves(["default", "nosum", "piece512k", "no_recheck", "threads16", "nice0"], args, save,
                                str(tmp_path / "gone"))
    assert [r["tweak"] for r in rows] == ["default", "nosum", "piece512k", "no_recheck", "threads16", "nice0"]
    assert during[0] == before
    assert during[1][2] is False
    assert during[2][1] == 512 << 10
    assert "offload_backup" not in during[3][0] and "offload_backup" in before[0]
    assert during[4][3] == 16 and during[5][4] == 0
    assert library_state(args) == before


def test_a_failed_save_leaves_the_library_as_it_was(tmp_path):
    args = types.SimpleNamespace()
    before = library_state(args)

    def save():
        raise RuntimeError("save failed")

    with pytest.raises(RuntimeError):
        tweaked_asleep_saves(["piece256k"], args, save, str(tmp_path / "gone"))
    with pytest.raises(RuntimeError):
        tweaked_asleep_saves(["nosum"], args, save, str(tmp_path / "gone"))
    assert library_state(args) == before


def test_the_ceiling_loop_writes_every_byte_of_every_buffer(tmp_path):
    from diag.backup_writes import write_views_seconds
    import numpy as np

    seen = {}
    real_pwrite = os.pwrite

    def counting_pwrite(fd, data, offset):
        n = real_pwrite(fd, data, offset)
        seen[fd] = seen.get(fd, 0) + n
        return n

    views = [np.arange(n, dtype=np.uint8) for n in (1000, 3 << 20, 7)]
    os.pwrite = counting_pwrite
    try:
        assert write_views_seconds(str(tmp_path), views, 3, piece_bytes=1 << 20) > 0
    finally:
        os.pwrite = real_pwrite
    assert sum(seen.values()) == sum(v.nbytes for v in views)
    assert not os.path.exists(tmp_path / ".backup_writes")


def test_unknown_setting_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown tweak"):
        tweaked_asleep_saves(["fast"], types.SimpleNamespace(), lambda: {}, str(tmp_path))


def test_bad_names_are_refused_before_any_save(tmp_path):
    args = types.SimpleNamespace()
    before = library_state(args)
    saves = []
    for names in (["default", "no_recheck+pieceabck"], ["default", "piece0k"], ["ceil_backup", "trace"]):
        with pytest.raises(SystemExit):
            tweaked_asleep_saves(names, args, lambda: saves.append(1), str(tmp_path))
    assert saves == [] and library_state(args) == before
