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
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from resources.config import BucketSettings, DEFAULT_CHUNK_MB, DEFAULT_WORKERS
from resources.config.columns import as_text_fix, ColumnOverrides, NO_OVERRIDES
from resources.delta.dataframes import DEFAULT_CHUNK_BYTES
from resources.delta.destination import Destination, TableLog
from resources.delta.layout import TableLayout
from resources.delta.markers import snapshot_marker
from resources.delta.table_log import read_table_metadata
from resources.errors import explain, PgcdcError, SnapshotError, storage_fault
from resources.lsn import LSN
from resources.pgtypes import PgValueError
from resources.postgres.catalog import TableName
from resources.postgres.copy import copied_batches, DEFAULT_CHUNK_ROWS, PARSE_BYTES
from resources.postgres.ctid_copy import block_ranges, export_snapshot, heap_blocks, parallel_copy
from resources.runs.consistent_copy import consistent_copy, Pieces
from resources.runs.phases import Phases
from resources.runs.snapshot_layout import existing_layout, table_layout

__all__ = ["naming_table", "SnapshotProgress", "SnapshotResult", "snapshot_table"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SnapshotProgress:
    """Reported after each piece handed to the writer, so long copies show life and speed."""

    table: TableName
    rows: int
    bytes: int  # COPY bytes received from PostgreSQL so far
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
    phases: dict[str, float] = field(default_factory=dict)  # where ``duration_s`` went (resources/runs/phases.py)
    catalog_name: str | None = None  # the name the table is registered under (``catalog:``), once it is
    catalog_refusal: str | None = None  # why it (or its history) could not be registered: the one line said

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def copy_rows_per_second(self) -> float:
        """Rows per second from the writer's first request for rows to the COPY's last row: the
        copy's own pace, without the start-up in front of it or the commit after it."""
        seconds = self.phases.get("first_rows", 0.0) + self.phases.get("copy", 0.0)
        return self.rows / seconds if seconds > 0 else 0.0

    @property
    def mode(self) -> str:
        """How the table was read, for logs: one COPY, ctid chunks on parallel sessions, or key ranges."""
        if self.key_ranges:
            return f"{self.chunks} primary-key ranges, one short transaction each"
        if self.chunks <= 1:
            return "one COPY"
        return f"{self.chunks} ctid chunks on {self.workers} sessions under one snapshot"


def snapshot_table(
    dsn: str,
    publication: str,
    table: TableName,
    destination: Destination,
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
    overrides: ColumnOverrides = NO_OVERRIDES,
) -> SnapshotResult:
    """Copy what ``publication`` publishes of ``table`` into the Delta table at ``path`` of ``destination``.

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
    ``overrides``: the configuration's ``columns`` (as text, renamed, left out).
    """
    started = time.monotonic()
    reading = _Reading(max(1, workers), max(1, chunk_mb) * 2**20, max(1, chunk_rows), max(1, chunk_bytes))
    try:
        return _snapshot_table(
            dsn,
            publication,
            table,
            destination,
            path,
            slot,
            reading,
            on_progress,
            started,
            buckets or BucketSettings(),
            deletion_vectors,
            known,
            overrides,
        )
    except PgcdcError as exc:
        raise naming_table(exc, table) from exc
    except PgValueError as exc:
        fix = "fix the value in PostgreSQL" if exc.column is None else as_text_fix(table, exc.column)
        raise SnapshotError(f"cannot snapshot {table}: {exc}", fix) from exc
    except psycopg.Error as exc:
        raise naming_table(explain(exc, dsn), table) from exc
    except Exception as exc:
        fault = storage_fault(exc, f"the Delta table {path}", "delta.root", "run the snapshot again")
        if fault is not None:
            raise naming_table(fault, table) from exc
        if isinstance(exc, OSError) and exc.errno:  # the lake's storage client: the path is named below
            first_line = os.strerror(exc.errno)
        else:
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SnapshotError(
            f"cannot snapshot {table} into {path}: {first_line}",
            "check the Spark engine and the Delta location, then run the snapshot again",
        ) from exc


def naming_table(exc: PgcdcError, table: TableName) -> PgcdcError:
    """``exc`` with ``table`` named in its cause, so a failure among several tables says whose it is."""
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
    destination: Destination,
    path: str,
    slot: str,
    reading: _Reading,
    on_progress: Callable[[SnapshotProgress], None] | None,
    started: float,
    buckets: BucketSettings,
    deletion_vectors: bool,
    known: TableLog | None,
    overrides: ColumnOverrides,
) -> SnapshotResult:
    chunk_rows, chunk_bytes = reading.chunk_rows, reading.chunk_bytes
    phases = Phases()
    with phases.timed("log_read"):
        existing = existing_layout(table, path, destination.read_table_log(path, known), destination.lake)
    opened = time.monotonic()
    with consistent_copy(dsn, publication, table, after_slot="after_snapshot_slot", overrides=overrides) as copy:
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
            return copied_batches(
                copy.conn.pgconn, copy.info.copy_query(), copy.parser(), piece_bytes, chunk_rows, str(table)
            )

        def progress() -> None:
            assert on_progress is not None
            elapsed = time.monotonic() - started
            on_progress(SnapshotProgress(table, copy.rows, copy.bytes, elapsed, len(chunks_done), len(ranges)))

        version = copy.write(
            destination, read, path, marker, layout=layout, chunk_bytes=chunk_bytes,
            on_piece=progress if on_progress is not None else None, deletion_vectors=deletion_vectors,
            phases=phases,
        )  # fmt: skip
        with phases.timed("metadata_read"):
            written = read_table_metadata(path, destination.lake)
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
