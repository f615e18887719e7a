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

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from pyspark.sql import SparkSession

from resources.config import SparkSettings
from resources.engines.capabilities import (
    DELTA_SPARK_CAPABILITIES,
    expected_refusal,
    SAIL_CAPABILITIES,
    set_engine_capabilities,
)
from resources.engines.kept_spark import attach, KeptServer
from resources.engines.spark_connect import connect_session
from resources.engines.spark_server import DELTA_PACKAGE, managed_server_config, remember_resolved_jars
from resources.errors import ConfigurationError


class SparkEngine:
    """A Spark session and, for an engine pgcdc runs itself (embedded Sail, managed Spark), the
    server process behind it; close() stops both. Every session is a Spark Connect session
    built by :func:`resources.engines.spark_connect.connect_session`, except a classic in-process one."""

    def __init__(
        self, spark: SparkSession, server: subprocess.Popen[bytes] | None = None, kept: KeptServer | None = None
    ) -> None:
        self.spark = spark
        self._server = server
        self._kept = kept
        self.server_pid: int | None = None
        """The engine's own process (Sail's server or the Spark JVM) when pgcdc started it."""
        self.start_note: str | None = None
        """For the run's log: the JVM started for it (and how long that took) or reused (and its age)."""

    @classmethod
    def from_config(cls, spark: SparkSettings) -> SparkEngine:
        """The engine ``spark:`` in the pgcdc configuration names: ``remote`` when set, else
        ``engine`` (embedded Sail or a managed Spark with Delta)."""
        if spark.remote:
            return cls.remote(spark.remote, spark.config)
        if spark.engine == "spark":
            return cls.managed_spark(spark.config, keep_alive_s=spark.keep_alive_s)
        return cls.embedded(spark.config)

    @classmethod
    def embedded(
        cls, config: Mapping[str, str] | None = None, storage_environment: Mapping[str, str] | None = None
    ) -> SparkEngine:
        """Start Sail in a child process (``resources.engines.sail_server``) on a free loopback port and connect.

        ``storage_environment`` (``LakeStorage.engine_environment``) reaches an object-store lake:
        Sail reads storage settings only from its process environment; they win over pgcdc's own.
        """
        server = subprocess.Popen(
            [sys.executable, "-m", "resources.engines.sail_server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**EMBEDDED_ENVIRONMENT, **os.environ, **(storage_environment or {})},
        )
        try:
            assert server.stdout is not None
            _import_connect_client()  # while the server starts
            line = server.stdout.readline()
            if not line.strip().isdigit():
                raise RuntimeError(f"the embedded Sail server did not start (exit status {server.wait()})")
            spark = connect_session(f"sc://127.0.0.1:{int(line)}", config)
        except BaseException:
            _stop_server(server)
            raise
        set_engine_capabilities(spark, SAIL_CAPABILITIES)
        engine = cls(spark, server)
        engine.server_pid = server.pid
        return engine

    @classmethod
    def managed_spark(
        cls,
        config: Mapping[str, str] | None = None,
        master: str | None = None,
        *,
        storage_environment: Mapping[str, str] | None = None,
        keep_alive_s: int = 0,
    ) -> SparkEngine:
        """Start a Spark Connect server with Delta on ``local[N]`` (``resources.engines.spark_server``) and connect.

        ``config`` goes to the server (JVM settings such as ``spark.driver.memory`` can only be
        set there); ``master`` defaults to ``local[<cores>]``. ``storage_environment`` goes to the
        server's environment: object-store credentials reach the JVM there, not on its command line.
        ``keep_alive_s`` > 0: the server is kept for the runs after this one (``resources.engines.kept_spark``),
        started now only when none for the same settings answers; 0: this engine's own, stopped by close().
        """
        master = master or f"local[{len(os.sched_getaffinity(0))}]"
        if keep_alive_s > 0:
            return cls._kept_spark(master, managed_server_config(config), storage_environment or {}, keep_alive_s)
        request: dict[str, Any] = {"master": master, "config": managed_server_config(config, one_run=True)}
        began = time.monotonic()
        server = subprocess.Popen(
            [sys.executable, "-m", "resources.engines.spark_server", json.dumps(request)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **(storage_environment or {})},
        )
        try:
            assert server.stdout is not None and server.stderr is not None
            _import_connect_client()  # while the JVM starts
            fields = server.stdout.readline().split()
            if len(fields) != 2:
                reason = server.stderr.read().decode(errors="replace").strip() or f"exit status {server.wait()}"
                raise ConfigurationError(
                    f"the managed Spark engine did not start ({reason})",
                    "check Java 17 and access to Maven Central (or a filled $PGCDC_JAR_CACHE), "
                    "or use spark.engine: sail",
                )
            spark = connect_session(f"sc://127.0.0.1:{int(fields[0])}")
            if request["config"].get("spark.jars.packages") == DELTA_PACKAGE:  # Ivy resolved it: later starts skip Ivy
                remember_resolved_jars(spark.conf.get("spark.jars") or "")
        except BaseException:
            _stop_server(server)
            raise
        set_engine_capabilities(spark, DELTA_SPARK_CAPABILITIES)
        engine = cls(spark, server)
        engine.server_pid = int(fields[1])
        engine.start_note = (
            f"started a Spark JVM (pid {engine.server_pid}) for this run in {time.monotonic() - began:.1f} s; "
            "it stops with the run (spark.keep_alive_s: 0)"
        )
        return engine

    @classmethod
    def _kept_spark(
        cls, master: str, config: dict[str, str], storage_environment: Mapping[str, str], keep_alive_s: int
    ) -> SparkEngine:
        """Connect to the kept server for these settings, started now if none answers, under a lease
        the run holds until close()."""
        _import_connect_client()
        try:
            kept = attach(master, config, storage_environment, keep_alive_s)
        except RuntimeError as error:
            raise ConfigurationError(
                f"the managed Spark engine did not start ({error})",
                "check Java 17 and access to Maven Central (or a filled $PGCDC_JAR_CACHE), or use spark.engine: sail",
            ) from None
        try:
            spark = connect_session(kept.url)
            if kept.started_now and config.get("spark.jars.packages") == DELTA_PACKAGE:
                remember_resolved_jars(spark.conf.get("spark.jars") or "")
        except BaseException:
            kept.release()
            raise
        set_engine_capabilities(spark, DELTA_SPARK_CAPABILITIES)
        engine = cls(spark, kept=kept)
        engine.server_pid = kept.state.jvm_pid
        engine.start_note = kept.describe()
        return engine

    @classmethod
    def remote(cls, url: str, config: Mapping[str, str] | None = None) -> SparkEngine:
        """Connect to a running Spark Connect server (``sc://host:port``).

        The server is probed first, so an unreachable address is one line at once.
        """
        _probe_spark_connect(url)
        return cls(connect_session(url, config))

    def server_memory_mib(self) -> tuple[float, float]:
        """The embedded server's resident and peak resident memory (VmRSS, VmHWM); zeros without one."""
        if self._kept is not None:
            return process_memory_mib(self._kept.state.jvm_pid)
        return (0.0, 0.0) if self._server is None else process_memory_mib(self._server.pid)

    def close(self) -> None:
        """Stop the session, then the server pgcdc started. Stopping releases the session on the server,
        which refuses when the session never sent it a statement (a snapshot step written by delta-rs
        alone): an expected refusal, which the client would otherwise log as an ERROR."""
        try:
            with expected_refusal():
                self.spark.stop()
        finally:
            if self._server is not None:
                _stop_server(self._server)
                self._server = None
            if self._kept is not None:
                self._kept.release()
                self._kept = None

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
long-lived server would hold the footers of every file version it read: the cache is capped.
Sail's memory pool stays unbounded by default: a bounded one (``SAIL_RUNTIME__MEMORY_POOL__TYPE=fair``,
``..._FAIR__MAX_SIZE``) makes a snapshot's final sort spill (10M narrow rows: 395 MiB instead of
1.8 GiB) but failed a drain's sort with "Resources exhausted" at 256 MiB in the randomized test;
set it in pgcdc's environment where memory matters more (docs/engine-notes.md, "Snapshot memory")."""


