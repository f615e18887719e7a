"""Initial snapshot of published tables into Delta, the way PostgreSQL's own table sync does it.

Per table, on a replication connection of its own (trace in ``/work/shared/seeds/001_*``):
``BEGIN READ ONLY ISOLATION LEVEL REPEATABLE READ``, then a *temporary* slot created with
``SNAPSHOT 'use'``, which makes the transaction's snapshot exactly the slot's consistent
point; the COPY inside it therefore holds every change committed before that LSN and none
after. The consistent point becomes the table's snapshot LSN: incremental runs, reading the
permanent slot (created earlier, so positioned at or before every table's point), skip the
table's changes up to it.

The permanent slot exists before any table is copied (:func:`ensure_slot`) so that no change
committed after a table's snapshot can fall into a gap between the copy and the stream.

Memory stays bounded whatever the table size: COPY rows are gathered into pieces of at most
``chunk_bytes`` / ``chunk_rows`` on a reader thread, parsed on a second thread by Arrow's C++ CSV
reader (typed directly where it can, otherwise converted column-wise by ``resources.pgtypes``),
and shipped to Spark on the caller's thread while the next pieces are read and parsed (queues of
:data:`PREFETCH_PIECES` pieces decouple the three).
"""

from __future__ import annotations

import json
import queue
import re
import secrets
import select
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TypeVar

import psycopg
import pyarrow as pa
import pyarrow.csv as pa_csv
from psycopg import pq
from pyspark.errors import AnalysisException
from pyspark.sql import SparkSession

from resources.catalog import (
    TableInfo,
    TableName,
    publication_exists,
    quote_ident,
    read_table,
    resolve_tables,
    table_oid,
)
from resources.config import PgcdcConfig
from resources.connections import connect
from resources.delta_engine import DEFAULT_CHUNK_BYTES, read_commit_metadata, write_snapshot
from resources.errors import ConfigurationError, ConnectionFailure, PgcdcError, ProtocolError, SlotError, explain
from resources.lake_storage import open_lake
from resources.lsn import LSN
from resources.pgtypes import (
    SESSION_SETTINGS,
    PgColumnType,
    PgValueError,
    arrow_schema,
    column_type_from_catalog,
    csv_direct_type,
    pg_type_catalog_params,
    pg_type_catalog_query,
    spark_ddl_type,
    to_arrow,
)
from resources.replication import CreatedSlot, ReplicationConnection, SlotState
from resources.spark_connect import reports_dead_engine

__all__ = [
    "EXPIRED_SNAPSHOT_LSN",
    "LSN_COLUMN",
    "SnapshotError",
    "SnapshotProgress",
    "SnapshotResult",
    "ensure_publication",
    "ensure_slot",
    "read_snapshot_lsn",
    "snapshot_table",
    "snapshot_tables",
]

LSN_COLUMN = "_pgcdc_lsn"
"""Delta column holding the LSN that last wrote the row: the snapshot LSN for copied rows."""
DEFAULT_CHUNK_ROWS = 1_000_000
"""Rows per parsed piece; the byte bound usually closes a piece first."""
PARSE_BYTES = 16 * 1024 * 1024
"""CSV bytes per parsed piece (unless ``chunk_bytes`` is smaller): small enough to overlap
reading PostgreSQL with writing Spark, large enough that per-piece overhead is noise."""
PREFETCH_PIECES = 2
"""Parsed pieces waiting for the writer; with the piece being parsed and the chunk being
written this bounds memory to a few chunks."""
_POLL_SECONDS = 1.0
T = TypeVar("T")


class SnapshotError(PgcdcError):
    """A table could not be copied: a value the mapping refuses, or the Delta write failed."""


@dataclass(frozen=True, slots=True)
class SnapshotProgress:
    """Reported after each piece handed to the writer, so long copies show life and speed."""

    table: TableName
    rows: int
    bytes: int  # CSV bytes received from PostgreSQL so far
    elapsed_s: float

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class SnapshotResult:
    """One table's finished snapshot: what Dagster records as materialization metadata."""

    table: TableName
    snapshot_lsn: LSN
    rows: int
    path: str
    delta_version: int
    duration_s: float
    columns: list[tuple[str, str, str]]  # (name, PostgreSQL type, Delta type) of the published columns

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.duration_s if self.duration_s > 0 else 0.0


# --------------------------------------------------------------------------- publication and slot


