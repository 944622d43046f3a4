"""Saves, tools and failures against a real S3 API: a local moto server through TensorStore's `s3` driver.

Round trip at 2 ranks loaded by stock Megatron and DCP; `copy` both ways and verify / inspect /
gc on the command line with an endpoint; an unreachable store and a server killed once the first
data object landed (every rank raises the same error within the deadline, nothing published, the
process still saves); what a killed save leaves behind; tracker and retention on a bucket prefix.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("tensorstore")

import safe_ckpt  # noqa: E402
from safe_ckpt import names  # noqa: E402
from tests.helpers.bodies import s3 as s3_cases  # noqa: E402
from tests.helpers.mp import run_world, values  # noqa: E402
from tests.helpers.s3server import free_port, s3_server  # noqa: E402,F401  (fixture)


def _cli(*argv, env=None):
    proc = subprocess.run([sys.executable, "-m", "safe_ckpt", *argv], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)
    return proc


def _dcp_whole(local_dir):
    from tests.helpers.bodies.common import load_whole_with_dcp

    return load_whole_with_dcp(local_dir)


def _assert_bits(whole, refs):
    from safe_ckpt_lab.synthetic import bits_equal

    assert set(whole) == set(refs)
    bad = [k for k in refs if not bits_equal(whole[k], refs[k])]
    assert not bad, bad


def test_round_trip_two_ranks_loads_with_stock_megatron_and_dcp(s3_server, tmp_path):
    spec = s3_server.bucket("ckpts")
    out = values(run_world(2, s3_cases.s3_roundtrip, (spec, "run1/iter_0000007", str(tmp_path / "local"))))
    for r in out:
        assert r["mismatches"] == [], r["mismatches"][:5]
    keys = s3_server.keys("ckpts", "run1/iter_0000007/")
    assert "run1/iter_0000007/metadata.json" in keys and "run1/iter_0000007/.metadata" in keys
    assert sorted(k.rsplit("/", 1)[1] for k in keys) == out[0]["files"]
    print(f"\n2-rank save to the local S3 server: {out[0]['total_file_bytes']} bytes in "
          f"{max(r['save_s'] for r in out):.2f} s")

    from safe_ckpt.sinks.tensorstore import KvTarget
    from safe_ckpt.tools import kvtools

    report = kvtools.verify(KvTarget("run1/iter_0000007", spec), deep=True)
    assert report.ok, report.findings
    assert report.checksummed_items == report.items_checked > 0
    info = kvtools.inspect(KvTarget("run1/iter_0000007", spec))
    assert sum(info["bytes_per_rank"].values()) == out[0]["total_file_bytes"] and set(info["bytes_per_rank"]) == {0, 1}


def test_copy_both_ways_and_tools_on_the_command_line(s3_server, tmp_path):
    from tests.tools.test_verify_inspect_gc_and_retention import _save, _state

    s3_server.bucket("copies")
    src = str(tmp_path / "src")
    _save(src, seed=21)
    url = "s3://copies/exp/iter_0000021"
    # local -> bucket, the endpoint as an argument
    proc = _cli("copy", src, url, "--endpoint", s3_server.endpoint)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(k.rsplit("/", 1)[1] for k in s3_server.keys("copies", "exp/iter_0000021/")) == sorted(os.listdir(src))
    # bucket -> local, the endpoint from the environment as boto3 reads it
    env = {"AWS_ENDPOINT_URL_S3": s3_server.endpoint}
    back = str(tmp_path / "back")
    proc = _cli("copy", url, back, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {"w": torch.empty(300, 100)}
    import torch.distributed.checkpoint as dcp

    dcp.load(out, checkpoint_id=back, no_dist=True)
    assert torch.equal(out["w"].view(torch.int32), _state(21)["w"].data.view(torch.int32))
    for name in os.listdir(src):
        assert open(os.path.join(src, name), "rb").read() == open(os.path.join(back, name), "rb").read(), name

    proc = _cli("verify", url, "--deep", "--json", env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads(proc.stdout)["ok"]
    proc = _cli("inspect", "exp/iter_0000021", "--json", "--kvstore-spec", json.dumps(s3_server.spec("copies")))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "w" in json.loads(proc.stdout)["tensors"]
    # a corrupted object is found through the endpoint too
    client = s3_server.client()
    key = next(k for k in s3_server.keys("copies", "exp/iter_0000021/") if k.endswith(".distcp"))
    blob = bytearray(client.get_object(Bucket="copies", Key=key)["Body"].read())
    blob[len(blob) // 2] ^= 0xFF
    client.put_object(Bucket="copies", Key=key, Body=bytes(blob))
    proc = _cli("verify", url, "--endpoint", s3_server.endpoint)
    assert proc.returncode == 1 and "checksum mismatch" in proc.stdout, proc.stdout[-2000:]


def _silent_endpoint():
    """A port that accepts connections (into the backlog) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    return s, f"http://127.0.0.1:{s.getsockname()[1]}"


