"""Copying one primary-key range of a table in a short transaction, and choosing when a table is copied so.

A table whose heap is above ``snapshot.chunked_above_mb`` and whose primary key is one integer
column is snapshotted in key ranges (docs/contracts.md, "Chunked snapshots in primary-key ranges"):
no transaction lives longer than one range's COPY, so VACUUM is never held back for hours, and
the progress survives a crash. Range k is copied as the whole-table snapshot is, at the
consistent point C_k of a temporary slot created with ``SNAPSHOT 'use'`` in a ``READ ONLY
REPEATABLE READ`` transaction, then written in one Delta commit that replaces the range's rows
and carries the cumulative marker (which ranges are done, at which points). The caller must hold
the permanent slot meanwhile (``resources/runs/snapshot.py`` runs it inside a drain run; the drain's
re-copy is inside one by construction): that is what makes C_k >= the slot's confirmed position
when the range becomes done.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import psycopg
import pyarrow as pa

from resources.config import BucketSettings, SnapshotSettings
from resources.config.columns import ColumnOverrides, NO_OVERRIDES
from resources.crash_points import fault_point
from resources.delta.dataframes import DEFAULT_CHUNK_BYTES
from resources.delta.destination import Destination, TableLog
from resources.delta.key_ranges import KeyRanges
from resources.delta.layout import BUCKET_COLUMN, TableLayout
from resources.delta.markers import snapshot_marker
from resources.errors import SnapshotError
from resources.lsn import LSN
from resources.postgres.catalog import key_range, primary_key_columns, TableInfo, TableName
from resources.postgres.copy import copied_batches, DEFAULT_CHUNK_ROWS, PARSE_BYTES
from resources.runs.consistent_copy import consistent_copy, Pieces
from resources.runs.snapshot_layout import existing_layout, table_layout

__all__ = ["ColumnsChanged", "copy_key_range", "key_range_plan", "RangeCopy"]

INTEGER_KEY_TYPES = {21: "int2", 23: "int4", 20: "int8"}
"""Key types a table can be copied in ranges of; any other key keeps the one-snapshot mode."""


class ColumnsChanged(SnapshotError):
    """The table's published columns differ from its Delta table's: a range cannot replace its rows alone."""


@dataclass(frozen=True, slots=True)
class RangeCopy:
    """One range copied: the table's key ranges after its commit, and what was read."""

    ranges: KeyRanges
    range: int
    point: LSN
    rows: int
    bytes: int
    version: int
    layout: TableLayout | None
    columns: list[tuple[str, str, str]]  # (name, PostgreSQL type, Delta type) of the published columns


def key_range_plan(
    conn: psycopg.Connection, info: TableInfo, heap_bytes: int, settings: SnapshotSettings
) -> tuple[KeyRanges | None, str]:
    """The key ranges to copy ``info``'s table in, or None for one snapshot; and why, for the log."""
    heap_mb = heap_bytes / 2**20
    if heap_mb <= settings.chunked_above_mb:
        return None, f"{heap_mb:,.1f} MB heap, at most snapshot.chunked_above_mb ({settings.chunked_above_mb:,.0f})"
    one_snapshot = f"{heap_mb:,.1f} MB heap above snapshot.chunked_above_mb, but"
    if info.relkind != "r":
        return None, f"{one_snapshot} a partitioned table is copied under one snapshot"
    key = primary_key_columns(conn, info.oid)
    identity = info.key_columns
    if len(key) != 1 or (info.replica_identity != "f" and tuple(identity) != key):
        return None, f"{one_snapshot} key ranges need a one-column primary key that is the replica identity"
    column = next((c for c in info.columns if c.name == key[0]), None)
    if column is None:
        return None, f"{one_snapshot} its primary key column {key[0]} is not published"
    base = (
        psycopg.ClientCursor(conn)
        .execute(
            "SELECT CASE WHEN t.typtype OPERATOR(pg_catalog.=) 'd' THEN t.typbasetype ELSE t.oid END"
            " FROM pg_catalog.pg_type t WHERE t.oid OPERATOR(pg_catalog.=) %s::pg_catalog.oid",
            (column.type_oid,),
        )
        .fetchone()
    )
    type_name = INTEGER_KEY_TYPES.get(int(base[0]) if base else 0, "")
    if not type_name:
        return None, f"{one_snapshot} its primary key {key[0]} is not an integer (key ranges support int2/int4/int8)"
    span = key_range(conn, info.table, key[0])
    if span is None:
        return None, f"{one_snapshot} it is empty"
    count = max(1, math.ceil(heap_mb / settings.key_chunk_mb))
    ranges = KeyRanges.split(key[0], span[0], span[1], count)
    return ranges, (
        f"{heap_mb:,.1f} MB heap above snapshot.chunked_above_mb ({settings.chunked_above_mb:,.0f}): "
        f"{ranges.count} ranges of primary key {key[0]}, one short transaction each"
    )


