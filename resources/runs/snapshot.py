"""Initial snapshot of published tables into Delta, the way PostgreSQL's own table sync does it.

Per table, on a replication connection of its own:
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
and handed to the Delta writer on the caller's thread while the next pieces are read and parsed
(queues of :data:`PREFETCH_PIECES` pieces decouple the three): delta-rs in this process on an engine
without Delta's commands, staged Parquet for the engine's overwrite otherwise
(``resources/delta/snapshot_writes.py``).

A table bigger than one chunk (``snapshot.chunk_mb`` of heap) is read in parallel when
``snapshot.workers`` > 1: the snapshot transaction exports its snapshot
(``pg_export_snapshot()``), the heap is split into ctid block ranges and that many worker
sessions import the snapshot and COPY a range at a time. Every worker sees exactly the
slot's consistent point, the ranges partition the table's tuple ids, and all pieces still
go into the one atomic Delta commit, so the result is the same table a single COPY gives.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import psycopg
from pyspark.sql import SparkSession

from resources.config import BucketSettings, DEFAULT_CHUNK_MB, DEFAULT_WORKERS, PgcdcConfig
from resources.runs.consistent_copy import consistent_copy, Pieces
from resources.delta.dataframes import DEFAULT_CHUNK_BYTES
from resources.delta.destination import TableLog
from resources.delta.key_ranges import KeyRanges
from resources.delta.lake_storage import open_lake
from resources.delta.layout import TableLayout
from resources.delta.markers import snapshot_marker
from resources.delta.marker_reads import read_snapshot_lsn
from resources.delta.spark_connect import reports_dead_engine
from resources.delta.state_table import known_log, read_state, state_path, StateRow, write_state
from resources.delta.table_log import read_table_log, read_table_metadata
from resources.errors import ConfigurationError, explain, PgcdcError, SlotError, SnapshotError
from resources.runs.incremental import run_incremental
from resources.runs.key_range_copy import ColumnsChanged, copy_key_range, key_range_plan, RangeCopy
from resources.lsn import LSN
from resources.names import RESNAPSHOT_JOB
from resources.pgtypes import PgValueError, SESSION_SETTINGS
from resources.phases import Phases
from resources.postgres.catalog import read_table, TableName
from resources.postgres.connections import connect
from resources.postgres.copy import (
    block_ranges,
    copied_batches,
    DEFAULT_CHUNK_ROWS,
    export_snapshot,
    heap_blocks,
    parallel_copy,
    PARSE_BYTES,
)
from resources.postgres.preflight import ensure_slot
from resources.postgres.slots import read_slot
from resources.postgres.publication import ensure_publication
from resources.sql import quote_ident
from resources.runs.snapshot_layout import existing_layout, table_layout
from resources.crash_points import fault_point

__all__ = [
    "SnapshotProgress",
    "SnapshotResult",
    "snapshot_table",
    "snapshot_tables",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SnapshotProgress:
    """Reported after each piece handed to the writer, so long copies show life and speed."""

    table: TableName
    rows: int
    bytes: int  # CSV bytes received from PostgreSQL so far
    elapsed_s: float
    chunks_done: int = 0  # ctid (or key) ranges copied completely
    chunks: int = 1  # ctid (or key) ranges in all (1: one COPY of the whole table)
    chunks_before: int = 0  # key ranges done by earlier runs (a resumed snapshot): not part of this run's pace
    unit: str = "ctid chunks"  # or "key ranges"

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the pace of the chunks done so far; None until one is done (or with one chunk)."""
        done_now = self.chunks_done - self.chunks_before
        if self.chunks <= 1 or done_now <= 0:
            return None
        return self.elapsed_s * (self.chunks - self.chunks_done) / done_now

    def describe(self) -> str:
        """One log line: rows, bytes, speed, and for a table read in ctid chunks, chunks done and time left."""
        line = (
            f"snapshot {self.table}: {self.rows:,} rows, {self.bytes / 1e6:,.1f} MB copied"
            f" in {self.elapsed_s:,.1f} s ({self.rows_per_second:,.0f} rows/s)"
        )
        if self.chunks > 1:
            line += f", {self.unit} {self.chunks_done}/{self.chunks} done"
            if self.eta_s is not None:
                line += f", about {self.eta_s:,.0f} s left"
        return line


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
    chunks: int = 1  # ctid ranges the table was read in
    workers: int = 1  # sessions that read them
    layout: TableLayout | None = None  # how the Delta table is bucketed (None: not bucketed)
    table_id: str | None = None  # Delta's metaData.id of the table written (what the state row's layout belongs to)
    key_ranges: bool = False  # copied in primary-key ranges, one short transaction each (``chunks`` of them)
    snapshot_version: int | None = None  # the version of the snapshot marker's commit, when not ``delta_version``
    phases: dict[str, float] = field(default_factory=dict)  # where ``duration_s`` went (resources/phases.py)

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def mode(self) -> str:
        """How the table was read, for logs: one COPY, ctid chunks on parallel sessions, or key ranges."""
        if self.key_ranges:
            return f"{self.chunks} primary-key ranges, one short transaction each"
        if self.chunks <= 1:
            return "one COPY"
        return f"{self.chunks} ctid chunks on {self.workers} sessions under one snapshot"


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
    workers: int = DEFAULT_WORKERS,
    chunk_mb: int = DEFAULT_CHUNK_MB,
    on_progress: Callable[[SnapshotProgress], None] | None = None,
    buckets: BucketSettings | None = None,
    deletion_vectors: bool = True,
    known: TableLog | None = None,
) -> SnapshotResult:
    """Copy what ``publication`` publishes of ``table`` into the Delta table at ``path``.

    The Delta table is bucketed by the layout ``buckets`` gives it (default: from its size,
    ``resources/delta/layout.py``), recorded in the marker, unless it is bucketed already: then it
    keeps its layout (found as a drain finds it, ``known`` being the pgcdc state's row of the
    table); ``deletion_vectors``: a table the snapshot creates gets them when it is keyed or REPLICA
    IDENTITY FULL (docs/contracts.md, "Deletion vectors").

    One atomic Delta commit carrying the snapshot marker (docs/contracts.md) replaces the
    table. ``slot`` is the permanent slot the marker names; create it first
    (:func:`ensure_slot`). ``chunk_bytes`` bounds each parsed piece (and each staged Parquet file,
    where the engine writes the table), ``chunk_rows`` each parsed piece. A heap bigger than ``chunk_mb`` is read as ctid ranges
    of about that size by ``workers`` sessions under the one snapshot. ``on_progress`` runs
    on the thread that feeds the Delta writer: the calling thread, or delta-rs's when it writes.
    """
    started = time.monotonic()
    reading = _Reading(max(1, workers), max(1, chunk_mb) * 2**20, max(1, chunk_rows), max(1, chunk_bytes))
    try:
        return _snapshot_table(
            dsn, publication, table, spark, path, slot, reading, on_progress, started,
            buckets or BucketSettings(), deletion_vectors, known,
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
        if isinstance(exc, OSError) and exc.errno:  # the lake's storage client: the path is named below
            first_line = os.strerror(exc.errno)
        else:
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


@dataclass(frozen=True, slots=True)
class _Reading:
    """How one table is read: sessions, heap bytes per ctid range, rows and bytes per piece."""

    workers: int
    range_bytes: int
    chunk_rows: int
    chunk_bytes: int


def _snapshot_table(
    dsn: str,
    publication: str,
    table: TableName,
    spark: SparkSession,
    path: str,
    slot: str,
    reading: _Reading,
    on_progress: Callable[[SnapshotProgress], None] | None,
    started: float,
    buckets: BucketSettings,
    deletion_vectors: bool,
    known: TableLog | None,
) -> SnapshotResult:
    chunk_rows, chunk_bytes = reading.chunk_rows, reading.chunk_bytes
    phases = Phases()
    with phases.timed("log_read"):
        existing = existing_layout(table, path, read_table_log(path, known))
    opened = time.monotonic()
    with consistent_copy(dsn, publication, table, after_slot="after_snapshot_slot") as copy:
        phases.add("slot_and_catalog", time.monotonic() - opened)
        layout = table_layout(copy.conn.connection, copy.info, copy.schema, buckets, existing)
        marker = snapshot_marker(copy.point, slot, str(table), layout, columns=copy.info.column_numbers)
        blocks, block_size = heap_blocks(copy.conn.connection, copy.info.oid)
        ranges = block_ranges(blocks, max(1, reading.range_bytes // block_size))
        workers = min(reading.workers, len(ranges))
        snapshot_name = export_snapshot(copy.conn) if workers > 1 else ""
        if workers > 1:
            logger.info(
                "snapshot %s: %.0f MB heap in %d ctid chunks on %d sessions under one snapshot",
                table, blocks * block_size / 1e6, len(ranges), workers,
            )  # fmt: skip
        else:
            ranges = [(0, None)]
            logger.info("snapshot %s: %.0f MB heap in one COPY", table, blocks * block_size / 1e6)
        chunks_done: list[int] = []  # one entry per finished range; list.append is atomic across threads

        def read() -> Pieces:
            piece_bytes = min(chunk_bytes, PARSE_BYTES)
            if workers > 1:
                return parallel_copy(
                    dsn, snapshot_name, [copy.info.copy_query(block_range) for block_range in ranges],
                    copy.parser, workers, piece_bytes, chunk_rows,
                    f"pgcdc-copy-{table}", on_query_done=lambda: chunks_done.append(1),
                )  # fmt: skip
            return copied_batches(copy.conn.pgconn, copy.info.copy_query(), copy.parser(), piece_bytes, chunk_rows, str(table))

        def progress() -> None:
            assert on_progress is not None
            elapsed = time.monotonic() - started
            on_progress(SnapshotProgress(table, copy.rows, copy.bytes, elapsed, len(chunks_done), len(ranges)))

        version = copy.write(
            spark, read, path, marker, layout=layout, chunk_bytes=chunk_bytes,
            on_piece=progress if on_progress is not None else None, deletion_vectors=deletion_vectors,
            phases=phases,
        )  # fmt: skip
        with phases.timed("metadata_read"):
            written = read_table_metadata(path)
    return SnapshotResult(
        table=table,
        snapshot_lsn=copy.point,
        rows=copy.rows,
        path=path,
        delta_version=version,
        duration_s=time.monotonic() - started,
        columns=copy.described,
        chunks=len(ranges),
        workers=workers,
        layout=layout,
        table_id=written.table_id if written is not None else None,
        phases=phases.as_dict(),
    )


# --------------------------------------------------------------------------- many tables


@reports_dead_engine
def refuse_partial_recopy(
    config: PgcdcConfig, spark: SparkSession, to_copy: Sequence[TableName], replicated: Sequence[TableName]
) -> None:
    """Refuse to create the slot anew while a table this run leaves out holds a snapshot in the lake.

    That snapshot was taken for a slot that is gone (lost in a failover, or dropped): the new slot
    starts now, so the table would silently miss every change in between. Only copying every
    such table again is exact.
    """
    with connect(config.postgres.dsn, application_name="pgcdc") as conn:
        if read_slot(conn, config.slot) is not None:
            return
    copied = set(to_copy)
    left_out = [
        table for table in replicated
        if table not in copied and read_snapshot_lsn(spark, config.table_path(table.schema, table.name)) is not None
    ]  # fmt: skip
    if left_out:
        raise SlotError(
            f'replication slot "{config.slot}" does not exist, and {len(left_out)} table(s) snapshotted for it are not'
            f" in this run ({', '.join(str(table) for table in left_out)}): they would miss every change since the slot was lost",
            f"run the {RESNAPSHOT_JOB} job with no table list: it recreates the slot and re-snapshots every table",
        )


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
    refuse_partial_recopy(config, spark, selected, replicated)
    ensure_slot(config.postgres.dsn, config.slot, failover=config.slot_failover)
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
    phases: Phases | None = None,
) -> Iterator[tuple[TableName, SnapshotResult | BaseException]]:
    """Copy ``tables`` in parallel, yielding each table's result (or its failure) as it finishes.

    Callers report per table as soon as one is done (a Dagster step materializes it)
    instead of waiting for the slowest; the publication and slot must already be set up.
    Once all are done, the finished ones are recorded in the pgcdc state table in one write
    (``resources/delta/state_table.py``; a crash before it costs the next drain a log read).
    ``phases`` gets the state table's read and write (``state_read``, ``state_write``).
    """
    clock = phases or Phases()
    open_lake(config.delta.root, config.delta.storage)  # a wrong bucket fails here, before any copy
    state = state_path(config.delta.root, config.slot)
    with clock.timed("state_read"):
        rows = read_state(state)

    def known(table: TableName) -> TableLog | None:
        return known_log(rows, str(table), config.table_path(table.schema, table.name))

    finished: list[SnapshotResult] = []
    modes: dict[TableName, tuple[KeyRanges | None, bool]] = {}
    for table in tables:
        try:
            modes[table] = _choose_mode(config, table)
        except Exception as error:  # noqa: BLE001 - reported per table, as a failed copy is
            yield table, error
    one_snapshot = [table for table, (plan, resume) in modes.items() if plan is None and not resume]
    workers = max(1, min(config.snapshot.parallel_tables, len(one_snapshot)))
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
                workers=config.snapshot.workers,
                chunk_mb=config.snapshot.chunk_mb,
                on_progress=on_progress,
                buckets=config.delta.buckets,
                deletion_vectors=config.delta.deletion_vectors_for(table),
                known=known(table),
            ): table
            for table in one_snapshot
        }
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                table = pending.pop(future)
                failure = future.exception()
                if failure is None:
                    finished.append(future.result())
                yield table, failure if failure is not None else future.result()
    # Only now, one at a time: each step of a walk drains the slot, which must not confirm past the
    # consistent point of a one-snapshot copy still in flight (its changes would be skipped for good).
    for table, (plan, resume) in modes.items():
        if plan is None and not resume:
            continue
        try:
            result = snapshot_in_key_ranges(config, spark, table, plan, on_progress, known=known(table))
        except Exception as error:  # noqa: BLE001 - a failing table does not stop the others
            yield table, _naming_table(error, table) if isinstance(error, PgcdcError) else error
            continue
        finished.append(result)
        yield table, result
    if finished:
        with clock.timed("state_write"):
            _record_snapshots(state, finished)