# The default-deadline case (nothing listening: connections refused, retried until the 30 s
# default runs out) waits that long by design: it runs with --slow (and on the GPU machine's
# CPU part). The silent case (a port that accepts and never answers) checks the request
# deadline itself, with 5 s, in every run.
@pytest.mark.parametrize("kind", [pytest.param("refused_default_deadline", marks=pytest.mark.slow), "silent"])
def test_unreachable_store_every_rank_raises_within_the_deadline(s3_server, tmp_path, kind):
    if kind == "silent":
        keep, endpoint = _silent_endpoint()
        opts, bound_s = {"kvstore_request_timeout_s": 5.0}, 5.0
    else:  # nothing listens there; SaveOptions' own defaults
        keep, endpoint = None, f"http://127.0.0.1:{free_port()}"
        opts, bound_s = {}, safe_ckpt.SaveOptions().kvstore_request_timeout_s
    spec = {"driver": "s3", "bucket": "nowhere", "endpoint": endpoint, "aws_region": "us-east-1"}
    try:
        results = run_world(2, s3_cases.s3_failing_store,
                            (spec, "ck/iter_0000001", opts, None, str(tmp_path / "after")), timeout_s=200)
    finally:
        if keep is not None:
            keep.close()
    out = values(results)
    messages = {r["error"]["message"] for r in out}
    print(f"\n{kind}: " + ", ".join(f"rank {i} raised after {r['elapsed_s']:.2f} s" for i, r in enumerate(out)))
    assert len(messages) == 1, messages
    for r in out:
        assert "WriteError" in r["error"]["mro"], r["error"]
        assert "did not answer" in r["error"]["message"] or "retry" in r["error"]["message"], r["error"]["message"]
        assert r["elapsed_s"] < bound_s + 20, r["elapsed_s"]  # slack for a loaded 2-core machine
        assert r["usable_after"]
    assert safe_ckpt.SaveOptions().kvstore_request_timeout_s <= 60


def test_store_killed_after_the_first_object_landed(s3_server, tmp_path):
    spec = s3_server.bucket("dying")
    timeout_s = 5.0
    t0 = time.monotonic()
    out = values(run_world(2, s3_cases.s3_failing_store,
                           (spec, "ck/iter_0000002", {"kvstore_request_timeout_s": timeout_s}, s3_server.pid,
                            str(tmp_path / "after")), timeout_s=200))
    wall_s = time.monotonic() - t0
    assert s3_server.process.wait(timeout=30) is not None  # it is dead
    print(f"\nserver killed mid-save: " + ", ".join(f"rank {i} raised after {r['elapsed_s']:.2f} s"
                                                 for i, r in enumerate(out)) + f" (whole test world {wall_s:.1f} s)")
    assert any(r["first_landed"] for r in out)
    assert len({r["error"]["message"] for r in out}) == 1
    for r in out:
        assert "WriteError" in r["error"]["mro"], r["error"]
        # data write, then cleanup of what it wrote: each within its own deadline
        assert r["elapsed_s"] < timeout_s + 10 + 10, r["elapsed_s"]
        assert "metadata.json" not in r["small_files_written"] and ".metadata" not in r["small_files_written"]
        assert r["usable_after"]


def _owner_record(s3_server, bucket, key, **changes):
    record = json.loads(s3_server.client().get_object(Bucket=bucket, Key=key)["Body"].read())
    record.update(changes)
    s3_server.client().put_object(Bucket=bucket, Key=key, Body=json.dumps(record).encode())
    return record