def _import_connect_client() -> None:
    """Import PySpark's Spark Connect client, which :func:`connect_session` needs, while the engine's
    process starts: the imports took 0.5-2.2 s of a Dagster run's first engine start (a fresh
    process), as long as Sail's own start, and ran after it."""
    import pyspark.sql.connect.client  # noqa: F401
    import pyspark.sql.connect.session  # noqa: F401


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
    for stream in (server.stdout, server.stderr):
        if stream is not None:
            stream.close()


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
    """Spark configuration for a classic (in-process JVM) session with Delta; user settings win.

    The same settings as the managed engine: Delta's extension, catalog and pinned jars
    (through the jar cache), and the small-table settings.
    """
    return managed_server_config(user_config)


def classic_session_builder(app_name: str, user_config: Mapping[str, str] | None = None) -> SparkSession.Builder:
    """A classic session builder on ``local[<cores>]`` with Delta's jars (:data:`DELTA_PACKAGE`).

    A process that has created a Spark Connect session cannot build a classic one any more
    (PySpark: ``CONNECT_URL_NOT_SET``), so classic mode needs a process of its own.
    """
    builder = SparkSession.builder.appName(app_name).master(f"local[{len(os.sched_getaffinity(0))}]")
    return _with_config(builder, classic_delta_config(user_config))
