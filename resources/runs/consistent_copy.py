"""A table copied at a temporary slot's consistent point into one Delta commit: what both snapshot modes share.

PostgreSQL's own table sync (``resources/runs/snapshot.py`` describes it): on a replication connection
of its own, ``BEGIN READ ONLY ISOLATION LEVEL REPEATABLE READ``, then a *temporary* slot created
with ``SNAPSHOT 'use'``, whose consistent point is exactly what the transaction sees. A snapshot
of the whole table (``resources/runs/snapshot.py``) reads all of it there (one COPY, or ctid chunks on
sessions importing the transaction's snapshot); a snapshot in key ranges
(``resources/runs/key_range_copy.py``) reads one range. Either way the pieces are counted as they
pass, the transaction ends and the slot is dropped as soon as the COPY is complete (before Delta
finishes: no snapshot is held while the engine writes), and one commit carrying the caller's
marker writes them.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import pyarrow as pa

from resources.config.columns import ColumnOverrides, NO_OVERRIDES, refuse_case_clash, refuse_excluded_keys
from resources.crash_points import fault_point
from resources.delta.destination import Destination
from resources.delta.key_ranges import KeySpan
from resources.delta.layout import TableLayout
from resources.delta.markers import LSN_COLUMN
from resources.lsn import LSN
from resources.pgtypes import arrow_schema, PgColumnType, SESSION_SETTINGS, spark_ddl_type, with_choices
from resources.postgres.catalog import read_table, table_oid, TableInfo, TableName
from resources.postgres.copy import PieceParser, read_column_types
from resources.postgres.replication import ReplicationConnection
from resources.runs.phases import Phases

__all__ = ["ConsistentCopy", "consistent_copy", "Pieces"]

Pieces = Generator[tuple[pa.RecordBatch, int], None, None]
"""Parsed pieces of a COPY as (batch, COPY bytes) pairs; closing it stops its reader threads."""


@dataclass(slots=True)
class ConsistentCopy:
    """A table being copied inside the open transaction of temporary slot ``temp_slot``, at ``point``."""

    conn: ReplicationConnection
    temp_slot: str
    point: LSN
    info: TableInfo
    columns: list[PgColumnType]
    schema: pa.Schema  # the published columns' Arrow types, then LSN_COLUMN
    rows: int = 0  # rows written so far
    bytes: int = 0  # COPY bytes received from PostgreSQL so far

    def parser(self) -> PieceParser:
        """A parser of this copy's COPY output (one per session reading it)."""
        return PieceParser(self.columns, self.schema, self.point)

    @property
    def changes_rows(self) -> bool:
        """Whether drains update and delete this table's rows: it has a replica identity key or is
        REPLICA IDENTITY FULL (otherwise PostgreSQL publishes only its inserts and truncates)."""
        return bool(self.info.key_columns)

    @property
    def described(self) -> list[tuple[str, str, str]]:
        """(name, PostgreSQL type, Delta type) of the published columns, for logs and materializations."""
        return [(col.column, col.type_name, spark_ddl_type(col)) for col in self.columns]

    def write(
        self,
        destination: Destination,
        read: Callable[[], Pieces],
        path: str,
        marker: str,
        *,
        layout: TableLayout | None,
        chunk_bytes: int,
        span: KeySpan | None = None,
        deletion_vectors: bool = False,
        on_piece: Callable[[], None] | None = None,
        phases: Phases | None = None,
    ) -> int:
        """Write ``read()``'s pieces into one commit of ``destination`` carrying ``marker`` (replacing the
        table, or the rows of the key range ``span``); return its version. ``read`` is called once the write starts;
        ``on_piece`` runs on this thread after each piece is counted. ``deletion_vectors``: a write that
        creates the table turns them on when the table's rows are updated or deleted by key or by row
        value (:attr:`changes_rows`); a keyless append-only table is only ever appended to, so it
        needs none and stays readable by every Delta reader. ``phases`` gets ``writer_start`` (until the
        writer asks for rows), ``first_rows`` (until the first piece is parsed), ``copy`` (the rest of
        the COPY, written as it arrives) and ``commit`` (from the COPY's end to the commit)."""
        clock = phases or Phases()
        mark = time.monotonic()

        def lap(name: str) -> None:
            nonlocal mark
            now = time.monotonic()
            clock.add(name, now - mark)
            mark = now

        def pieces() -> Generator[pa.RecordBatch, None, None]:
            lap("writer_start")
            source = read()
            first = True
            try:
                for batch, nbytes in source:
                    if first:
                        lap("first_rows")
                        first = False
                    self.rows += batch.num_rows
                    self.bytes += nbytes
                    if on_piece is not None:
                        on_piece()
                    yield batch
            finally:
                source.close()  # stops the reader threads before the connection closes
            self.conn.commit()  # the COPY is complete: end the transaction and free the slot before Delta finishes
            self.conn.drop_slot(self.temp_slot)
            lap("copy")

        stream = pieces()
        try:
            version = destination.write_snapshot(
                stream, self.schema, path, marker, chunk_bytes=chunk_bytes, layout=layout,
                span=span, deletion_vectors=deletion_vectors and self.changes_rows,
            )  # fmt: skip
            lap("commit")
            return version
        finally:
            stream.close()


@contextmanager
def consistent_copy(
    dsn: str,
    publication: str,
    table: TableName,
    *,
    after_slot: str | None = None,
    overrides: ColumnOverrides = NO_OVERRIDES,
) -> Iterator[ConsistentCopy]:
    """Open the copy of what ``publication`` publishes of ``table``: its connection, transaction and
    temporary slot, its columns read inside it, as the configuration's ``overrides`` want them (as
    text, renamed, left out of the COPY). ``after_slot`` names the fault point right after the
    slot is created. Leaving closes the connection (a slot not dropped yet goes with it).

    Two columns whose Delta names differ only in case are refused here, before anything is written:
    the engine would fail only once the write had begun, leaving the table's directory behind."""
    with ReplicationConnection(dsn, application_name="pgcdc_snapshot", session_settings=SESSION_SETTINGS) as conn:
        # The slot name wants the table's oid, and SNAPSHOT 'use' must be the transaction's
        # first command: look it up before BEGIN.
        temp_slot = f"pgcdc_sync_{table_oid(conn.connection, table)}_{secrets.token_hex(6)}"
        conn.begin_snapshot_transaction()
        point = conn.create_slot(temp_slot, temporary=True, snapshot="use").consistent_point
        if after_slot is not None:
            fault_point(after_slot)
        info = read_table(conn.connection, publication, table)
        choices = overrides.for_table(table)
        excluded = {name for name, choice in choices.items() if choice.exclude}
        if excluded:
            refuse_excluded_keys(table, [c.name for c in info.columns if c.is_identity_key and c.name in excluded])
            info = replace(info, columns=tuple(c for c in info.columns if c.name not in excluded))
        columns = with_choices(read_column_types(conn, info), choices)
        refuse_case_clash(table, [(c.source_name, c.column) for c in columns])
        schema = arrow_schema(columns).append(pa.field(LSN_COLUMN, pa.int64()))
        yield ConsistentCopy(conn, temp_slot, point, info, columns, schema)