def test_killed_save_leftovers_go_stale_gc_removes_them_and_a_resave_leaves_none_inside(s3_server, tmp_path):
    from safe_ckpt.targets.objectstore import publish as kvcommit
    from safe_ckpt.sinks.tensorstore import KvTarget
    from safe_ckpt.tools import kvtools
    from safe_ckpt.targets.objectstore import gc as kv_gc

    spec = s3_server.bucket("leftover")
    prefix = "ck/iter_0000003"
    results = run_world(2, s3_cases.s3_rank_dies, (spec, prefix), timeout_s=200)
    assert results[0][0] == "hung"  # rank 0 killed itself after its first object landed
    assert results[1][0] == "ok" and "CoordinationError" in results[1][1]["error"]["mro"], results[1]
    left = [k.rsplit("/", 1)[1] for k in s3_server.keys("leftover", prefix + "/")]
    assert left and "metadata.json" not in left
    assert len({kvcommit.save_id_of(n) for n in left}) == 1  # one save's tag
    owners = [n for n in left if n.startswith(names.OWNER_OBJECT_PREFIX)]
    assert len(owners) == 1
    owner_key = f"{prefix}/{owners[0]}"
    expected = sorted(f"iter_0000003/{n}" for n in left)
    # Its process ran on this machine and has exited: stale at once.
    assert kv_gc.find(KvTarget("ck", spec)) == expected
    # Had it run elsewhere, its heartbeat would decide: fresh for STALE_AFTER_S (60 s) after the last one ...
    record = _owner_record(s3_server, "leftover", owner_key, machine="another-host/boot/ns",
                           written_at_unix_s=time.time())
    assert record["stale_after_s"] == kvcommit.STALE_AFTER_S <= 60 and record["heartbeat_s"] < record["stale_after_s"]
    assert kv_gc.find(KvTarget("ck", spec)) == []
    # ... and a new save of the prefix is refused meanwhile (one save per prefix), naming the way out
    with pytest.raises(safe_ckpt.CommitError, match=r"another save of .*gc --force"):
        s3_cases.s3_save(0, 1, spec, prefix)
    # ... then stale (time passes beyond the bound), or removed at once with --force.
    _owner_record(s3_server, "leftover", owner_key, written_at_unix_s=time.time() - kvcommit.STALE_AFTER_S - 1)
    assert kv_gc.find(KvTarget("ck", spec)) == expected
    _owner_record(s3_server, "leftover", owner_key, written_at_unix_s=time.time())
    proc = _cli("gc", "s3://leftover/ck", "--dry-run", "--force", "--endpoint", s3_server.endpoint)
    assert proc.returncode == 0 and proc.stdout.count("would remove ") == len(left), proc.stdout + proc.stderr

    # Once it is stale, the next save of the prefix publishes a checkpoint without the dead save's keys.
    _owner_record(s3_server, "leftover", owner_key, written_at_unix_s=time.time() - kvcommit.STALE_AFTER_S - 1)
    values(run_world(2, s3_cases.s3_save, (spec, prefix)))
    after = [k.rsplit("/", 1)[1] for k in s3_server.keys("leftover", prefix + "/")]
    assert "metadata.json" in after and not set(left) & set(after), after
    report = kvtools.verify(KvTarget(prefix, spec))
    assert report.ok and not [f for f in report.findings if "extra" in f.message], report.findings
    # A re-save of the complete checkpoint removes the replaced checkpoint's objects.
    first = set(after)
    values(run_world(2, s3_cases.s3_save, (spec, prefix)))
    now = set(k.rsplit("/", 1)[1] for k in s3_server.keys("leftover", prefix + "/"))
    assert not ({n for n in first if n.endswith(".distcp")} & now)
    assert not [n for n in now if n.startswith(names.OWNER_OBJECT_PREFIX)]
    report = kvtools.verify(KvTarget(prefix, spec))
    assert report.ok and not [f for f in report.findings if "extra" in f.message], report.findings
    assert kv_gc.find(KvTarget("ck", spec)) == []
    local = str(tmp_path / "local")
    from safe_ckpt.tools.copy import copy

    copy(prefix, local, src_spec=spec)
    _assert_bits(_dcp_whole(local), s3_cases.expected_whole())