def ensure_publication(config: PgcdcConfig) -> list[TableName]:
    """Make sure the publication exists and covers the configured tables; return the tables to replicate.

    A publication pgcdc creates publishes partitioned tables via their root, so one Delta
    table per configured (root) table receives the changes of all its partitions.
    """
    publication = config.publication
    configured = [TableName.parse(name) for name in config.tables]
    try:
        with connect(config.postgres.dsn, application_name="pgcdc") as conn:
            if not publication_exists(conn, publication):
                if not config.create_publication:
                    raise ConfigurationError(
                        f'publication "{publication}" does not exist',
                        f"run CREATE PUBLICATION {quote_ident(publication)} FOR TABLE ... "
                        "or set create_publication: true",
                    )
                if not configured:
                    raise ConfigurationError(
                        f'create_publication is true but no tables are configured for "{publication}"',
                        "list the tables to publish under 'tables'",
                    )
                _create_publication(conn, publication, configured)
            return resolve_tables(conn, publication, config.tables)
    except psycopg.Error as exc:
        raise explain(exc, config.postgres.dsn) from None


def _create_publication(conn: psycopg.Connection, publication: str, tables: Sequence[TableName]) -> None:
    try:
        conn.execute(
            f"CREATE PUBLICATION {quote_ident(publication)} FOR TABLE {', '.join(t.quoted for t in tables)}"
            " WITH (publish_via_partition_root = true)"
        )
    except psycopg.errors.UndefinedTable as exc:
        raise ConfigurationError(
            f'cannot create publication "{publication}": {exc.diag.message_primary}',
            "create the table or fix its name in 'tables'",
        ) from None
    except psycopg.errors.DuplicateObject:
        pass  # created concurrently by another run: use it as it is


def ensure_slot(dsn: str, slot: str) -> CreatedSlot | SlotState:
    """Create the permanent pgoutput slot if missing; refuse one that cannot serve pgcdc.

    Run before any table is copied: every table's snapshot LSN is then at or after the
    slot's start, so the stream covers every change a snapshot misses.
    """
    with ReplicationConnection(dsn, application_name="pgcdc") as conn:
        state = conn.read_slot(slot)
        if state is None:
            return conn.create_slot(slot, snapshot="nothing")
        (database,), = conn.execute("SELECT pg_catalog.current_database()::pg_catalog.text")
    if state.slot_type != "logical":
        raise SlotError(
            f'replication slot "{slot}" is a physical slot',
            "choose another slot name in 'slot' (pgcdc needs a logical pgoutput slot)",
        )
    if state.database != database:
        raise SlotError(
            f'replication slot "{slot}" belongs to database "{state.database}", not "{database}"',
            "choose another slot name in 'slot' or point the DSN at that database",
        )
    if state.plugin != "pgoutput":
        raise SlotError(
            f'replication slot "{slot}" uses output plugin {state.plugin}, not pgoutput',
            "choose another slot name in 'slot', or drop that slot if nothing else uses it",
        )
    if state.temporary:
        raise SlotError(
            f'replication slot "{slot}" is a temporary slot of another session',
            "choose another slot name in 'slot'",
        )
    if state.wal_status == "lost" or state.invalidation_reason is not None:
        why = f", {state.invalidation_reason}" if state.invalidation_reason else ""
        reason = f"wal_status {state.wal_status}{why}"
        raise SlotError(
            f'replication slot "{slot}" is invalidated ({reason}): changes since its position are gone',
            f"drop it (SELECT pg_drop_replication_slot('{slot}')) and run the snapshot again, "
            "which recreates it and copies every table afresh",
        )
    return state


# --------------------------------------------------------------------------- one table


def snapshot_table(
    dsn: str,
    publication: str,
    table: TableName,
    spark: SparkSession,
    path: str,
    *,
    slot: str,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    on_progress: Callable[[SnapshotProgress], None] | None = None,
) -> SnapshotResult:
    """Copy what ``publication`` publishes of ``table`` into the Delta table at ``path``.

    One atomic Delta commit carrying the snapshot marker (docs/contracts.md) replaces the
    table. ``slot`` is the permanent slot the marker names; create it first
    (:func:`ensure_slot`). ``chunk_bytes`` bounds each Spark write and each parsed piece,
    ``chunk_rows`` each parsed piece. ``on_progress`` runs on the calling thread.
    """
    started = time.monotonic()
    try:
        return _snapshot_table(
            dsn, publication, table, spark, path, slot, max(1, chunk_rows), max(1, chunk_bytes), on_progress, started
        )
    except PgcdcError as exc:
        raise _naming_table(exc, table) from exc
    except PgValueError as exc:
        raise SnapshotError(
            f"cannot snapshot {table}: {exc}", "replicate that column as text or fix the value in PostgreSQL"
        ) from exc
    except psycopg.Error as exc:
        raise _naming_table(explain(exc, dsn), table) from exc
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SnapshotError(
            f"cannot snapshot {table} into {path}: {first_line}",
            "check the Spark engine and the Delta location, then run the snapshot again",
        ) from exc


