"""`safe_ckpt.load` from object stores: a real S3 API (the local moto server) through TensorStore's
`s3` driver, and a `file://` kvstore URL; resharded at load, compared with stock load of the same
state; an unreachable store fails on every rank within the request deadline."""

import pytest

pytest.importorskip("tensorstore")

from tests.helpers.bodies import load as load_cases  # noqa: E402
from tests.helpers.mp import run_world, values  # noqa: E402
from tests.helpers.s3server import free_port, s3_server  # noqa: E402,F401,F811  (fixture)


def test_load_from_s3_and_kvstore_urls_equals_stock_load(s3_server, tmp_path):
    spec = s3_server.bucket("loads")
    dead = f"http://127.0.0.1:{free_port()}"
    out = values(run_world(2, load_cases.object_store, (spec, str(tmp_path), dead), timeout_s=400))
    for rank, r in enumerate(out):
        for name in ("safe_s3", "stock_s3", "stock_file_url"):
            assert r[name]["mismatches"] == [], (name, rank, r[name]["mismatches"][:5])
            assert r[name]["same_as_stock"] == [], (name, rank, r[name]["same_as_stock"][:5])
            assert r[name]["report"]["decoded"] == 0, (name, r[name]["report"])
        err = r["dead"]
        # a port nothing listens on is named as refused at once (a silent store: "did not answer")
        assert err is not None and "ReadError" in err["mro"] and "was refused" in err["message"], err
        assert r["dead_s"] < 60, r["dead_s"]
    assert out[0]["safe_s3"]["report"]["verified"] > 0  # the manifest travels with the save
    assert out[0]["dead"]["message"] == out[1]["dead"]["message"]
