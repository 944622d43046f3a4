"""Object stores as a user meets them, against a real S3 API (a local moto server): the Python API,
the command line and the Megatron adapter follow one endpoint rule; a save root's tracker is
followed; printed paths carry the bucket; a missing bucket, a missing prefix and a refused
connection are one clean line each with the exit codes of local paths; no credential-file
noise from TensorStore; a running save's owner object has a heartbeat."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("tensorstore")

import safe_ckpt  # noqa: E402
from tests.helpers.s3server import free_port, s3_server  # noqa: E402,F401  (fixture)
from tests.tools.test_verify_inspect_gc_and_retention import _state  # noqa: E402

NOISE = (".aws/credentials", ".aws/config", "AuthCredentialsProvider", "http_response_body", "<?xml")


def _cli(*argv, env=None):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "safe_ckpt", *argv], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)
    proc.elapsed_s = time.monotonic() - t0
    return proc


def _opts(**kw):
    return safe_ckpt.SaveOptions(**{"chunk_bytes": 32 * 1024, "io_threads": 2, "progress_interval_s": 0,
                                    "kvstore_request_timeout_s": 5.0, **kw})


def _quiet(stderr: str) -> bool:
    return not any(word in stderr for word in NOISE)


def test_an_s3_save_root_from_the_python_api_is_verified_through_its_tracker(s3_server, monkeypatch):
    from safe_ckpt.sinks.tensorstore import KvTarget
    from safe_ckpt.tools import kvtools
    from safe_ckpt.targets.objectstore import root as kv_root

    s3_server.bucket("edges")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)
    for it in (3, 5):  # the Python API with a URL: the environment's endpoint, as the CLI and the adapter
        safe_ckpt.save(_state(it), f"s3://edges/run/iter_{it:07d}", options=_opts())
    assert "run/iter_0000005/metadata.json" in s3_server.keys("edges", "run/")
    root = KvTarget("run", s3_server.spec("edges"))
    kv_root.write_tracker(root, 5)

    proc = _cli("verify", "s3://edges/run")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "followed latest_checkpointed_iteration.txt (5) to s3://edges/run/iter_0000005/" in proc.stderr, proc.stderr
    assert "checkpoint s3://edges/run/iter_0000005/" in proc.stdout, proc.stdout
    assert _quiet(proc.stderr), proc.stderr
    proc = _cli("inspect", "--json", "s3://edges/run")
    info = json.loads(proc.stdout)
    assert proc.returncode == 0 and info["followed_tracker"] == "5"
    assert info["directory"] == "s3://edges/run/iter_0000005/"
    assert info["tracker"] == "5" and _quiet(proc.stderr), proc.stderr
    assert kvtools.verify(root).directory == "s3://edges/run/iter_0000005/"  # the library follows it too

    # ... and safe_ckpt.load reads the same URL from the same endpoint
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    saved = _state(5)
    empty = {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(saved[k].data)) for k in ("w", "b")}
    loaded = safe_ckpt.load(empty, "s3://edges/run/iter_0000005")
    for k in ("w", "b"):
        assert torch.equal(loaded[k], saved[k].data), k


def test_a_save_to_s3_names_the_url_with_its_bucket_in_its_summary_and_result(s3_server, monkeypatch, caplog):
    import logging

    s3_server.bucket("summary")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)
    with caplog.at_level(logging.INFO, logger="safe_ckpt"):
        by_url = safe_ckpt.save(_state(3), "s3://summary/run/iter_0000003", options=_opts())
        in_spec = safe_ckpt.save(_state(4), "run/iter_0000004", options=_opts(kvstore_spec=s3_server.spec("summary")))
    assert by_url.checkpoint_dir == "s3://summary/run/iter_0000003"
    assert in_spec.checkpoint_dir == "s3://summary/run/iter_0000004"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("saved ")]
    assert [line.split(":")[0] + ":" + line.split(":")[1] for line in lines] == [
        "saved s3://summary/run/iter_0000003", "saved s3://summary/run/iter_0000004"], lines


def _cli_here(*argv) -> tuple[int, str]:
    import contextlib
    import io

    from safe_ckpt.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(list(argv))
    return rc, err.getvalue()


def test_s3_failures_are_one_clean_line_with_the_exit_codes_of_local_paths(s3_server, monkeypatch):
    s3_server.bucket("edges")
    safe_ckpt.save(_state(1), "run/iter_0000001", options=_opts(kvstore_spec=s3_server.spec("edges")))
    env = {"AWS_ENDPOINT_URL_S3": s3_server.endpoint}
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)
    cases = [
        (("verify", "s3://edges/nothing/here"), 2, "no such checkpoint prefix"),
        (("inspect", "s3://edges/nothing/here"), 2, "no such checkpoint prefix"),
        (("gc", "s3://edges/nothing"), 2, "no such prefix"),
        (("verify", "s3://no-such-bucket/run"), 2, "the bucket does not exist"),
        (("gc", "s3://no-such-bucket/run"), 2, "the bucket does not exist"),
        (("copy", "s3://no-such-bucket/run/iter_0000001", "/tmp/never_written_s3"), 2, "the bucket does not exist"),
    ]
    for i, (argv, rc, words) in enumerate(cases):
        if i == 3:  # one in a process of its own: TensorStore's native logging goes to the process's stderr
            proc = _cli(*argv, env=env)
            code, err = proc.returncode, proc.stderr
        else:
            code, err = _cli_here(*argv)
        lines = err.strip().splitlines()
        assert code == rc and words in err, (argv, code, err[-2000:])
        assert len(lines) == 1 and lines[0].startswith(f"safe-ckpt {argv[0]}: error: s3://"), (argv, err)
        assert _quiet(err), (argv, err)
    assert not os.path.exists("/tmp/never_written_s3")
    # nothing listens at the endpoint: said at once, as a refused connection, not a timeout
    proc = _cli("verify", "s3://edges/run/iter_0000001", "--endpoint", f"http://127.0.0.1:{free_port()}")
    assert proc.returncode == 1 and "refused" in proc.stderr and "did not answer" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and _quiet(proc.stderr), proc.stderr
    assert proc.elapsed_s < 20, proc.elapsed_s  # not the 30 s request deadline (a loaded machine starts slowly)
    proc = _cli("verify", "s3://edges/run/iter_0000001", env=env)
    assert proc.returncode == 0 and _quiet(proc.stderr), proc.stderr


def test_the_python_api_the_command_line_and_the_adapter_share_one_endpoint_rule(monkeypatch):
    from safe_ckpt import cli
    from safe_ckpt.targets import endpoints
    from safe_ckpt.megatron.training import save_target as adapter_target

    env = {"AWS_ENDPOINT_URL": "http://generic:1", "AWS_ENDPOINT_URL_S3": "http://s3only:2", "AWS_REGION": "eu-west-1",
           "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    for name in env:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    expected = {"driver": "s3", "bucket": "bkt", "endpoint": "http://s3only:2", "aws_region": "eu-west-1",
                "aws_credentials": {"type": "environment"}}
    api_path, api_opts = endpoints.save_target("s3://bkt/run/iter_0000001", safe_ckpt.SaveOptions())
    assert (api_path, api_opts.kvstore_spec) == ("run/iter_0000001", expected)
    root, opts = adapter_target("s3://bkt/run", safe_ckpt.SaveOptions(), os.environ)
    assert (root, opts.kvstore_spec) == ("run", expected)
    # `save_state` with URLs: the tracker goes where the checkpoint goes
    root, ckpt, opts = endpoints.save_state_targets("s3://bkt/run", "s3://bkt/run/iter_0000001",
                                                    safe_ckpt.SaveOptions())
    assert (root, ckpt, opts.kvstore_spec) == ("run", "run/iter_0000001", expected)
    with pytest.raises(safe_ckpt.ValidationError, match="one store"):
        endpoints.save_state_targets("s3://bkt/run", "s3://other/run/iter_0000001", safe_ckpt.SaveOptions())
    args = cli.build_parser().parse_args(["verify", "s3://bkt/run/iter_0000001"])
    target = cli.commands._location(args, args.directory, None)
    assert (target.path, target.spec) == ("run/iter_0000001", expected)
    args = cli.build_parser().parse_args(["verify", "s3://bkt/x", "--endpoint", "http://flag:3"])
    assert cli.commands._location(args, args.directory, None).spec["endpoint"] == "http://flag:3"  # the flag first
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    generic = endpoints.save_target("s3://bkt/x", safe_ckpt.SaveOptions())[1].kvstore_spec
    assert generic["endpoint"] == "http://generic:1"
    # a spec given by the user keeps its own credentials; local paths and other URLs pass untouched
    own = {"driver": "s3", "bucket": "b", "aws_credentials": {"type": "anonymous"}}
    assert endpoints.save_target("p", safe_ckpt.SaveOptions(kvstore_spec=own))[1].kvstore_spec == own
    for target in ("/local/dir", "gs://b/x", "memory://m"):
        opts = safe_ckpt.SaveOptions()
        assert endpoints.save_target(target, opts) == (target, opts)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")  # credentials not in the environment: TensorStore's own chain
    assert "aws_credentials" not in endpoints.save_target("s3://bkt/x", safe_ckpt.SaveOptions())[1].kvstore_spec


class _CountsOwnerWrites:
    def __init__(self, inner, wanted: int) -> None:
        self.inner, self.root, self.deadlines = inner, inner.root, inner.deadlines
        self.writes, self.wanted, self.enough = 0, wanted, threading.Event()

    def write_file(self, name, data):
        self.inner.write_file(name, data)
        self.writes += 1
        if self.writes >= self.wanted:
            self.enough.set()


def test_a_running_saves_owner_object_is_rewritten_until_the_save_ends(tmp_path, monkeypatch):
    from safe_ckpt.targets.objectstore import publish as kvcommit
    from safe_ckpt.sinks.tensorstore import KvTarget, open_sink

    monkeypatch.setattr(kvcommit, "HEARTBEAT_S", 0.01)
    sink = _CountsOwnerWrites(open_sink(KvTarget(f"file://{tmp_path}/ck")), wanted=3)
    save_id = "0123456789abcdef"
    kvcommit.claim(sink, save_id)
    assert sink.enough.wait(30), sink.writes
    first = json.loads(sink.inner.read(kvcommit.owner_key(save_id)))
    assert first["stale_after_s"] == kvcommit.STALE_AFTER_S and first["pid"] == os.getpid()
    assert kvcommit.running_saves(sink.inner, [kvcommit.owner_key(save_id)]) == {save_id}
    kvcommit.release(save_id)
    after = sink.writes
    assert not [t for t in threading.enumerate() if t.name.endswith(save_id)]  # stopped, nothing in flight
    assert sink.writes == after
    # its record names this process, whose save is over: stale at once for gc and the next save
    assert kvcommit.running_saves(sink.inner, [kvcommit.owner_key(save_id)]) == set()
