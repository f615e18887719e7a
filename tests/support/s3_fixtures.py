"""A local S3 for the suite: moto's server in a process of its own, on a free port.

Not in a thread of the test process: a delta-rs call that keeps Python's GIL while it waits for
the store (``DeltaTable.alter.set_table_properties`` in deltalake 1.6.6) would wait for a server
that cannot run, until the store client gives up; a real store is never in pgcdc's process.
One server for the whole session (start and stop take about a second); each test gets a lake
of its own under a fresh prefix of one bucket. The test credentials reach pgcdc the way a
user's would: through environment variables that ``delta.storage`` names as ``${...}``
references. moto accepts any key pair, so a missing key pair is caught by pgcdc's preflight,
which is what the bad-input tests check.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import pytest
from pyspark.sql import SparkSession

from resources.delta.lake_storage import LakeStorage
from resources.engines.engine import SparkEngine
from resources.locations import StorageSettings

BUCKET = "lake"
REGION = "us-east-1"
KEY_VARIABLE = "PGCDC_TEST_S3_KEY"
SECRET_VARIABLE = "PGCDC_TEST_S3_SECRET"
TEST_KEY = "pgcdc-test-key"
TEST_SECRET = "pgcdc-test-secret-Zq81xW"
"""Distinctive, so a test can search logs, errors and metadata for it."""


@dataclass(frozen=True)
class S3Server:
    endpoint: str

    def storage(self, **overrides: Any) -> dict[str, Any]:
        """``delta.storage`` for this server, credentials as environment references."""
        return {
            "endpoint": self.endpoint,
            "region": REGION,
            "allow_http": True,
            "access_key_id": f"${{{KEY_VARIABLE}}}",
            "secret_access_key": f"${{{SECRET_VARIABLE}}}",
            **overrides,
        }

    def lake(self, root: str) -> LakeStorage:
        return LakeStorage(root, StorageSettings(**self.storage()))

    def keys(self, prefix: str) -> list[str]:
        """Every object key under ``prefix`` in the bucket (boto3, independent of pgcdc's client)."""
        client = boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=TEST_KEY, aws_secret_access_key=TEST_SECRET,
            region_name=REGION,
        )  # fmt: skip
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return [item["Key"] for page in pages for item in page.get("Contents", [])]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for_port(port: int, server: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    """Until the server accepts connections; a server that exits or never listens fails the session."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"moto's server exited with {server.returncode}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"moto's server did not listen on port {port} within {timeout_s:.0f} s")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    saved = {name: os.environ.get(name) for name in (KEY_VARIABLE, SECRET_VARIABLE)}
    os.environ[KEY_VARIABLE], os.environ[SECRET_VARIABLE] = TEST_KEY, TEST_SECRET
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,  # moto logs every request
    )  # fmt: skip
    try:
        _wait_for_port(port, server)
        s3 = S3Server(f"http://127.0.0.1:{port}")
        boto3.client(
            "s3", endpoint_url=s3.endpoint, aws_access_key_id=TEST_KEY, aws_secret_access_key=TEST_SECRET,
            region_name=REGION,
        ).create_bucket(Bucket=BUCKET)  # fmt: skip
        yield s3
    finally:
        server.terminate()
        server.wait(timeout=30)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture
def s3_root(s3_server: S3Server) -> str:
    """A fresh, empty lake root for one test."""
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def s3_spark_engine(s3_server: S3Server) -> Iterator[SparkEngine]:
    """An embedded Sail engine whose server process can reach the moto store."""
    with SparkEngine.embedded(storage_environment=s3_server.lake(f"s3://{BUCKET}/").engine_environment()) as engine:
        yield engine


@pytest.fixture(scope="session")
def s3_spark(s3_spark_engine: SparkEngine) -> SparkSession:
    return s3_spark_engine.spark


class RecordingHttpProxy:
    """A plain-HTTP forward proxy to one server (moto) that records each request's first line and Host
    header: what addressing the clients really used. Clients reach it through ``HTTP_PROXY``/``http_proxy``;
    moto takes the absolute-form request line and finds the bucket in the Host header or the path."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.requests: list[tuple[str, str]] = []  # (request line, host)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client, socket.create_connection(self._upstream) as upstream:
            threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()
            try:
                while data := client.recv(65536):
                    self._record(data)
                    upstream.sendall(data)
            except OSError:  # the server closed the connection: the pump has closed the client's
                pass

    def _record(self, data: bytes) -> None:
        """Request heads in ``data`` (a keep-alive connection carries several; bodies hold none that parse)."""
        for head in data.split(b"\r\n\r\n"):
            lines = head.decode("latin-1").split("\r\n")
            if len(lines) > 1 and lines[0].endswith(" HTTP/1.1") and " http://" in lines[0]:
                host = next((line.split(":", 1)[1].strip() for line in lines if line.lower().startswith("host:")), "")
                self.requests.append((lines[0], host))

    def close(self) -> None:
        self._listener.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """The server's answers to the client; when the server closes, the client's connection closes too (a
    client keeping it would send its next request into nothing)."""
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    try:
        sink.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
