"""The benchmarks' ``--engine`` and ``--lake`` choices: which engine writes, and where the lake lives.

``--lake`` is a local directory (default: a fresh temporary one), an ``s3://bucket/prefix`` URL
reached with the usual ``AWS_*`` environment variables, or ``s3``: a local S3-compatible server
(moto's, from the dev extra) that the benchmark starts in a child process of its own, so its
memory does not count as pgcdc's, and stops at the end. ``--engine`` is ``sail`` (embedded, the
default), ``spark`` (Apache Spark with Delta that pgcdc starts, ``spark.engine: spark``) or the
``sc://host:port`` URL of a running Spark Connect server.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from resources.delta.lake_storage import LakeStorage, open_lake
from resources.engines.engine import SparkEngine
from resources.engines.s3a import s3a_settings
from resources.locations import StorageSettings

LOCAL_S3 = "s3"
BUCKET = "bench"
KEY_VARIABLE, SECRET_VARIABLE = "PGCDC_BENCH_S3_KEY", "PGCDC_BENCH_S3_SECRET"


def add_arguments(parser: Any) -> None:
    parser.add_argument("--engine", default="sail", help="sail (embedded), spark (managed) or sc://host:port")
    parser.add_argument(
        "--lake",
        default=None,
        help="directory, s3://bucket/prefix, or 's3' for a local S3 server (default: a temp dir)",
    )


@contextmanager
def bench_lake(spec: str | None, work: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(delta.root, delta.storage)`` for ``--lake``; a local S3 server runs while the context is open."""
    if spec is None:
        yield str(work / "lake"), {}
    elif spec == LOCAL_S3:
        with _local_s3() as endpoint:
            storage = {
                "endpoint": endpoint, "region": "us-east-1", "allow_http": True,
                "access_key_id": f"${{{KEY_VARIABLE}}}", "secret_access_key": f"${{{SECRET_VARIABLE}}}",
            }  # fmt: skip
            yield f"s3://{BUCKET}/lake", storage
    else:
        yield spec, {}


def open_engine(spec: str, root: str, storage: dict[str, Any], config: dict[str, str] | None = None) -> SparkEngine:
    """The engine named by ``--engine``, able to reach the lake; the lake is checked first.
    ``config``: more settings for a managed Spark (e.g. its event log)."""
    lake = open_lake(root, StorageSettings(**storage))
    if spec == "sail":
        return SparkEngine.embedded(storage_environment=lake.engine_environment())
    if spec == "spark":
        return SparkEngine.managed_spark(
            {**s3a_settings(lake), **(config or {})}, storage_environment=lake.engine_environment()
        )
    if spec.startswith("sc://"):
        return SparkEngine.remote(spec)
    raise SystemExit(f"--engine {spec}: use sail, spark or sc://host:port")


def lake_storage(root: str, storage: dict[str, Any]) -> LakeStorage:
    return LakeStorage(root, StorageSettings(**storage))


@contextmanager
def _local_s3() -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.setdefault(KEY_VARIABLE, "bench-key")
    os.environ.setdefault(SECRET_VARIABLE, "bench-secret")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the local S3 server (moto) did not start") from None
                time.sleep(0.2)
        import boto3  # the dev extra, like moto

        boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1",
            aws_access_key_id=os.environ[KEY_VARIABLE], aws_secret_access_key=os.environ[SECRET_VARIABLE],
        ).create_bucket(Bucket=BUCKET)  # fmt: skip
        yield endpoint
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