def _record_snapshots(state: str, finished: list[SnapshotResult]) -> None:
    """The finished tables' snapshots in the pgcdc state table, in one write."""
    fault_point("before_snapshot_state_write")
    write_state(state, read_state(state), [
        StateRow(
            str(done.table), done.path,
            TableLog(
                done.snapshot_lsn, done.snapshot_version or done.delta_version, done.delta_version, None, done.layout,
                done.table_id,
            ),
            None,
        )
        for done in finished
    ])  # fmt: skip


def _choose_mode(config: PgcdcConfig, table: TableName) -> tuple[KeyRanges | None, bool]:
    """(the key ranges of a new snapshot in key ranges, or None; whether one part-way is resumed),
    logged with the reason: a snapshot in key ranges part-way is resumed; otherwise key ranges above
    ``snapshot.chunked_above_mb`` for a table with a one-column integer primary key (in place, range
    by range, when the table has a complete snapshot by that key), else one snapshot (one COPY, or
    ctid chunks in parallel)."""
    log = read_table_log(config.table_path(table.schema, table.name))
    if log.chunks is not None and log.chunks.next_range() is not None:
        logger.info(
            "snapshot %s: resuming its snapshot in key ranges of %s: %d of %d done",
            table, log.chunks.key, log.chunks.done, log.chunks.count,
        )  # fmt: skip
        return None, True
    plan, why = _plan(config, table)
    if plan is not None and log.snapshot_lsn is not None:
        if log.chunks is not None and log.chunks.key == plan.key:
            plan = log.chunks.again()
        else:
            plan = KeyRanges(plan.key, plan.bounds, (int(log.snapshot_lsn),) * plan.count, frozenset(range(plan.count)))
        why += "; a re-snapshot in place: each range is drained as before until copied again"
    logger.info("snapshot %s: %s", table, why)
    return plan, False


