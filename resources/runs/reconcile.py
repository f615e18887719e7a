"""Reconciliation: Delta compared with PostgreSQL at one fixed LSN, exact under live writes.

A row count taken on a live table and a Delta table drained a moment earlier disagree by
whatever was committed in between. Reconciliation removes "in between":

1. A TEMPORARY logical slot is created with an exported snapshot
   (``CREATE_REPLICATION_SLOT ... TEMPORARY LOGICAL pgoutput (SNAPSHOT 'export')``). Its
   consistent point L is a record boundary, and the snapshot sees exactly the transactions
   whose commit ends at or before L (the argument the table snapshot rests on, docs/contracts.md).
2. A normal connection imports that snapshot (``BEGIN ISOLATION LEVEL REPEATABLE READ READ
   ONLY; SET TRANSACTION SNAPSHOT ...``) and keeps it for the rest of the run; then the
   replication connection closes, which drops the temporary slot (it holds no WAL back).
3. The permanent slot is drained up to exactly L (``run_incremental(end_lsn=L)``), so Delta
   holds exactly the transactions committed up to L. The caller holds the slot's concurrency
   pool, as a drain does: nothing else writes the tables until the comparison ends.
4. Each table is read from both sides as pgcdc reads it: PostgreSQL through the snapshot's own
   COPY of the published columns and rows (column list, row filter) and pgcdc's text-to-Arrow
   conversion; Delta through the engine. Rows are compared by pgcdc's canonical equality
   (``resources/cdc/row_multiset.py: comparable_rows``: PostgreSQL's text identity carried
   to typed values, the equality the REPLICA IDENTITY FULL path applies).

Rows are split into ranges, and per range both sides get a row count and an order-independent
hash (the sum of the rows' hashes modulo 2^64, a multiset fingerprint). Memory is one counter
pair per range plus one read piece, whatever the table's size. Ranges are:

* one integer key column: contiguous key ranges (``"id" >= 1000 AND "id" < 2000``);
* any other key: buckets of a hash of the key, named by their number;
* REPLICA IDENTITY FULL and keyless tables (rows may repeat): buckets of a hash of the whole row,
  compared as multisets.

A mismatched range is named; when the mismatched ranges are small (:data:`DIFF_ROWS`) both sides
are read once more and the differing keys are listed (for keyless tables, how many rows differ).
Cost: one read of the table on each side (PostgreSQL: one COPY; Delta: one scan, streamed as
Arrow batches: ``resources/delta/reads.py``), in the reconciliation job, never in a drain.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import psycopg
import pyarrow as pa

from resources.cdc.row_multiset import comparable_rows
from resources.config import PgcdcConfig
from resources.config.columns import ColumnOverrides, NO_OVERRIDES
from resources.delta.destination import Destination
from resources.delta.markers import LSN_COLUMN
from resources.engines.spark_connect import reports_dead_engine
from resources.errors import explain
from resources.lsn import LSN
from resources.names import SNAPSHOT_JOB
from resources.pgtypes import arrow_type, PgColumnType, SESSION_SETTINGS
from resources.postgres.catalog import read_table, TableInfo, TableName
from resources.postgres.column_types import published_column_types
from resources.postgres.connections import connect
from resources.postgres.copy import copy_pieces, DEFAULT_CHUNK_ROWS, PARSE_BYTES, PieceParser
from resources.postgres.replication import ReplicationConnection
from resources.runs.incremental import IncrementalResult, run_incremental
from resources.sql import quote_ident, quote_literal

__all__ = ["RangeMismatch", "ReconcileResult", "TableReconciliation", "reconcile"]

RANGE_ROWS = 10_000
"""Rows per compared range, by PostgreSQL's estimate of the table's size."""
MAX_RANGES = 4_096
DIFF_ROWS = 10_000
"""Mismatched ranges holding at most this many rows (on either side, together) are diffed row by row."""
SHOWN_KEYS = 20


@dataclass(frozen=True)
class RangeMismatch:
    """One key range whose rows differ: its rows on each side (equal counts mean equal-sized but different rows)."""

    range: str
    postgres_rows: int
    delta_rows: int


@dataclass(frozen=True)
class TableReconciliation:
    table: str
    postgres_rows: int
    delta_rows: int
    #: The columns compared: the published ones Delta has.
    columns: list[str]
    #: Published columns Delta lacks (the schema check reports them); not compared.
    not_in_delta: list[str]
    #: How rows were split into ranges, e.g. ``64 ranges of "id"``.
    ranging: str
    mismatches: list[RangeMismatch]
    #: Keys (as text) of rows that differ in the mismatched ranges, when those were small enough to diff.
    differing_keys: list[str] = field(default_factory=list)
    #: Rows that differ in the mismatched ranges (both sides); None when they were too large to diff.
    differing_rows: int | None = None
    duration_s: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.mismatches


@dataclass(frozen=True)
class ReconcileResult:
    #: The fixed position: the temporary slot's consistent point.
    lsn: LSN
    #: The drain of the permanent slot up to ``lsn``.
    drain: IncrementalResult
    tables: dict[str, TableReconciliation]
    #: Tables not compared, and why (no snapshot yet, re-snapshotted during the run).
    skipped: dict[str, str]


@reports_dead_engine
def reconcile(
    config: PgcdcConfig,
    destination: Destination,
    tables: Sequence[TableName] | None = None,
    *,
    log: Callable[[str], None] | None = None,
    range_rows: int = RANGE_ROWS,
) -> ReconcileResult:
    """Fix one LSN, drain the slot up to it, and compare ``tables`` (default: every replicated one)
    in ranges of about ``range_rows`` rows (by PostgreSQL's estimate; at most :data:`MAX_RANGES`), reading
    the lake through ``destination``.

    The caller must hold the slot's concurrency pool for the whole call, as for a drain.
    """
    say = log or (lambda message: None)
    dsn = config.postgres.dsn
    with connect(dsn, application_name="pgcdc_reconcile", session_settings=SESSION_SETTINGS) as reader:
        try:
            lsn = _import_fixed_snapshot(dsn, reader)
        except psycopg.Error as exc:
            raise explain(exc, dsn) from None
        say(f"reconciling at {lsn}: draining slot {config.slot} up to it")
        drained = run_incremental(config, destination, log=say, end_lsn=lsn)
        replicated = [result.table for result in drained.tables.values() if result.table is not None]
        compared: dict[str, TableReconciliation] = {}
        skipped = {name: f"no snapshot yet: run the {SNAPSHOT_JOB} job" for name in drained.tables_without_snapshot}
        for table in tables if tables is not None else replicated:
            name = str(table)
            if name in skipped:
                continue
            if table not in replicated:
                skipped[name] = "not replicated (not in the publication or 'tables')"
                continue
            path = config.table_path(table.schema, table.name)
            snapshot_lsn = destination.read_table_log(path, None).snapshot_lsn
            if snapshot_lsn is not None and snapshot_lsn > lsn:
                skipped[name] = f"re-snapshotted at {snapshot_lsn}, after the reconciliation point: run it again"
                continue
            try:
                outcome = _compare_table(
                    reader, config.publication, destination, table, path, range_rows, config.column_overrides
                )
            except psycopg.Error as exc:
                raise explain(exc, dsn) from None
            if destination.read_table_log(path, None).snapshot_lsn != snapshot_lsn:
                skipped[name] = "re-snapshotted while it was compared: run it again"
                continue
            say(
                f"{name}: {'matches' if outcome.passed else 'DIFFERS'} ({outcome.postgres_rows} rows in PostgreSQL, "
                f"{outcome.delta_rows} in Delta, {outcome.ranging})"
            )
            compared[name] = outcome
        reader.execute("COMMIT")
    return ReconcileResult(lsn, drained, compared, skipped)


def _import_fixed_snapshot(dsn: str, reader: psycopg.Connection) -> LSN:
    """Open a transaction on ``reader`` under the snapshot of a new temporary slot; return its consistent point.

    The temporary slot goes with its connection: it is needed only until the snapshot is imported.
    """
    with ReplicationConnection(dsn, application_name="pgcdc_reconcile", session_settings=SESSION_SETTINGS) as rc:
        created = rc.create_slot(f"pgcdc_reconcile_{secrets.token_hex(6)}", temporary=True, snapshot="export")
        assert created.snapshot_name is not None  # SNAPSHOT 'export' always names one
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        reader.execute(f"SET TRANSACTION SNAPSHOT {quote_literal(created.snapshot_name)}".encode())
    return created.consistent_point


# --------------------------------------------------------------------------- ranges


class Ranges(Protocol):
    """Which range each row falls in; the same answer for PostgreSQL's and Delta's rows."""

    count: int
    label: str

    def of(self, data: pa.Table, rows: list[tuple]) -> np.ndarray:
        """The range of each row (``data`` as read, ``rows`` its ``comparable_rows``)."""
        ...

    def describe(self, index: int) -> str:
        """The range as a person (or a WHERE clause) reads it."""
        ...


class IntegerRanges(Ranges):
    """Contiguous ranges of one integer key column from ``low`` on, ``width`` keys each; the
    first and last are open-ended, so a key Delta holds outside PostgreSQL's span still lands in one."""

    def __init__(self, column: str, low: int, high: int, count: int) -> None:
        self.column = column
        self.low = low
        self.width = max(1, math.ceil((high - low + 1) / count))
        self.count = max(1, min(count, math.ceil((high - low + 1) / self.width)))
        self.label = f"{self.count} ranges of {quote_ident(column)}"

    def of(self, data: pa.Table, rows: list[tuple]) -> np.ndarray:
        keys = data.column(self.column).to_numpy(zero_copy_only=False).astype(np.int64)
        # uint64 arithmetic is exact for key - low in [0, 2^64), whatever the int64 values
        offsets = np.maximum(keys, self.low).astype(np.uint64) - np.uint64(self.low & 0xFFFF_FFFF_FFFF_FFFF)
        return np.minimum(offsets // np.uint64(self.width), np.uint64(self.count - 1)).astype(np.int64)

    def describe(self, index: int) -> str:
        column = quote_ident(self.column)
        lower = f"{column} >= {self.low + index * self.width}" if index > 0 else None
        upper = f"{column} < {self.low + (index + 1) * self.width}" if index < self.count - 1 else None
        return " AND ".join(part for part in (lower, upper) if part) or "all rows"


class HashBuckets(Ranges):
    """Buckets of a hash of some columns (the key, or the whole row): one process computes both sides."""

    def __init__(self, positions: Sequence[int], count: int, label: str) -> None:
        self.positions = list(positions)
        self.count = count
        self.label = f"{count} hash buckets of {label}"

    def of(self, data: pa.Table, rows: list[tuple]) -> np.ndarray:
        positions, count = self.positions, self.count
        return np.fromiter((hash(tuple(row[i] for i in positions)) % count for row in rows), np.int64, len(rows))

    def describe(self, index: int) -> str:
        return f"hash bucket {index} of {self.count}"


@dataclass
class RangeSums:
    """Per range: rows and the sum of their hashes (mod 2^64)."""

    counts: np.ndarray
    sums: np.ndarray

    @classmethod
    def empty(cls, ranges: int) -> RangeSums:
        return cls(np.zeros(ranges, np.int64), np.zeros(ranges, np.uint64))

    def add(self, index: np.ndarray, rows: list[tuple]) -> None:
        hashes = np.fromiter((hash(row) for row in rows), np.int64, len(rows)).view(np.uint64)
        np.add.at(self.counts, index, 1)
        np.add.at(self.sums, index, hashes)


# --------------------------------------------------------------------------- one table


def _compare_table(
    reader: psycopg.Connection,
    publication: str,
    destination: Destination,
    table: TableName,
    path: str,
    range_rows: int,
    overrides: ColumnOverrides = NO_OVERRIDES,
) -> TableReconciliation:
    """Counts and hashes per range of the table's rows on both sides (columns as the configuration's
    ``overrides`` have them in Delta: as text, renamed; excluded ones are not compared)."""
    started = time.monotonic()
    info = read_table(reader, publication, table)
    types = published_column_types(reader, info, overrides)
    in_delta = set(destination.table_schema(path).names)
    compared = [column for column in types if column.column in in_delta]
    names = [column.column for column in compared]
    in_delta_name = {column.source_name: column.column for column in types}
    keys = (
        [in_delta_name.get(c.name, "") for c in info.columns if c.is_identity_key]
        if info.replica_identity in ("d", "i")
        else []
    )
    keys = keys if all(key in names for key in keys) else []
    estimate = _estimated_rows(reader, info)
    ranges = _ranges(reader, info, compared, keys, max(1, math.ceil(estimate / max(1, range_rows))))

    def postgres() -> Iterator[tuple[pa.Table, list[tuple]]]:
        return _postgres_pieces(reader, info, compared, names)

    def delta() -> Iterator[tuple[pa.Table, list[tuple]]]:
        for piece in destination.scan(path, names):
            yield piece, comparable_rows(piece, names)

    postgres_sums, delta_sums = RangeSums.empty(ranges.count), RangeSums.empty(ranges.count)
    for side, pieces in ((postgres_sums, postgres()), (delta_sums, delta())):
        for data, rows in pieces:
            side.add(ranges.of(data, rows), rows)
    differ = np.flatnonzero((postgres_sums.counts != delta_sums.counts) | (postgres_sums.sums != delta_sums.sums))
    mismatches = [
        RangeMismatch(ranges.describe(int(i)), int(postgres_sums.counts[i]), int(delta_sums.counts[i])) for i in differ
    ]
    differing_keys: list[str] = []
    differing_rows: int | None = None
    if len(differ) and int(postgres_sums.counts[differ].sum() + delta_sums.counts[differ].sum()) <= DIFF_ROWS:
        key_positions = [names.index(key) for key in keys]
        wanted = set(differ.tolist())
        differing_keys, differing_rows = _diff_rows(postgres(), delta(), ranges, wanted, key_positions)
    return TableReconciliation(
        table=str(table),
        postgres_rows=int(postgres_sums.counts.sum()),
        delta_rows=int(delta_sums.counts.sum()),
        columns=names,
        not_in_delta=[column.column for column in types if column.column not in in_delta],
        ranging=ranges.label,
        mismatches=mismatches,
        differing_keys=differing_keys,
        differing_rows=differing_rows,
        duration_s=time.monotonic() - started,
    )


def _postgres_pieces(
    reader: psycopg.Connection, info: TableInfo, compared: list[PgColumnType], names: list[str]
) -> Iterator[tuple[pa.Table, list[tuple]]]:
    """The published rows under the reader's snapshot, through the snapshot's own COPY and conversion."""
    sources = {column.source_name for column in compared}
    narrowed = dataclasses.replace(info, columns=tuple(column for column in info.columns if column.name in sources))
    # the parser appends the snapshot's LSN column, which is not compared
    schema = pa.schema([pa.field(column.column, arrow_type(column)) for column in compared]).append(
        pa.field(LSN_COLUMN, pa.int64())
    )
    parse = PieceParser(compared, schema, LSN(0))
    for batch, _ in copy_pieces(reader.pgconn, narrowed.copy_query(), parse, PARSE_BYTES, DEFAULT_CHUNK_ROWS):
        data = pa.Table.from_batches([batch])
        yield data, comparable_rows(data, names)


def _diff_rows(
    postgres: Iterator[tuple[pa.Table, list[tuple]]],
    delta: Iterator[tuple[pa.Table, list[tuple]]],
    ranges: Ranges,
    wanted: set[int],
    key_positions: list[int],
) -> tuple[list[str], int]:
    """The rows of the ``wanted`` ranges on both sides: differing keys (keyed tables) and how many rows differ."""
    sides: list[Counter[tuple]] = [Counter(), Counter()]
    for side, pieces in zip(sides, (postgres, delta)):
        for data, rows in pieces:
            for index, row in zip(ranges.of(data, rows).tolist(), rows):
                if index in wanted:
                    side[row] += 1
    only_pg, only_delta = sides[0] - sides[1], sides[1] - sides[0]
    keys: list[str] = []
    if key_positions:
        found = {tuple(row[i] for i in key_positions) for row in (*only_pg, *only_delta)}
        keys = sorted(_key_text(key) for key in found)[:SHOWN_KEYS]
    return keys, sum(only_pg.values()) + sum(only_delta.values())


def _key_text(key: tuple) -> str:
    return repr(key[0]) if len(key) == 1 else repr(key)


def _estimated_rows(reader: psycopg.Connection, info: TableInfo) -> int:
    """About how many rows the table holds (for a partitioned table, summed over its leaves):
    PostgreSQL's estimate, but at least one row per 100 bytes of table, since the estimate of a
    table not analyzed since it grew lags behind (or is -1)."""
    row = reader.execute(
        "SELECT pg_catalog.sum(GREATEST(c.reltuples::pg_catalog.int8,"
        " pg_catalog.pg_table_size(c.oid) OPERATOR(pg_catalog./) 100))::pg_catalog.int8 FROM pg_catalog.pg_class c"
        " WHERE c.oid OPERATOR(pg_catalog.=) %s::pg_catalog.oid OR c.oid OPERATOR(pg_catalog.=) ANY (ARRAY("
        "SELECT t.relid::pg_catalog.oid FROM pg_catalog.pg_partition_tree(%s::pg_catalog.oid::pg_catalog.regclass) t"
        " WHERE t.isleaf))",
        (info.oid, info.oid),
    ).fetchone()
    return int(row[0] or 0) if row else 0


def _ranges(
    reader: psycopg.Connection, info: TableInfo, compared: list[PgColumnType], keys: list[str], wanted: int
) -> Ranges:
    """About ``wanted`` ranges (at most :data:`MAX_RANGES`) of the table's rows."""
    count = min(MAX_RANGES, wanted)
    names = [column.column for column in compared]
    if len(keys) == 1 and pa.types.is_integer(arrow_type(compared[names.index(keys[0])])):
        only = "ONLY " if info.relkind == "r" else ""
        where = f" WHERE {info.row_filter}" if info.row_filter else ""
        key = quote_ident(compared[names.index(keys[0])].source_name)
        low, high = reader.execute(
            f"SELECT pg_catalog.min({key})::pg_catalog.int8, pg_catalog.max({key})::pg_catalog.int8"
            f" FROM {only}{info.table.quoted}{where}"
        ).fetchone()  # type: ignore[misc]
        if low is not None:
            return IntegerRanges(keys[0], int(low), int(high), count)
    if keys:
        return HashBuckets([names.index(key) for key in keys], count, "(" + ", ".join(map(quote_ident, keys)) + ")")
    return HashBuckets(range(len(names)), count, "whole rows (no key: compared as multisets)")