def test_tracker_and_retention_on_a_bucket_prefix(s3_server, monkeypatch):
    """The Megatron entry point's path with `--save s3://bucket/prefix` and AWS_ENDPOINT_URL_S3."""
    from safe_ckpt.megatron.training import save_state, save_target
    from safe_ckpt.targets.retention import Retention
    from safe_ckpt.sinks.tensorstore import KvTarget
    from safe_ckpt.tools import kvtools
    from safe_ckpt.targets.objectstore import gc as kv_gc
    from tests.tools.test_verify_inspect_gc_and_retention import _state

    s3_server.bucket("train")
    root, opts = save_target("s3://train/run", safe_ckpt.SaveOptions(chunk_bytes=32 * 1024, io_threads=2,
                                                                     progress_interval_s=0),
                             {"AWS_ENDPOINT_URL_S3": s3_server.endpoint})
    assert root == "run" and opts.kvstore_spec["endpoint"] == s3_server.endpoint
    for it in (1, 2, 3, 4):
        save_state(_state(it), root, f"{root}/iter_{it:07d}", str(it), options=opts,
                   retention=Retention(keep_last=2))
    keys = s3_server.keys("train", "run/")
    assert {k.split("/")[1] for k in keys} == {"iter_0000003", "iter_0000004", "latest_checkpointed_iteration.txt"}
    assert s3_server.client().get_object(Bucket="train", Key="run/latest_checkpointed_iteration.txt")["Body"].read() == b"4"
    info = kvtools.inspect(KvTarget("run/iter_0000004", opts.kvstore_spec))
    assert info["tracker"] == "4"
    assert kv_gc.find(KvTarget("run", opts.kvstore_spec)) == []


# ------------------------------------------------------------------ without a server


def test_s3_url_with_an_endpoint_becomes_the_s3_spec_and_other_targets_pass_unchanged():
    from safe_ckpt.sinks.tensorstore import KvTarget, resolve_target
    from safe_ckpt.targets.endpoints import endpoint_from

    t = resolve_target("s3://bkt/a/b/iter_0000001", endpoint="http://minio:9000")
    assert t == KvTarget("a/b/iter_0000001", {"driver": "s3", "bucket": "bkt", "endpoint": "http://minio:9000",
                                               "aws_region": "us-east-1"})
    assert resolve_target("s3://bkt/x", endpoint="http://e", region="eu-west-1").spec["aws_region"] == "eu-west-1"
    assert resolve_target("s3://bkt/x") == KvTarget("s3://bkt/x")  # real AWS: TensorStore's own URL form
    assert resolve_target("gs://b/x", endpoint="http://e") == KvTarget("gs://b/x")
    assert resolve_target("x/y", spec={"driver": "memory"}, endpoint="http://e") == KvTarget("x/y", {"driver": "memory"})
    assert not resolve_target("/local/dir", endpoint="http://e").is_kvstore
    assert endpoint_from({"AWS_ENDPOINT_URL": "http://a", "AWS_ENDPOINT_URL_S3": "http://b"}) == "http://b"
    assert endpoint_from({"AWS_ENDPOINT_URL": "http://a"}) == "http://a" and endpoint_from({}) is None
    with pytest.raises(safe_ckpt.WriteError, match="bucket"):
        resolve_target("s3:///x", endpoint="http://e")


def test_what_counts_as_an_interrupted_saves_keys():
    from safe_ckpt.targets.objectstore.publish import is_save_leftover

    tagged = ["__0_0-0123456789abcdef.distcp", "__1_3-0123456789abcdef.distcp"]
    assert is_save_leftover(tagged)
    assert is_save_leftover(tagged + [".metadata", "common.pt", "safe_ckpt_manifest.json"])  # killed mid-publish
    assert not is_save_leftover(tagged + ["metadata.json", ".metadata"])  # a checkpoint
    assert not is_save_leftover(["__0_0.distcp"])  # untagged: not attributable to one save
    assert is_save_leftover(tagged + [".safe_ckpt-owner-0123456789abcdef"])  # a save's owner object
    assert not is_save_leftover(tagged + [".safe_ckpt-owner-x"])
    assert not is_save_leftover(tagged + ["notes.txt"]) and not is_save_leftover([])


def test_a_request_that_never_completes_is_cancelled_at_its_deadline(monkeypatch):
    """A kvstore write to a store that never answers (a listening socket nobody serves)."""
    from safe_ckpt.sinks.tensorstore import KvDeadlines, KvTarget, open_sink

    keep, endpoint = _silent_endpoint()
    try:
        spec = {"driver": "s3", "bucket": "silent", "endpoint": endpoint, "aws_region": "us-east-1"}
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        sink = open_sink(KvTarget("p", spec), KvDeadlines(1.0))
        t0 = time.monotonic()
        with pytest.raises(safe_ckpt.WriteError, match="did not answer within 1.0 s"):
            sink.write_file("x", b"payload")
        assert time.monotonic() - t0 < 10
        sink = open_sink(KvTarget("p", spec), KvDeadlines(30.0, save_deadline=time.monotonic() + 1.0))
        t0 = time.monotonic()
        with pytest.raises(safe_ckpt.WriteError, match="did not answer"):
            sink.list()  # the save's deadline comes before the request's
        assert time.monotonic() - t0 < 10
    finally:
        keep.close()