def _plan(config: PgcdcConfig, table: TableName) -> tuple[KeyRanges | None, str]:
    """:func:`~resources.runs.key_range_copy.key_range_plan` for the table as it is now."""
    try:
        with connect(config.postgres.dsn, application_name="pgcdc_snapshot", session_settings=SESSION_SETTINGS) as conn:
            info = read_table(conn, config.publication, table)
            blocks, block_size = heap_blocks(conn, info.oid)
            return key_range_plan(conn, info, blocks * block_size, config.snapshot)
    except PgcdcError as exc:
        raise _naming_table(exc, table) from exc
    except psycopg.Error as exc:
        raise _naming_table(explain(exc, config.postgres.dsn), table) from exc


def snapshot_in_key_ranges(
    config: PgcdcConfig,
    spark: SparkSession,
    table: TableName,
    plan: KeyRanges | None,
    on_progress: Callable[[SnapshotProgress], None] | None = None,
    known: TableLog | None = None,
) -> SnapshotResult:
    """Walk the table's key ranges, one per drain run of the slot, until every range is done.

    Each step is one :func:`~resources.runs.incremental.run_incremental` whose ``hold`` copies the next
    range (:func:`~resources.runs.key_range_copy.copy_key_range`) while the run holds the permanent slot,
    then drains every table from the slot's confirmed position, this one by the drain rule of key
    ranges. ``plan`` starts a new snapshot (its first range replaces the whole table) or, with ranges
    to copy again (``redo``), a re-snapshot in place (each range replaced on its own, the others
    drained as before); None resumes the one the table's log records, at its next range. A run
    stopped anywhere loses nothing: the next one resumes. The last step copies nothing and only
    drains. When the table's columns no longer match its Delta table, the walk starts over with a
    snapshot whose first range replaces the whole table. ``known`` is the pgcdc state's row of the
    table (where its layout is recorded after log cleanup).
    """
    started = time.monotonic()
    path = config.table_path(table.schema, table.name)
    recorded = read_table_log(path, known).chunks
    done_before = recorded.done if plan is None and recorded is not None else 0
    copies: list[RangeCopy] = []
    rows = nbytes = 0

    def copy_range(ranges: KeyRanges, k: int, first: bool, log: TableLog) -> None:
        copies.append(copy_key_range(
            config.postgres.dsn, config.publication, config.slot, table, spark, path, ranges, k,
            first=first, log=log, buckets=config.delta.buckets, deletion_vectors=config.delta.deletion_vectors_for(table),
        ))  # fmt: skip

    def copy_next() -> None:
        log = read_table_log(path, known)  # once per range: its ranges (but the plan's first) and its layout
        ranges = plan if plan is not None and not copies else log.chunks
        if ranges is None:
            raise SnapshotError(f"{table}: its snapshot in key ranges is gone from its Delta log", "snapshot the table again")
        k = ranges.next_range()
        if k is None:
            return
        new_snapshot = ranges is plan and not plan.redo
        try:
            copy_range(ranges, k, new_snapshot, log)
        except ColumnsChanged as changed:
            fresh = _plan(config, table)[0] or KeyRanges(ranges.key, (), (None,))  # else one range: the whole table
            logger.info("snapshot %s: %s; starting over in %d key ranges", table, changed, fresh.count)
            copy_range(fresh, 0, True, log)  # nothing was written: the log is as read

    while True:
        copied = len(copies)
        run_incremental(config, spark, hold=copy_next, log=lambda line: logger.info("snapshot %s: %s", table, line))
        if len(copies) == copied:
            break
        copy = copies[-1]
        rows, nbytes = rows + copy.rows, nbytes + copy.bytes
        if on_progress is not None:
            on_progress(SnapshotProgress(
                table, rows, nbytes, time.monotonic() - started, copy.ranges.done, copy.ranges.count, done_before, "key ranges",
            ))  # fmt: skip
    log = read_table_log(path)
    if log.chunks is None or log.snapshot_lsn is None or log.version is None:
        raise SnapshotError(f"{table}: its snapshot in key ranges did not complete", "run the table's snapshot again")
    return SnapshotResult(
        table=table,
        snapshot_lsn=log.snapshot_lsn,
        rows=rows,
        path=path,
        delta_version=log.version,
        duration_s=time.monotonic() - started,
        columns=copies[-1].columns if copies else [],
        chunks=log.chunks.count,
        layout=log.layout,
        key_ranges=True,
        snapshot_version=log.snapshot_version,
        table_id=log.table_id,
    )