def _naming_table(exc: PgcdcError, table: TableName) -> PgcdcError:
    if str(table) in exc.cause:
        return exc
    try:
        return type(exc)(f"{table}: {exc.cause}", exc.fix)
    except TypeError:  # a subclass with another constructor
        return SnapshotError(f"{table}: {exc.cause}", exc.fix)


def _snapshot_table(
    dsn: str,
    publication: str,
    table: TableName,
    spark: SparkSession,
    path: str,
    slot: str,
    chunk_rows: int,
    chunk_bytes: int,
    on_progress: Callable[[SnapshotProgress], None] | None,
    started: float,
) -> SnapshotResult:
    with ReplicationConnection(dsn, application_name="pgcdc_snapshot", session_settings=SESSION_SETTINGS) as conn:
        # The slot name wants the table's oid, and SNAPSHOT 'use' must be the transaction's
        # first command: look it up before BEGIN.
        temp_slot = f"pgcdc_sync_{table_oid(conn.connection, table)}_{secrets.token_hex(6)}"
        conn.begin_snapshot_transaction()
        created = conn.create_slot(temp_slot, temporary=True, snapshot="use")
        snapshot_lsn = created.consistent_point
        info = read_table(conn.connection, publication, table)
        columns = _column_types(conn, info)
        schema = arrow_schema(columns).append(pa.field(LSN_COLUMN, pa.int64()))
        marker = json.dumps(
            {"pgcdc": {"kind": "snapshot", "snapshot_lsn": str(snapshot_lsn), "slot": slot, "table": str(table)}}
        )
        counted = {"rows": 0, "bytes": 0}

        def copied() -> None:
            """The COPY is complete: end the transaction and free the slot before Spark finishes."""
            conn.commit()
            conn.drop_slot(temp_slot)

        def pieces() -> Iterator[pa.RecordBatch]:
            parse = _PieceParser(columns, schema, snapshot_lsn)
            piece_bytes = min(chunk_bytes, PARSE_BYTES)
            source = _copy_pieces(conn.pgconn, info.copy_query(), _unparsed, piece_bytes, chunk_rows)
            copied_pieces = _prefetched(source, PREFETCH_PIECES, f"pgcdc-copy-{table}")
            prefetch = _prefetched(_parse_each(copied_pieces, parse), PREFETCH_PIECES, f"pgcdc-parse-{table}")
            try:
                for batch, nbytes in prefetch:
                    counted["rows"] += batch.num_rows
                    counted["bytes"] += nbytes
                    if on_progress is not None:
                        elapsed = time.monotonic() - started
                        on_progress(SnapshotProgress(table, counted["rows"], counted["bytes"], elapsed))
                    yield batch
            finally:
                prefetch.close()  # stops the reader thread before the connection closes
            copied()

        stream = pieces()
        try:
            version = write_snapshot(spark, stream, schema, path, marker, chunk_bytes=chunk_bytes)
        finally:
            stream.close()
    return SnapshotResult(
        table=table,
        snapshot_lsn=snapshot_lsn,
        rows=counted["rows"],
        path=path,
        delta_version=version,
        duration_s=time.monotonic() - started,
        columns=[(col.column, col.type_name, spark_ddl_type(col)) for col in columns],
    )




def _column_types(conn: ReplicationConnection, info: TableInfo) -> list[PgColumnType]:
    if not info.columns:
        raise ConfigurationError(f"table {info.table} has no published columns", "publish at least one column")
    rows = psycopg.ClientCursor(conn.connection).execute(
        pg_type_catalog_query(), pg_type_catalog_params((c.type_oid, c.type_modifier) for c in info.columns)
    ).fetchall()
    return [column_type_from_catalog(column.name, row) for column, row in zip(info.columns, rows, strict=True)]


