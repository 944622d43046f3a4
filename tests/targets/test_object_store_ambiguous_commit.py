"""An object-store commit whose last write is ambiguous, and a checkpoint whose marker stands over
missing data, against a real S3 API (a local moto server) with two gloo ranks.

The final PUT of `metadata.json` reaches the store but the client reports a timeout: the save
must not delete the data objects of what is then a complete-looking checkpoint. It asks the store:
the marker is there, so the save succeeds; when the store cannot be asked either, the save fails
and keeps every data object; when the marker never landed, the failed save removes its data and
nothing counts the iteration. Readers (retention's `iterations`, `gc`) count a prefix complete
only when the data its index names is there, and `gc` removes one whose data is gone.
"""

from __future__ import annotations

import pytest

pytest.importorskip("tensorstore")

from tests.helpers.bodies import s3 as s3_cases  # noqa: E402
from tests.helpers.mp import run_world, values  # noqa: E402
from tests.helpers.s3server import s3_server  # noqa: E402,F401  (fixture)


def _names(s3_server, iteration: int) -> list[str]:
    return [k.rsplit("/", 1)[1] for k in s3_server.keys("amb", f"run/iter_{iteration:07d}/")]


def _loads_bit_exact(spec, iteration: int, tmp_path) -> bool:
    from safe_ckpt_lab.synthetic import StateSpec, bits_equal, reference_tensors
    from safe_ckpt.tools.copy import copy
    from tests.helpers.bodies.common import load_whole_with_dcp

    local = str(tmp_path / f"local{iteration}")
    copy(f"run/iter_{iteration:07d}", local, src_spec=spec)
    whole = load_whole_with_dcp(local)
    refs = reference_tensors(StateSpec(**s3_cases.seeded(iteration)), 1)
    return set(whole) == set(refs) and all(bits_equal(whole[k], refs[k]) for k in refs)


def test_an_ambiguous_last_write_never_leaves_a_complete_looking_checkpoint_without_data(s3_server, tmp_path):
    from safe_ckpt import names
    from safe_ckpt.sinks.tensorstore import KvTarget
    from safe_ckpt.tools import kvtools
    from safe_ckpt.targets.objectstore import gc as kv_gc, root as kv_root

    spec = s3_server.bucket("amb")
    out = values(run_world(2, s3_cases.s3_ambiguous_commits, (spec,), timeout_s=300))
    assert out[0][1] is None and out[1][1] is None, out
    # landed: the store has the marker, so the checkpoint is committed and the save succeeds
    assert out[0][2] is None and out[1][2] is None, (out[0][2], out[1][2])
    # unknown: the save fails on every rank, saying so, and keeps the data
    errors = [r[3] for r in out]
    assert all(e is not None and "CommitError" in e["mro"] for e in errors)
    assert errors[0]["message"] == errors[1]["message"]
    assert "cannot be asked whether it landed" in errors[0]["message"]
    # lost: the save fails, and its data is removed
    assert all(r[4] is not None for r in out)

    assert kv_root.iterations(KvTarget("run", spec)) == {1: "iter_0000001", 2: "iter_0000002", 3: "iter_0000003"}
    for iteration in (2, 3):
        assert any(n.endswith(".distcp") for n in _names(s3_server, iteration))
        report = kvtools.verify(KvTarget(f"run/iter_{iteration:07d}", spec))
        assert report.ok, (iteration, report.findings)
        assert not [n for n in _names(s3_server, iteration) if n.startswith(names.OWNER_OBJECT_PREFIX)]
        assert _loads_bit_exact(spec, iteration, tmp_path)
    assert _names(s3_server, 4) == []  # the failed commit's data and small files are gone
    tracker = s3_server.client().get_object(Bucket="amb", Key="run/latest_checkpointed_iteration.txt")["Body"].read()
    assert tracker == b"2"  # the tracker names the last save that succeeded
    assert kv_gc.collect(KvTarget("run", spec)) == []


def test_a_marker_over_missing_data_is_not_counted_and_gc_removes_it(s3_server, tmp_path):
    from safe_ckpt.sinks.tensorstore import KvTarget
    from safe_ckpt.tools import kvtools
    from safe_ckpt.targets.objectstore import gc as kv_gc, root as kv_root

    spec = s3_server.bucket("amb")
    for iteration in (1, 2):
        s3_cases.s3_save(0, 1, spec, f"run/iter_{iteration:07d}", s3_cases.seeded(iteration))
    # what an abort that trusted a timeout used to leave: the marker and index, a data object gone
    victim = next(n for n in _names(s3_server, 2) if n.endswith(".distcp"))
    s3_server.client().delete_object(Bucket="amb", Key=f"run/iter_0000002/{victim}")
    assert kv_root.iterations(KvTarget("run", spec)) == {1: "iter_0000001"}
    assert not kvtools.verify(KvTarget("run/iter_0000002", spec)).ok
    left = _names(s3_server, 2)
    assert kv_gc.collect(KvTarget("run", spec)) == sorted(f"iter_0000002/{n}" for n in left)
    assert _names(s3_server, 2) == [] and kvtools.verify(KvTarget("run/iter_0000001", spec)).ok
    assert _loads_bit_exact(spec, 1, tmp_path)
