"""The command line on a real S3 API (a local moto server), with the exact input a user gives:
a prefix that is no checkpoint is named in the bucket, never in a temporary directory; a save
root without a tracker points at its checkpoints; a store that does not answer names the flag;
`copy` follows the tracker and --replace leaves exactly the copied checkpoint."""

from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("tensorstore")

import safe_ckpt  # noqa: E402
from tests.helpers.s3server import s3_server  # noqa: E402,F401  (fixture)
from tests.tools.test_cli_edges import _cli  # noqa: E402
from tests.tools.test_command_line_messages import PYTHON_NAMES  # noqa: E402
from tests.tools.test_verify_inspect_gc_and_retention import _state  # noqa: E402


def _opts():
    return safe_ckpt.SaveOptions(chunk_bytes=32 * 1024, io_threads=2, progress_interval_s=0,
                                 kvstore_request_timeout_s=5.0)


def _clean(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and "/tmp" not in err and "safe_ckpt-" not in err, err
    assert not any(name in err for name in PYTHON_NAMES), err
    return lines[0]


def test_s3_messages_name_the_bucket_the_checkpoints_and_the_flag(s3_server, monkeypatch, tmp_path):
    s3_server.bucket("edges")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)
    for it in (3, 5):
        safe_ckpt.save(_state(it), f"s3://edges/run/iter_{it:07d}", options=_opts())
    s3_server.client().put_object(Bucket="edges", Key="half/__0_0.distcp", Body=b"cut short")

    rc, out, err = _cli("inspect", "s3://edges/half")  # keys, but no index: named in the bucket
    assert rc == 1 and out == ""
    assert _clean(err) == "safe-ckpt inspect: s3://edges/half/.metadata: missing: this is not a torch_dist checkpoint"
    rc, out, err = _cli("verify", "s3://edges/half")
    assert rc == 1 and "ERROR   .metadata: missing" in out and "/tmp" not in out + err, out + err

    for command in ("verify", "inspect", "copy"):  # a save root without a tracker
        rc, out, err = _cli(command, "s3://edges/run", *([str(tmp_path / "never")] if command == "copy" else []))
        assert rc == 2 and out == "", (command, out, err)
        assert _clean(err) == (
            f"safe-ckpt {command}: error: s3://edges/run/: no tracker (latest_checkpointed_iteration.txt) and no "
            ".metadata: this looks like a save root holding iter_0000003, iter_0000005; pass one of them, e.g. "
            "s3://edges/run/iter_0000005"), err
    assert not os.path.exists(tmp_path / "never")

    os.kill(s3_server.pid, signal.SIGSTOP)  # the store accepts connections but answers nothing
    try:
        rc, out, err = _cli("verify", "s3://edges/run/iter_0000005", "--request-timeout-s", "1")
    finally:
        os.kill(s3_server.pid, signal.SIGCONT)
    assert rc == 1 and _clean(err).endswith(
        "did not answer within 1.0 s (unreachable, or too slow); check the endpoint and credentials, "
        "or raise --request-timeout-s"), err
    assert f"the store at {s3_server.endpoint} did not answer" in _clean(err), err  # it names where it asked


def test_s3_copy_follows_the_tracker_and_replace_leaves_exactly_the_checkpoint(s3_server, monkeypatch, tmp_path):
    from safe_ckpt.sinks.tensorstore import KvTarget
    from safe_ckpt.targets.objectstore import root as kv_root

    s3_server.bucket("copies")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)
    for it in (3, 5):
        safe_ckpt.save(_state(it), f"s3://copies/run/iter_{it:07d}", options=_opts())
    kv_root.write_tracker(KvTarget("run", s3_server.spec("copies")), 5)
    client = s3_server.client()
    client.put_object(Bucket="copies", Key="dst/notes.txt", Body=b"mine")
    client.put_object(Bucket="copies", Key="dst/deeper/more.txt", Body=b"mine too")

    rc, _, err = _cli("copy", "s3://copies/run", "s3://copies/dst")
    assert rc == 1 and _clean(err.splitlines()[-1]).endswith("Remove them, or pass --replace"), err
    rc, out, err = _cli("copy", "--replace", "s3://copies/run", "s3://copies/dst")
    assert rc == 0, err
    assert err == "followed latest_checkpointed_iteration.txt (5) to s3://copies/run/iter_0000005/\n", err
    assert out.startswith("copied s3://copies/run/iter_0000005/ to s3://copies/dst/: 10 files, "), out
    source = [k.rsplit("/", 1)[1] for k in s3_server.keys("copies", "run/iter_0000005/")]
    assert [k[len("dst/"):] for k in s3_server.keys("copies", "dst/")] == sorted(source)
    back = str(tmp_path / "back")
    rc, out, err = _cli("copy", "s3://copies/dst", back)
    assert rc == 0 and out.startswith(f"copied s3://copies/dst/ to {back}: 10 files"), out + err
    assert safe_ckpt.verify(back, deep=True).ok