# --------------------------------------------------------------------------- COPY -> Arrow


class _PieceParser:
    """PostgreSQL CSV rows -> one typed Arrow batch with the snapshot LSN column.

    In PostgreSQL's CSV a NULL is an unquoted empty field and an empty string is ``""``;
    the options below keep that distinction and keep empty lines (the NULL row of a
    one-column table). Each piece is parsed as a single block sized to it, so a row of any
    size (TOASTed values up to 1 GB) never straddles blocks.

    Columns whose PostgreSQL text Arrow's CSV converter parses exactly like ``to_arrow``
    (integers, floats, numeric(p,s), bool, date, timestamps: ``pgtypes.csv_direct_type``)
    are typed by the CSV reader itself, with no string column in between. A value it
    refuses (timestamp ``infinity``, numeric ``NaN``, a BC date) makes that column, from
    then on, text converted by ``to_arrow``, which maps the value or raises the mapping's
    error; the piece is parsed again. Everything else is read as text for ``to_arrow``.
    """

    def __init__(self, columns: Sequence[PgColumnType], schema: pa.Schema, snapshot_lsn: LSN) -> None:
        self._columns = list(columns)
        self._schema = schema
        self._names = [f"c{i}" for i in range(len(columns))]
        self._direct: list[pa.DataType | None] = [csv_direct_type(col) for col in self._columns]
        self._parse_options = pa_csv.ParseOptions(newlines_in_values=True, ignore_empty_lines=False)
        self._lsn_bytes = struct.pack("<q", int(snapshot_lsn))

    def _convert_options(self) -> pa_csv.ConvertOptions:
        return pa_csv.ConvertOptions(
            column_types={
                name: pa.string() if direct is None else direct for name, direct in zip(self._names, self._direct)
            },
            null_values=[""],
            true_values=["t"],
            false_values=["f"],
            strings_can_be_null=True,
            quoted_strings_can_be_null=False,
        )

    def _read(self, data: bytearray) -> pa.Table:
        read_options = pa_csv.ReadOptions(column_names=self._names, block_size=len(data) + 1, use_threads=False)
        while True:
            try:
                return pa_csv.read_csv(pa.py_buffer(data), read_options, self._parse_options, self._convert_options())
            except pa.ArrowInvalid as exc:
                failed = _failed_csv_column(str(exc))
                if failed is None or failed >= len(self._direct) or self._direct[failed] is None:
                    if not any(direct is not None for direct in self._direct):
                        raise
                    self._direct = [None] * len(self._direct)  # not a conversion error: all as text
                else:
                    self._direct[failed] = None

    def __call__(self, data: bytearray, rows: int) -> pa.RecordBatch:
        if rows == 0:  # Arrow's reader refuses an empty document
            return pa.RecordBatch.from_pylist([], schema=self._schema)
        parsed = self._read(data)
        if parsed.num_rows != rows:
            raise ProtocolError(
                f"COPY sent {rows} rows but {parsed.num_rows} parsed", "report this with the table definition"
            )
        arrays = [
            to_arrow(parsed.column(i), col) if direct is None else _single_chunk(parsed.column(i))
            for i, (col, direct) in enumerate(zip(self._columns, self._direct, strict=True))
        ]
        arrays.append(pa.Array.from_buffers(pa.int64(), rows, [None, pa.py_buffer(self._lsn_bytes * rows)]))
        return pa.RecordBatch.from_arrays(arrays, schema=self._schema)


_CSV_COLUMN_ERROR = re.compile(r"In CSV column #(\d+): CSV conversion error")


def _failed_csv_column(message: str) -> int | None:
    match = _CSV_COLUMN_ERROR.search(message)
    return int(match.group(1)) if match else None


def _single_chunk(column: pa.ChunkedArray) -> pa.Array:
    return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)


def _unparsed(data: bytearray, rows: int) -> tuple[bytearray, int]:
    return data, rows


def _parse_each(
    pieces: Iterator[tuple[tuple[bytearray, int], int]], parse: Callable[[bytearray, int], pa.RecordBatch]
) -> Iterator[tuple[pa.RecordBatch, int]]:
    """Parse the pieces of another thread's COPY: the CSV reader releases the GIL, so
    reading PostgreSQL, parsing and the Spark transfer proceed side by side."""
    try:
        for (data, rows), nbytes in pieces:
            yield parse(data, rows), nbytes
    finally:
        pieces.close()


