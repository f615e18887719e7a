"""Delta Lake I/O through PySpark only, so the same code runs on embedded Sail and real Spark.

Findings that shaped this module (details and timings in ``docs/engine-notes.md``):

* Arrow goes to Spark with ``spark.createDataFrame(arrow_table, schema=...)``: no Python rows.
  The explicit schema matters: without it PySpark turns naive timestamps into
  ``timestamp`` (local time zone) instead of ``timestamp_ntz``.
* ``DESCRIBE HISTORY`` is missing in Sail, and JSON sources there expose no file name, so
  commit metadata is read from ``_delta_log`` with the ``binaryFile`` source, whose ``path``
  column gives each commit's version. That is plain Spark and works on any Delta writer.
* Sail records the ``userMetadata`` writer option, but a SQL ``MERGE`` has no writer options
  and Sail ignores ``spark.databricks.delta.commitInfo.userMetadata``; an empty append makes
  no commit at all. So only snapshots, appends and overwrites carry pgcdc's markers atomically:
  keyless appends and REPLICA IDENTITY FULL rewrites (``replace_rows``) do; a keyed MERGE
  carries none (replaying one is harmless).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from types import TracebackType

from pyspark.sql import SparkSession

from resources.errors import ConfigurationError


DELTA_CLASSIC_CONFIG: dict[str, str] = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}


class SparkEngine:
    """A Spark session and, in embedded mode, the Sail server process behind it; close() stops both."""

    def __init__(self, spark: SparkSession, server: subprocess.Popen[bytes] | None = None) -> None:
        self.spark = spark
        self._server = server
        client = getattr(spark, "client", None)  # Spark Connect sessions only
        if client is not None:
            # Reattachable execution releases results on a thread pool shared by every
            # session of the process, and closing any session (also from its finalizer,
            # which the garbage collector may run on one of those pool threads while it
            # holds the gRPC channel's lock) joins that pool: a deadlock seen under parallel
            # snapshots. Our operations are short commands, so plain execution loses nothing.
            client.disable_reattachable_execute()

    @classmethod
    def embedded(cls, config: Mapping[str, str] | None = None) -> SparkEngine:
        """Start Sail in a child process (``resources.delta.sail_server``) on a free loopback port and connect."""
        server = subprocess.Popen(
            [sys.executable, "-m", "resources.delta.sail_server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**EMBEDDED_ENVIRONMENT, **os.environ},
        )
        try:
            assert server.stdout is not None
            line = server.stdout.readline()
            if not line.strip().isdigit():
                raise RuntimeError(f"the embedded Sail server did not start (exit status {server.wait()})")
            spark = _with_config(SparkSession.builder.remote(f"sc://127.0.0.1:{int(line)}"), config).create()
        except BaseException:
            _stop_server(server)
            raise
        return cls(spark, server)

    @classmethod
    def remote(cls, url: str, config: Mapping[str, str] | None = None) -> SparkEngine:
        """Connect to a running Spark Connect server (``sc://host:port``).

        The server is probed first: the Spark Connect client retries an unreachable
        address with back-off for minutes, where a user wants the cause at once.
        """
        _probe_spark_connect(url)
        return cls(_with_config(SparkSession.builder.remote(url), config).create())

    def server_memory_mib(self) -> tuple[float, float]:
        """The embedded server's resident and peak resident memory (VmRSS, VmHWM); zeros without one."""
        return (0.0, 0.0) if self._server is None else process_memory_mib(self._server.pid)

    def close(self) -> None:
        try:
            self.spark.stop()
        finally:
            if self._server is not None:
                _stop_server(self._server)
                self._server = None

    def __enter__(self) -> SparkEngine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


EMBEDDED_ENVIRONMENT = {
    "MIMALLOC_PURGE_DELAY": "0",
    "SAIL_EXECUTION__DEFAULT_PARALLELISM": str(max(1, len(os.sched_getaffinity(0)) - 1)),
    "SAIL_PARQUET__FILE_METADATA_CACHE__SIZE_LIMIT": str(64 * 1024 * 1024),
}
"""Defaults for the embedded Sail server's environment; a value already in pgcdc's environment
wins. Sail allocates with mimalloc, which by default keeps freed pages of its worker threads for
later: the server then grew by every MERGE's working memory and never shrank; purging at once
returns it, at no measured cost. Sail splits work into one partition per core, but one core is
busy in pgcdc's process decoding the replication stream while the writes run: one partition
fewer made the CDC benchmark 15-25 % faster on 2 cores (docs/engine-notes.md). Sail caches every
Parquet footer it reads for 30 minutes without a size limit; each MERGE writes new files, so a
long-lived server would hold the footers of every file version it read: the cache is capped."""


def process_memory_mib(pid: int | str = "self") -> tuple[float, float]:
    """A process's resident and peak resident memory in MiB (VmRSS, VmHWM from /proc)."""
    values = {"VmRSS": 0.0, "VmHWM": 0.0}
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            name, _, rest = line.partition(":")
            if name in values:
                values[name] = int(rest.split()[0]) / 1024
    return values["VmRSS"], values["VmHWM"]


def _stop_server(server: subprocess.Popen[bytes]) -> None:
    """Closing its stdin asks the server to stop; one that does not within seconds is killed."""
    if server.stdin is not None:
        server.stdin.close()
    try:
        server.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    if server.stdout is not None:
        server.stdout.close()


SPARK_CONNECT_DEFAULT_PORT = 15002


def _probe_spark_connect(url: str, timeout: float = 5.0) -> None:
    """Fail with the fix unless a TCP connection to the server named by ``url`` opens."""
    address = url.removeprefix("sc://").split("/", 1)[0]
    host, _, port = address.rpartition(":") if ":" in address else (address, "", "")
    host = host.strip("[]") or "localhost"
    try:
        with socket.create_connection((host, int(port or SPARK_CONNECT_DEFAULT_PORT)), timeout=timeout):
            pass
    except (OSError, ValueError) as error:
        raise ConfigurationError(
            f"Spark Connect server {url} is unreachable ({error})",
            "start it, fix spark.remote, or set spark.remote: null for the embedded engine",
        ) from None


def _with_config(builder: SparkSession.Builder, config: Mapping[str, str] | None) -> SparkSession.Builder:
    for key, value in (config or {}).items():
        builder = builder.config(key, value)
    return builder


def classic_delta_config(user_config: Mapping[str, str] | None = None) -> dict[str, str]:
    """Spark configuration for a classic (JVM) session with Delta; user settings win."""
    return {**DELTA_CLASSIC_CONFIG, **(user_config or {})}


def classic_session_builder(app_name: str, user_config: Mapping[str, str] | None = None) -> SparkSession.Builder:
    """A classic session builder with the Delta jars matching the installed delta-spark.

    Needs the ``classic`` extra (delta-spark) and Maven access for the jars.
    """
    from delta.pip_utils import configure_spark_with_delta_pip

    builder = _with_config(SparkSession.builder.appName(app_name), classic_delta_config(user_config))
    return configure_spark_with_delta_pip(builder)
