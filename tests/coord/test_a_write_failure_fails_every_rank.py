"""A sink failing on one rank fails every rank, names that rank, and keeps the previous checkpoint."""

import errno

import pytest

from tests.helpers.bodies import common as cases
from tests.helpers.mp import run_world, values


@pytest.mark.parametrize("world,fail_rank,fault", [
    (2, 1, {"after_bytes": 20_000, "errno": errno.ENOSPC}),
    (2, 0, {"on": "sync", "errno": errno.EIO}),
    (4, 2, {"on": "open", "errno": errno.EACCES}),
    (2, 0, {"on": "write_file", "errno": errno.EIO}),
])
def test_injected_write_failure(tmp_path, world, fail_rank, fault):
    out = values(run_world(world, cases.failing_write, (str(tmp_path), fail_rank, fault)))
    messages = {r["error"]["message"] for r in out if r["error"]}
    for rank, r in enumerate(out):
        assert r["error"] is not None, f"rank {rank} did not fail"
        assert "CheckpointError" in r["error"]["mro"]
        assert r["error"]["failing_ranks"] == [fail_rank], r["error"]["message"]
        assert f"rank {fail_rank}" in r["error"]["message"]
        assert r["previous_intact"], "the previous checkpoint changed"
        assert r["mismatches"] == [], r["mismatches"][:5]
        assert r["leftovers"] == [], r["leftovers"]
    assert len(messages) == 1