def _copy_pieces(
    pgconn: pq.abc.PGconn,
    query: str,
    parse: Callable[[bytearray, int], T],
    piece_bytes: int,
    piece_rows: int,
) -> Iterator[tuple[T, int]]:
    """Run the COPY and yield (batch, CSV bytes) pieces; at least one, possibly empty.

    Straight on libpq: psycopg's Copy costs microseconds per row, which is most of the
    budget for narrow rows. The protocol guarantees that each CopyData message the server
    sends is one whole row, so pieces always end on row boundaries. Non-blocking reads
    wait in select(), releasing the GIL for the writer thread.
    """
    pgconn.send_query(query.encode())
    result = _next_result(pgconn)
    if result is None or result.status != pq.ExecStatus.COPY_OUT:
        error = _result_error(result, query)
        _drain_results(pgconn)
        raise error
    get_copy_data = pgconn.get_copy_data
    buffer = bytearray()
    rows = size = 0
    yielded = False
    try:
        while True:
            nbytes, data = get_copy_data(1)
            if nbytes > 0:
                buffer += data
                rows += 1
                size += nbytes
                if size >= piece_bytes or rows >= piece_rows:
                    yield parse(buffer, rows), size
                    yielded = True
                    buffer = bytearray()
                    rows = size = 0
            elif nbytes == 0:
                select.select([pgconn.socket], [], [], _POLL_SECONDS)
                pgconn.consume_input()
            else:
                break
    except psycopg.OperationalError as exc:
        raise ConnectionFailure(f"COPY interrupted: {exc}", "check the server, then run the snapshot again") from None
    error = _drain_results(pgconn)
    if error is not None:
        raise error
    if rows or not yielded:
        yield parse(buffer, rows), size


def _next_result(pgconn: pq.abc.PGconn) -> pq.abc.PGresult | None:
    while True:
        pgconn.consume_input()
        if not pgconn.is_busy():
            return pgconn.get_result()
        select.select([pgconn.socket], [], [], _POLL_SECONDS)


def _drain_results(pgconn: pq.abc.PGconn) -> PgcdcError | None:
    """Read the results after COPY (leaving the connection usable); the first error, if any."""
    error: PgcdcError | None = None
    while (result := _next_result(pgconn)) is not None:
        if result.status == pq.ExecStatus.FATAL_ERROR and error is None:
            error = _result_error(result, "COPY")
    return error


def _result_error(result: pq.abc.PGresult | None, query: str) -> PgcdcError:
    if result is None:
        return ProtocolError(f"no result for {query[:80]}", "check the server log")
    if result.status != pq.ExecStatus.FATAL_ERROR:
        return ProtocolError(f"unexpected {result.status.name} answer to {query[:80]}", "check the server version")
    primary = result.error_field(pq.DiagnosticField.MESSAGE_PRIMARY) or result.error_message or b""
    return SnapshotError(
        f"COPY failed: {primary.decode('utf-8', 'replace')}", "fix the cause named by PostgreSQL, then run the snapshot again"
    )


_END = object()


def _prefetched(source: Iterator[T], depth: int, name: str) -> Iterator[T]:
    """Run ``source`` in a thread, ``depth`` items ahead of the consumer.

    When the consumer stops early (the write failed), the producer notices at its next
    hand-over and closes ``source``; the caller then closes the connection it was reading.
    """
    handover: queue.Queue[object] = queue.Queue(maxsize=depth)
    stop = threading.Event()
    failure: list[BaseException] = []

    def offer(item: object) -> bool:
        while not stop.is_set():
            try:
                handover.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in source:
                if not offer(item):
                    break
        except BaseException as exc:  # handed to the consumer, which re-raises it
            failure.append(exc)
        finally:
            source.close()
            offer(_END)

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while (item := handover.get()) is not _END:
            yield item  # type: ignore[misc]
        thread.join()
        if failure:
            raise failure[0]
    finally:
        stop.set()
        thread.join()


# --------------------------------------------------------------------------- many tables


