"""A local S3 API for the tests: `moto` in server mode on a free loopback port.

`s3_server` (a pytest fixture) starts `python -m moto.server` in a subprocess, waits (bounded)
until it answers, and stops it after the test; tests that need it are skipped, with the
reason, where moto's server extra is not installed (`pip install 'moto[server]'`, in the
`test` extra). Credentials are set to placeholders for this process and the ranks it spawns.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest

REGION = "us-east-1"
_STARTUP_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    process: subprocess.Popen
    port: int

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def spec(self, bucket: str) -> dict:
        return {"driver": "s3", "bucket": bucket, "endpoint": self.endpoint, "aws_region": REGION}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION)

    def bucket(self, name: str) -> dict:
        """Create bucket ``name`` (3+ characters) and return its TensorStore spec."""
        self.client().create_bucket(Bucket=name)
        return self.spec(name)

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.kill(self.process.pid, signal.SIGCONT)  # a test may have paused it
            except ProcessLookupError:
                pass
            self.process.kill()
        self.process.wait(timeout=30)


def moto_server_missing() -> str | None:
    for module in ("moto", "flask", "boto3"):
        if importlib.util.find_spec(module) is None:
            return f"the local S3 server needs moto's server extra: pip install 'moto[server]' (no {module})"
    return None


def start_server() -> S3Server:
    reason = moto_server_missing()
    if reason:
        pytest.skip(reason)
    port = free_port()
    log = tempfile.TemporaryFile()  # not a pipe: the server logs every request, and a full pipe would stall it
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + _STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"moto server exited: {log.read().decode()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return S3Server(proc, port)
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"moto server did not listen on port {port} within {_STARTUP_S} s")


@pytest.fixture
def s3_server(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    server = start_server()
    try:
        yield server
    finally:
        server.stop()
