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
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import pyarrow as pa
from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema, from_arrow_type, to_arrow_schema

from resources.config import SparkSettings
from resources.engine_capabilities import engine_capabilities
from resources.errors import ConfigurationError
from resources.spark_connect import connect_session
from resources.spark_server import managed_server_config

OP_COLUMN = "_pgcdc_op"
"""Merge source column holding 'I', 'U' or 'D' for each change."""
UNCHANGED_PREFIX = "_pgcdc_unchanged_"
"""Merge source columns ``_pgcdc_unchanged_<col>``: True keeps the target's value (unchanged TOAST)."""
OLD_KEY_PREFIX = "_pgcdc_oldkey_"
"""Merge source columns ``_pgcdc_oldkey_<key>``: the row's key before a key-changing update, whose
target row supplies unchanged-TOAST values when the new key has no target row yet."""
STAGING_DIRECTORY = "_pgcdc_staging"
"""Inside a table directory; Delta readers and VACUUM ignore directories starting with '_'."""
DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
"""Arrow bytes sent per createDataFrame: bounds client memory and stays under Spark Connect's
local-relation cache threshold (64 MiB by default)."""


class SparkEngine:
    """A Spark session and, for an engine pgcdc runs itself (embedded Sail, managed Spark), the
    server process behind it; close() stops both. Every session is a Spark Connect session
    built by :func:`resources.spark_connect.connect_session`, except a classic in-process one."""

    def __init__(self, spark: SparkSession, server: subprocess.Popen[bytes] | None = None) -> None:
        self.spark = spark
        self._server = server
        self.server_pid: int | None = None
        """The engine's own process (Sail's server or the Spark JVM) when pgcdc started it."""

    @classmethod
    def from_config(cls, spark: SparkSettings) -> SparkEngine:
        """The engine ``spark:`` in the pgcdc configuration names: ``remote`` when set, else
        ``engine`` (embedded Sail or a managed Spark with Delta)."""
        if spark.remote:
            return cls.remote(spark.remote, spark.config)
        if spark.engine == "spark":
            return cls.managed_spark(spark.config)
        return cls.embedded(spark.config)

    @classmethod
    def embedded(cls, config: Mapping[str, str] | None = None) -> SparkEngine:
        """Start Sail in a child process (``resources.sail_server``) on a free loopback port and connect."""
        server = subprocess.Popen(
            [sys.executable, "-m", "resources.sail_server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**EMBEDDED_ENVIRONMENT, **os.environ},
        )
        try:
            assert server.stdout is not None
            line = server.stdout.readline()
            if not line.strip().isdigit():
                raise RuntimeError(f"the embedded Sail server did not start (exit status {server.wait()})")
            spark = connect_session(f"sc://127.0.0.1:{int(line)}", config)
        except BaseException:
            _stop_server(server)
            raise
        engine = cls(spark, server)
        engine.server_pid = server.pid
        return engine

    @classmethod
    def managed_spark(cls, config: Mapping[str, str] | None = None, master: str | None = None) -> SparkEngine:
        """Start a Spark Connect server with Delta on ``local[N]`` (``resources.spark_server``) and connect.

        ``config`` goes to the server (JVM settings such as ``spark.driver.memory`` can only be
        set there); ``master`` defaults to ``local[<cores>]``.
        """
        request = {"master": master or f"local[{len(os.sched_getaffinity(0))}]",
                   "config": managed_server_config(config)}
        server = subprocess.Popen(
            [sys.executable, "-m", "resources.spark_server", json.dumps(request)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            assert server.stdout is not None and server.stderr is not None
            fields = server.stdout.readline().split()
            if len(fields) != 2:
                reason = server.stderr.read().decode(errors="replace").strip() or f"exit status {server.wait()}"
                raise ConfigurationError(
                    f"the managed Spark engine did not start ({reason})",
                    "check Java 17 and access to Maven Central (or a filled $PGCDC_JAR_CACHE), "
                    "or use spark.engine: sail",
                )
            spark = connect_session(f"sc://127.0.0.1:{int(fields[0])}")
        except BaseException:
            _stop_server(server)
            raise
        engine = cls(spark, server)
        engine.server_pid = int(fields[1])
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


def nullable_schema(schema: pa.Schema) -> pa.Schema:
    """Every Delta column pgcdc writes is nullable.

    Sail 0.7.2 silently ignores ``mergeSchema`` on a table with a NOT NULL column, so
    columns could never be added; and a source dropping NOT NULL later would need an
    ALTER that Sail lacks. PostgreSQL already enforces the constraint upstream.
    """
    return pa.schema([field.with_nullable(True) for field in schema])


def spark_dataframe(spark: SparkSession, table: pa.Table) -> DataFrame:
    """Arrow to Spark without Python rows, keeping naive timestamps as timestamp_ntz."""
    table = table.cast(nullable_schema(table.schema))
    return spark.createDataFrame(table, schema=from_arrow_schema(table.schema, prefer_timestamp_ntz=True))


def _chunks(
    data: pa.Table | Iterable[pa.RecordBatch], schema: pa.Schema, chunk_bytes: int, min_bytes: int | None = None
) -> Iterator[pa.Table]:
    """Regroup batches into tables of at least ``min_bytes`` (default ``chunk_bytes``), slicing
    batches larger than ``chunk_bytes``; always yields at least one."""
    batches = data.to_batches() if isinstance(data, pa.Table) else data
    least = chunk_bytes if min_bytes is None else min(min_bytes, chunk_bytes)
    pending: list[pa.RecordBatch] = []
    pending_bytes = 0
    yielded = False
    for batch in batches:
        for piece in _slices(batch, chunk_bytes):
            pending.append(piece)
            pending_bytes += piece.nbytes
            if pending_bytes >= least:
                yield pa.Table.from_batches(pending, schema)
                yielded = True
                pending, pending_bytes = [], 0
    if pending or not yielded:
        yield pa.Table.from_batches(pending, schema)


def _slices(batch: pa.RecordBatch, chunk_bytes: int) -> Iterator[pa.RecordBatch]:
    """Zero-copy slices of at most about ``chunk_bytes``, so one huge batch cannot defeat the bound."""
    if batch.nbytes <= chunk_bytes or batch.num_rows <= 1:
        yield batch
        return
    rows_per_slice = max(1, batch.num_rows * chunk_bytes // batch.nbytes)
    for start in range(0, batch.num_rows, rows_per_slice):
        yield batch.slice(start, rows_per_slice)


SHIP_BYTES = 16 * 1024 * 1024
"""Most Arrow bytes per temporary view a snapshot ships to the server while the source is
still being read (and at most ``chunk_bytes``); smaller batches are gathered to
:data:`SHIP_MIN_BYTES` first, so a table of many small batches does not cost a round trip each."""
SHIP_MIN_BYTES = 4 * 1024 * 1024


def write_snapshot(
    spark: SparkSession,
    data: pa.Table | Iterable[pa.RecordBatch],
    schema: pa.Schema,
    path: str,
    user_metadata: str,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> int:
    """Replace the table at ``path`` with ``data`` in one commit; return that commit's version.

    Readers see the old table or the whole new one, never a prefix. Batches are shipped to
    the server as they arrive, each piece (at most :data:`SHIP_BYTES`) as a temporary view,
    so the transfer overlaps with whatever produces ``data``. A snapshot whose views fit in
    one chunk is written directly from their union; a larger one is appended chunk by chunk
    (a union of views each) to a staging table inside ``path`` and then copied over in a
    single overwrite. Memory stays bounded by ``chunk_bytes`` (held by the server, as views,
    until their chunk is written) and a crash leaves only staging debris. The one commit
    carries ``user_metadata`` (e.g. the snapshot LSN), so the marker cannot exist without
    the data.
    """
    pieces = _chunks(data, schema, max(1, min(chunk_bytes, SHIP_BYTES)), SHIP_MIN_BYTES)
    staging: str | None = None
    pending: list[str] = []  # views shipped but not yet written
    pending_bytes = 0
    try:
        for piece in pieces:
            if pending and pending_bytes >= chunk_bytes:
                staging = _write_staged(spark, pending, path, staging)
                _drop_views(spark, pending)
                pending_bytes = 0
            view = f"pgcdc_snapshot_{uuid.uuid4().hex}"
            spark_dataframe(spark, piece).createOrReplaceTempView(view)
            pending.append(view)
            pending_bytes += piece.nbytes
        if staging is None:
            _overwrite(_union(spark, pending), path, user_metadata)
        else:
            _write_staged(spark, pending, path, staging)
            _drop_views(spark, pending)
            _overwrite(spark.read.format("delta").load(staging), path, user_metadata)
            _remove_local(staging)
    finally:
        try:
            _drop_views(spark, pending)
        except Exception:  # noqa: BLE001 - the session is gone; its views went with it
            pass
    return _version_with_metadata(spark, path, user_metadata)


def _union(spark: SparkSession, views: Sequence[str]) -> DataFrame:
    frames = [spark.table(view) for view in views]
    union = frames[0]
    for frame in frames[1:]:
        union = union.unionAll(frame)
    return union


def _write_staged(spark: SparkSession, views: Sequence[str], path: str, staging: str | None) -> str:
    """Append the views to the staging table (created by the first call); return its path."""
    if staging is None:
        staging = f"{path.rstrip('/')}/{STAGING_DIRECTORY}/{uuid.uuid4().hex}"
        _overwrite(_union(spark, views), staging, None)
    else:
        _append(_union(spark, views), staging)
    return staging


def _drop_views(spark: SparkSession, views: list[str]) -> None:
    """Drop the views (the server frees their data) and empty the list."""
    while views:
        spark.catalog.dropTempView(views[-1])
        views.pop()


def _overwrite(frame: DataFrame, path: str, user_metadata: str | None) -> None:
    writer = frame.write.format("delta").mode("overwrite").option("overwriteSchema", "true")
    if user_metadata is not None:
        writer = writer.option("userMetadata", user_metadata)
    writer.save(path)


def _append(frame: DataFrame, path: str) -> None:
    frame.write.format("delta").mode("append").save(path)


def _remove_local(staging: str) -> None:
    """Staging data is useless once written over; object-store paths are left to lifecycle rules,
    since Spark offers no portable way to delete files."""
    local = staging.removeprefix("file://")
    if "://" not in local:
        shutil.rmtree(local, ignore_errors=True)
        try:
            Path(local).parent.rmdir()  # the staging directory, unless another write uses it
        except OSError:
            pass


@dataclass(frozen=True, slots=True)
class CommitRecord:
    """One Delta commit as recorded in ``_delta_log``."""

    version: int
    timestamp_ms: int
    operation: str
    user_metadata: str | None


_COMMIT_INFO_SCHEMA = "commitInfo STRUCT<timestamp: BIGINT, operation: STRING, userMetadata: STRING>"


def read_commit_metadata(spark: SparkSession, path: str, limit: int | None = None) -> list[CommitRecord]:
    """Commits of the table at ``path``, newest first, read from its log through the engine.

    Commits removed by log cleanup (after a checkpoint and ``delta.logRetentionDuration``)
    are gone; keep that retention longer than the longest a table may sit idle. Delta on
    Spark reads them with ``DESCRIBE HISTORY`` (the capability seam); other engines scan the
    log's JSON files: the same records.
    """
    if engine_capabilities(spark).delta_commands:
        try:
            history = spark.sql(f"DESCRIBE HISTORY delta.{_quote(path)}" + (f" LIMIT {int(limit)}" if limit else ""))
        except AnalysisException as error:
            if error.getCondition() == "DELTA_TABLE_ONLY_OPERATION":  # no table (yet): no commits, as the log scan says
                return []
            raise
        return [
            CommitRecord(row["version"], row["timestamp_ms"], row["operation"], row["userMetadata"])
            for row in history.select(
                "version", F.unix_millis("timestamp").alias("timestamp_ms"), "operation", "userMetadata"
            ).orderBy(F.desc("version")).collect()
        ]
    commits = (
        spark.read.format("binaryFile")
        .option("pathGlobFilter", "*.json")
        .load(f"{path.rstrip('/')}/_delta_log")
        .select(
            F.regexp_extract("path", r"(\d+)\.json$", 1).cast("bigint").alias("version"),
            F.explode(F.split(F.col("content").cast("string"), "\n")).alias("line"),
        )
        .where(F.col("line").startswith('{"commitInfo"'))
        .select("version", F.from_json("line", _COMMIT_INFO_SCHEMA).alias("action"))
        .select("version", "action.commitInfo.*")
        .orderBy(F.desc("version"))
    )
    if limit is not None:
        commits = commits.limit(limit)
    return [
        CommitRecord(row["version"], row["timestamp"], row["operation"], row["userMetadata"])
        for row in commits.collect()
    ]


def _version_with_metadata(spark: SparkSession, path: str, user_metadata: str) -> int:
    """Our commit's version, found by its marker so a concurrent writer cannot be mistaken for it."""
    for commit in read_commit_metadata(spark, path):
        if commit.user_metadata == user_metadata:
            return commit.version
    raise RuntimeError(f"no commit with userMetadata {user_metadata!r} in {path}")


def unchanged_flag_column(column: str) -> str:
    return f"{UNCHANGED_PREFIX}{column}"


def _quote(identifier: str) -> str:
    return "`" + identifier.replace("`", "``") + "`"


def merge_batch(
    spark: SparkSession,
    path: str,
    source: pa.Table,
    key_columns: Sequence[str],
) -> None:
    """Apply one batch of changes, at most one per key, with a single MERGE.

    ``source`` holds the row values, :data:`OP_COLUMN` and optional boolean
    ``_pgcdc_unchanged_<col>`` columns: where True, an update keeps the target's value
    (PostgreSQL does not resend unchanged TOASTed values). With ``_pgcdc_oldkey_<key>``
    columns, such a row that finds no target under its (new) key is inserted with the
    values of the target row under its old key instead.
    The MERGE rejects two changes for one key, so callers fold a batch per key first.

    The source is staged as Parquet (:func:`_merge_source`) rather than shipped as a view:
    the engine builds its join's hash table from the side that looks smaller, and it sizes
    a file scan by its compressed bytes but an in-memory relation by its Arrow bytes. A view
    of a few tens of thousands of rows already "looks" bigger than a compressed table of
    millions, and then Sail hashes the whole target table (three times: its MERGE plan runs
    the join once for inserts, once for rewritten files and once for removes), so memory
    grows with the table instead of the batch and the MERGE takes about twice as long
    (measured in docs/engine-notes.md).
    """
    value_columns = [
        name
        for name in source.column_names
        if name != OP_COLUMN and not name.startswith(UNCHANGED_PREFIX) and not name.startswith(OLD_KEY_PREFIX)
    ]
    flags = {name for name in source.column_names if name.startswith(UNCHANGED_PREFIX)}
    old_keys = [name for name in source.column_names if name.startswith(OLD_KEY_PREFIX)]
    staged = _merge_source(path)
    spark_dataframe(spark, source).write.mode("overwrite").parquet(staged)
    staged_source = f"parquet.{_quote(staged)}"
    target = f"delta.{_quote(path)}"
    kept = [name for name in value_columns if unchanged_flag_column(name) in flags]
    if old_keys and kept:
        # A key-changing update that kept TOAST values: the row under the old key holds them.
        join = " AND ".join(f"o.{_quote(name.removeprefix(OLD_KEY_PREFIX))} = s.{_quote(name)}" for name in old_keys)
        carried = ", ".join(f"o.{_quote(name)} AS {_quote(_carried(name))}" for name in kept)
        using = f"(SELECT s.*, {carried} FROM {staged_source} s LEFT JOIN {target} o ON {join})"
    else:
        using = staged_source
    on = " AND ".join(f"t.{_quote(key)} = s.{_quote(key)}" for key in key_columns)
    updates = ", ".join(
        f"{_quote(name)} = "
        + (
            f"CASE WHEN s.{_quote(unchanged_flag_column(name))} THEN t.{_quote(name)} ELSE s.{_quote(name)} END"
            if name in kept
            else f"s.{_quote(name)}"
        )
        for name in value_columns
        if name not in key_columns
    )
    insert_columns = ", ".join(_quote(name) for name in value_columns)
    insert_values = ", ".join(
        f"CASE WHEN s.{_quote(unchanged_flag_column(name))} THEN s.{_quote(_carried(name))} ELSE s.{_quote(name)} END"
        if name in kept and using != staged_source
        else f"s.{_quote(name)}"
        for name in value_columns
    )
    matched_update = f"WHEN MATCHED THEN UPDATE SET {updates}" if updates else ""
    try:
        spark.sql(
            f"MERGE INTO {target} t USING {using} s ON {on} "
            f"WHEN MATCHED AND s.{OP_COLUMN} = 'D' THEN DELETE "
            f"{matched_update} "
            f"WHEN NOT MATCHED AND s.{OP_COLUMN} <> 'D' THEN INSERT ({insert_columns}) VALUES ({insert_values})"
        ).collect()
    finally:
        _remove_local(staged)


def _merge_source(path: str) -> str:
    """Where :func:`merge_batch` stages its source: one directory per table, overwritten by
    every MERGE, so even where it cannot be removed (object stores) it holds one batch at most."""
    return f"{path.rstrip('/')}/{STAGING_DIRECTORY}/merge_source"


def _carried(column: str) -> str:
    return f"_pgcdc_carried_{column}"


def replace_rows(
    spark: SparkSession,
    path: str,
    probe: pa.Table,
    rewrite: Callable[[pa.Table], pa.Table],
    user_metadata: str,
) -> None:
    """Rewrite, in one commit carrying ``user_metadata``, every row that may equal a row of
    ``probe`` (typed values of some of the table's columns): ``rewrite`` gets those rows (all
    columns, as Arrow) and returns the rows to put in their place.

    The rows are selected by ``xxhash64`` over ``probe``'s columns, the engine's own hash, so
    every row equal to a probe row is selected (and a few others, on a hash collision, which
    ``rewrite`` hands back unchanged). The selection is a literal ``IN`` list usable as the
    ``replaceWhere`` predicate of an overwrite, the one write that removes rows and carries
    ``userMetadata``: read and replaced rows are the same set, and readers see the old rows or
    the new ones. Sail 0.7.2 refuses a subquery there and plans about 0.2 ms per listed value,
    so callers keep ``probe`` to a few thousand rows.

    The written rows go through a union with the (empty) table scan: Sail's replaceWhere unions
    the new rows with the kept rows of rewritten files as they are stored, and refuses a
    difference in type details a scan irons out (a list's element name, a timestamp's time zone
    name).
    """
    scan = spark.read.format("delta").load(path)
    columns = [F.col(_quote(name)) for name in probe.column_names]
    probed = scan.select(*columns).where(F.lit(False)).unionByName(spark_dataframe(spark, probe))
    hashes = probed.select(F.xxhash64(*columns).alias("hash")).distinct().toArrow().column("hash").to_pylist()
    predicate = (
        f"xxhash64({', '.join(_quote(name) for name in probe.column_names)}) IN ({', '.join(map(str, sorted(hashes)))})"
    )
    replacement = rewrite(scan.where(predicate).toArrow())
    (
        scan.where(F.lit(False))
        .unionByName(spark_dataframe(spark, replacement))
        .write.format("delta")
        .mode("overwrite")
        .option("replaceWhere", predicate)
        .option("userMetadata", user_metadata)
        .save(path)
    )


def append_rows(spark: SparkSession, path: str, rows: pa.Table, user_metadata: str) -> None:
    """Append ``rows`` in one commit carrying ``user_metadata`` (the keyless tables' progress marker)."""
    spark_dataframe(spark, rows).write.format("delta").mode("append").option("userMetadata", user_metadata).save(path)


def table_schema(spark: SparkSession, path: str) -> pa.Schema:
    """The Delta table's current schema, as Arrow."""
    return to_arrow_schema(spark.read.format("delta").load(path).schema)


def widen_columns(spark: SparkSession, path: str, widened: Mapping[str, pa.DataType]) -> None:
    """Rewrite the table with some columns cast to wider types, in one overwrite commit.

    Neither Sail nor open-source Delta without the type-widening feature can ALTER a
    column's type, so the table is rewritten; readers see the old or the new table whole.
    """
    frame = spark.read.format("delta").load(path)
    schema = to_arrow_schema(frame.schema)
    columns = [
        F.col(_quote(field.name)).cast(from_arrow_type(widened[field.name])).alias(field.name)
        if field.name in widened
        else F.col(_quote(field.name))
        for field in schema
    ]
    frame.select(*columns).write.format("delta").mode("overwrite").option("overwriteSchema", "true").save(path)


def add_columns(spark: SparkSession, path: str, new_columns: pa.Schema) -> None:
    """Add nullable columns to the table, committing the schema alone.

    Sail has no ``ALTER TABLE ... ADD COLUMNS``; an append of an empty Arrow frame with the
    widened schema commits the new schema (an empty list or query result commits nothing there),
    and Delta on a JVM Spark accepts it the same way. Where the engine has Delta's commands
    (the capability seam) the ALTER commits the same schema without a write job.
    """
    if engine_capabilities(spark).delta_commands:
        columns = ", ".join(
            f"{_quote(field.name)} {from_arrow_type(field.type, prefer_timestamp_ntz=True).simpleString()}"
            for field in new_columns
        )
        spark.sql(f"ALTER TABLE delta.{_quote(path)} ADD COLUMNS ({columns})").collect()
        return
    existing = to_arrow_schema(spark.read.format("delta").load(path).schema)
    frame = spark_dataframe(spark, pa.schema([*existing, *new_columns]).empty_table())
    frame.write.format("delta").mode("append").option("mergeSchema", "true").save(path)


def fill_columns(spark: SparkSession, path: str, values: pa.Table, lsn_column: str, up_to_lsn: int) -> None:
    """Set each column of the one-row ``values`` to its value in every row whose ``lsn_column``
    is at most ``up_to_lsn``, adding the columns the table lacks (NULL in the other rows).

    One overwrite commit, so the new columns never exist without their values. Sail has
    neither ALTER TABLE nor UPDATE; this is a rewrite of the table, like :func:`widen_columns`.
    """
    frame = spark.read.format("delta").load(path)
    existing = to_arrow_schema(frame.schema)
    lsn_column_le = F.col(_quote(lsn_column)) <= F.lit(int(up_to_lsn))
    if frame.where(lsn_column_le).limit(1).count() == 0:  # nothing to fill (an empty query result commits no schema)
        missing = [field for field in values.schema if field.name not in existing.names]
        if missing:
            add_columns(spark, path, pa.schema(missing))
        return
    fill_names = {name: f"_pgcdc_fill_{i}" for i, name in enumerate(values.column_names)}
    fill = spark_dataframe(spark, values.rename_columns([fill_names[name] for name in values.column_names]))
    joined = frame.crossJoin(fill)
    columns = [
        F.when(lsn_column_le, F.col(fill_names[field.name])).otherwise(F.col(_quote(field.name))).alias(field.name)
        if field.name in fill_names
        else F.col(_quote(field.name))
        for field in existing
    ]
    columns += [
        F.when(lsn_column_le, F.col(fill_names[name])).alias(name) for name in values.column_names if name not in existing.names
    ]
    joined.select(*columns).write.format("delta").mode("overwrite").option("overwriteSchema", "true").save(path)


def delete_all_rows(spark: SparkSession, path: str) -> None:
    """Empty the table keeping its schema and history (Sail has no TRUNCATE TABLE)."""
    spark.sql(f"DELETE FROM delta.{_quote(path)}").collect()