@reports_dead_engine
def snapshot_tables(
    config: PgcdcConfig,
    spark: SparkSession,
    tables: Sequence[TableName] | None = None,
    on_progress: Callable[[SnapshotProgress], None] | None = None,
) -> list[SnapshotResult]:
    """Snapshot ``tables`` (default: ``config.tables``, or the whole publication), in parallel.

    ``config.snapshot.parallel_tables`` tables copy at once, each on its own connection and
    temporary slot, all writing through the one Spark session. A failing table does not stop
    the others; once all have finished, the first failure is raised (later ones are attached
    as notes). ``on_progress`` is called from the worker threads.
    """
    open_lake(config.delta.root, config.delta.storage)  # before the publication or slot is touched
    replicated = ensure_publication(config)
    selected = list(tables) if tables is not None else replicated
    unknown = [table for table in selected if table not in replicated]
    if unknown:
        raise ConfigurationError(
            f"{', '.join(str(t) for t in unknown)} not published by \"{config.publication}\" (or not in 'tables')",
            f"ALTER PUBLICATION {quote_ident(config.publication)} ADD TABLE ..., or snapshot only replicated tables",
        )
    ensure_slot(config.postgres.dsn, config.slot)
    results: list[SnapshotResult] = []
    failures: list[BaseException] = []
    for _, outcome in snapshot_each(config, spark, selected, on_progress):
        if isinstance(outcome, BaseException):
            failures.append(outcome)
        else:
            results.append(outcome)
    if failures:
        first = failures[0]
        for later in failures[1:]:
            first.add_note(f"also failed: {later}")
        raise first
    return sorted(results, key=lambda result: selected.index(result.table))


def snapshot_each(
    config: PgcdcConfig,
    spark: SparkSession,
    tables: Sequence[TableName],
    on_progress: Callable[[SnapshotProgress], None] | None = None,
) -> Iterator[tuple[TableName, SnapshotResult | BaseException]]:
    """Copy ``tables`` in parallel, yielding each table's result (or its failure) as it finishes.

    Callers report per table as soon as one is done (a Dagster step materializes it)
    instead of waiting for the slowest; the publication and slot must already be set up.
    """
    open_lake(config.delta.root, config.delta.storage)  # a wrong bucket fails here, before any copy
    workers = max(1, min(config.snapshot.parallel_tables, len(tables)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pgcdc-snapshot") as pool:
        pending = {
            pool.submit(
                snapshot_table,
                config.postgres.dsn,
                config.publication,
                table,
                spark,
                config.table_path(table.schema, table.name),
                slot=config.slot,
                on_progress=on_progress,
            ): table
            for table in tables
        }
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                table = pending.pop(future)
                error = future.exception()
                yield table, error if error is not None else future.result()


# --------------------------------------------------------------------------- reading the marker


EXPIRED_SNAPSHOT_LSN = LSN(0)
"""What :func:`read_snapshot_lsn` answers for a table whose snapshot commit has left the log."""


def read_snapshot_lsn(spark: SparkSession, path: str) -> LSN | None:
    """The snapshot LSN of the newest snapshot commit at ``path``; None without table or marker.

    Delta deletes commits older than ``delta.logRetentionDuration`` (30 days by default) once a
    newer checkpoint covers them, so a table replicated for longer than that has lost its
    snapshot commit, and with it the marker. The LSN no longer matters by then: every
    incremental run confirms the slot past the WAL position at its start, so the slot passed the
    snapshot LSN with the first run after the snapshot, long before the commit expired. A table
    whose log no longer starts at version 0 and holds no marker is therefore snapshotted at
    :data:`EXPIRED_SNAPSHOT_LSN` (nothing of what the slot sends is skipped) rather than treated as
    never snapshotted, which would skip all its changes.
    """
    try:
        commits = read_commit_metadata(spark, path)
    except AnalysisException as exc:
        if exc.getCondition() == "PATH_NOT_FOUND":  # JVM Spark; Sail lists no commits instead
            return None
        raise
    for commit in commits:
        lsn = _snapshot_lsn(commit.user_metadata)
        if lsn is not None:
            return lsn
    if commits and min(commit.version for commit in commits) > 0:
        return EXPIRED_SNAPSHOT_LSN
    return None


def _snapshot_lsn(user_metadata: str | None) -> LSN | None:
    if not user_metadata:
        return None
    try:
        marker = json.loads(user_metadata)
    except ValueError:
        return None  # another writer's free-form metadata
    pgcdc = marker.get("pgcdc") if isinstance(marker, dict) else None
    if not isinstance(pgcdc, dict) or pgcdc.get("kind") != "snapshot":
        return None
    return LSN.parse(pgcdc["snapshot_lsn"])