def copy_key_range(
    dsn: str,
    publication: str,
    slot: str,
    table: TableName,
    destination: Destination,
    path: str,
    ranges: KeyRanges,
    k: int,
    *,
    first: bool,
    log: TableLog,
    buckets: BucketSettings | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    deletion_vectors: bool = True,
    overrides: ColumnOverrides = NO_OVERRIDES,
) -> RangeCopy:
    """Copy range k of ``table`` at a new consistent point into the Delta table at ``path`` of ``destination``.

    ``first``: the walk's first range, whose commit replaces the whole table (a new snapshot, bucketed
    by the layout chosen now); any other commit replaces only the range's rows, keeping the layout
    ``log`` records. ``log`` is the table's log as the caller read it just now (with the pgcdc state's
    row as ``known``: it still names the layout once log cleanup removed the snapshot commit); the
    caller holds the permanent slot ``slot`` (module docstring), so nothing else writes the table
    meanwhile. ``deletion_vectors``: the first range's commit creates a new table with them when the
    table is keyed (``ConsistentCopy.write``).
    """
    with consistent_copy(dsn, publication, table, after_slot="after_range_slot", overrides=overrides) as copy:
        existing = existing_layout(table, path, log, destination.lake)
        if first:
            layout = table_layout(copy.conn.connection, copy.info, copy.schema, buckets or BucketSettings(), existing)
        else:
            layout = existing
            _check_columns(destination, path, table, copy.schema)
        done = ranges.with_point(k, copy.point)
        marker = snapshot_marker(done.snapshot_lsn, slot, str(table), layout, done, k, copy.info.column_numbers)
        span = ranges.span(k)
        query = copy.info.copy_query(keys=(span.key, span.low, span.high))

        def read() -> Pieces:
            return copied_batches(
                copy.conn.pgconn, query, copy.parser(), min(chunk_bytes, PARSE_BYTES), chunk_rows, str(table)
            )

        version = copy.write(
            destination, read, path, marker, layout=layout, chunk_bytes=chunk_bytes,
            span=None if first else span, deletion_vectors=deletion_vectors,
        )  # fmt: skip
    fault_point("after_range_commit")
    return RangeCopy(done, k, copy.point, copy.rows, copy.bytes, version, layout, copy.described)


def _check_columns(destination: Destination, path: str, table: TableName, schema: pa.Schema) -> None:
    """Refuse (:class:`ColumnsChanged`) to replace one range when the COPY's columns are not the Delta
    table's (an ALTER TABLE since the snapshot began, a column dropped since the previous snapshot):
    by name only (a column added by a drain comes last in Delta), types are the drain's business
    (``resources/cdc/schema.py``)."""
    delta = [name for name in destination.table_schema(path).names if name != BUCKET_COLUMN]
    if sorted(delta) != sorted(schema.names):
        raise ColumnsChanged(
            f"{table}: its columns ({', '.join(schema.names)}) are not its Delta table's ({', '.join(delta)})",
            "the snapshot starts over",
        )
