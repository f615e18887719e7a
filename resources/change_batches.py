"""Committed transactions -> per-table Arrow batches -> Delta (MERGE, or append for keyless tables).

Changes are gathered per table as the raw tuples of ``resources.transactions`` (text bytes,
no per-value conversion) and converted column-wise with ``pgtypes.to_arrow`` only when a
table's batch is flushed, so the per-change cost is one tuple in a list.

How each table is written, decided from its Relation message:

* **keyed** (primary key or replica identity index): one MERGE per batch, matched on the
  key. A batch holds at most one row per key (MERGE refuses two), so it is folded first:
  the last change per key wins (commit order, then position), an unchanged-TOAST value is
  taken from an earlier change of that key in the batch when there is one, and an update
  that changes the key also deletes the row under the old key.
* **full** (REPLICA IDENTITY FULL): the same, with the whole row as key, matched null-safe
  (``<=>``); unchanged-TOAST values come from the old row image, which FULL sends whole.
  Two identical rows are one key: deleting one of two equal rows deletes both in Delta.
* **append** (no usable identity: PostgreSQL refuses UPDATE/DELETE on such published
  tables, so only inserts and truncates arrive): appends whose commit carries the marker
  ``{"pgcdc": {"kind": "append", "applied_lsn", "applied_seq"}}``; a replay skips every
  change at or below it, which makes the appends exactly-once.

TRUNCATE flushes the table's pending batch, then empties the Delta table, in order with
the other changes. A Relation message that changes a table's columns flushes its batch
first, then adds new columns to Delta, widens safely widened ones (int2->int4->int8,
float4->float8, numeric precision up with the same scale; varchar/text are all strings),
keeps dropped ones (NULL from then on) and refuses any other type change.

Every change carries its transaction's commit *end* LSN: ``_pgcdc_lsn`` holds it, and a
table skips changes whose transaction ends at or before its snapshot LSN (a slot's
consistent point is a record boundary, so that is exactly the set the snapshot holds).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import psycopg
import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql.pandas.types import from_arrow_type
from pyspark.sql.types import DecimalType

from resources.catalog import TableName
from resources.delta_engine import (
    OLD_KEY_PREFIX,
    OP_COLUMN,
    add_columns,
    append_rows,
    delete_all_rows,
    merge_batch,
    read_commit_metadata,
    table_schema,
    unchanged_flag_column,
    widen_columns,
)
from resources.errors import PgcdcError
from resources.faults import fault_point
from resources.lsn import LSN
from resources.pgoutput import UNCHANGED_TOAST, Relation
from resources.pgtypes import PgColumnType, PgValueError, arrow_type, column_type_from_catalog, pg_type_catalog_query, to_arrow
from resources.transactions import CommittedTransaction

__all__ = [
    "LSN_COLUMN",
    "ChangeApplier",
    "SchemaChangeError",
    "TableStats",
    "TableTarget",
    "TypeResolver",
    "read_append_marker",
]

LSN_COLUMN = "_pgcdc_lsn"
KEYED, FULL, APPEND = "keyed", "full", "append"
RESNAPSHOT_FIX = "re-snapshot the table (materialize its snapshot asset or run the pgcdc_resnapshot job)"

_SAFE_WIDENINGS = {("smallint", "int"), ("smallint", "bigint"), ("int", "bigint"), ("float", "double")}


class SchemaChangeError(PgcdcError):
    """A column changed in a way Delta cannot follow in place."""


class ChangeValueError(PgcdcError):
    """A changed value does not fit its Delta column."""


class TypeResolver:
    """Column types for Relation messages, from the catalog, cached per (type oid, typmod).

    The Relation message names types only by oid and typmod; what they mean (domains,
    arrays, numeric precision) is in pg_type, read over a normal connection.
    """

    def __init__(self, conn: psycopg.Connection) -> None:
        self._conn = conn
        self._rows: dict[tuple[int, int], tuple] = {}

    def columns(self, relation: Relation) -> list[PgColumnType]:
        wanted = [(c.type_oid, c.type_modifier) for c in relation.columns]
        missing = list(dict.fromkeys(key for key in wanted if key not in self._rows))
        if missing:
            rows = self._conn.execute(
                pg_type_catalog_query(),
                {"type_oids": [oid for oid, _ in missing], "typmods": [mod for _, mod in missing]},
            ).fetchall()
            self._rows.update(zip(missing, rows))
        return [column_type_from_catalog(c.name, self._rows[key]) for c, key in zip(relation.columns, wanted)]


@dataclass
class TableStats:
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    truncates: int = 0
    #: Commit end LSN of the newest change applied to Delta in this run.
    applied_lsn: LSN | None = None


@dataclass(eq=False)
class TableTarget:
    """One replicated table: where its Delta table is and what has been applied to it."""

    table: TableName
    path: str
    #: None: never snapshotted, so every change is skipped (its snapshot will come later).
    snapshot_lsn: LSN | None
    stats: TableStats = field(default_factory=TableStats)
    relation: Relation | None = None
    columns: list[PgColumnType] = field(default_factory=list)
    mode: str = KEYED
    key_index: tuple[int, ...] = ()
    #: Delta columns the relation no longer has: written NULL from now on.
    dropped: list[pa.Field] = field(default_factory=list)
    delta_schema: pa.Schema | None = None
    #: (commit end LSN, position) of the last appended change, for keyless tables.
    append_marker: tuple[int, int] | None = None
    append_marker_loaded: bool = False
    pending: list[tuple] = field(default_factory=list)
    pending_bytes: int = 0
    warned: bool = False

    def skips(self, end_lsn: int) -> bool:
        return self.snapshot_lsn is None or end_lsn <= self.snapshot_lsn


def read_append_marker(spark: SparkSession, path: str) -> tuple[int, int] | None:
    """The newest append marker (commit end LSN, position) in the table's commit log."""
    for commit in read_commit_metadata(spark, path):
        try:
            marker = json.loads(commit.user_metadata or "")
        except ValueError:
            continue
        pgcdc = marker.get("pgcdc") if isinstance(marker, dict) else None
        if isinstance(pgcdc, dict) and pgcdc.get("kind") == "append":
            return int(LSN.parse(pgcdc["applied_lsn"])), int(pgcdc["applied_seq"])
    return None


def _spark_type_name(arrow: pa.DataType) -> str:
    return from_arrow_type(arrow).simpleString()


def _is_safe_widening(old: pa.DataType, new: pa.DataType) -> bool:
    old_spark, new_spark = from_arrow_type(old), from_arrow_type(new)
    if (old_spark.simpleString(), new_spark.simpleString()) in _SAFE_WIDENINGS:
        return True
    return (
        isinstance(old_spark, DecimalType)
        and isinstance(new_spark, DecimalType)
        and new_spark.scale == old_spark.scale
        and new_spark.precision >= old_spark.precision
    )


class ChangeApplier:
    """Routes committed transactions into per-table batches and writes them to Delta.

    ``durable_lsn`` is the end LSN of the newest transaction all of whose changes are in
    Delta: the only position that may be confirmed to the slot. A transaction larger than
    the chunk bound is written in several Delta commits (readers may see part of it
    meanwhile); it becomes durable with the last one.
    """

    def __init__(
        self,
        spark: SparkSession,
        types: TypeResolver,
        targets: Mapping[TableName, TableTarget],
        *,
        max_changes: int,
        max_bytes: int,
        log: Callable[[str], None],
    ) -> None:
        self._spark = spark
        self._types = types
        self._targets = targets
        self._max_changes = max(1, max_changes)
        self._max_bytes = max(1, max_bytes)
        self._log = log
        self._relations: dict[int, Relation] = {}
        self._target_by_oid: dict[int, TableTarget | None] = {}
        self._complete_end = 0
        self.durable_lsn = LSN(0)
        self.pending_changes = 0
        self.pending_bytes = 0
        self.transactions = 0
        self.changes_applied = 0
        self.changes_skipped = 0

    # -- intake

    def fits(self, txn: CommittedTransaction) -> bool:
        """Whether ``txn`` still fits in the current chunk (an empty chunk takes anything)."""
        if not self.pending_changes:
            return True
        return (
            self.pending_changes + txn.change_count <= self._max_changes
            and self.pending_bytes + txn.nbytes <= self._max_bytes
        )

    def add(self, txn: CommittedTransaction) -> None:
        """Queue the transaction's changes; flushes mid-transaction only when it alone overflows a chunk."""
        end = int(txn.end_lsn)
        change_bytes = txn.nbytes // max(1, txn.change_count)
        try:
            for seq, (op, subject, new, old) in enumerate(txn.changes()):
                if op == "R":
                    self._relations[subject.oid] = subject
                    self._target_by_oid[subject.oid] = self._targets.get(TableName(subject.namespace, subject.name))
                    continue
                if op == "T":
                    for oid in subject:
                        target = self._target_by_oid.get(oid)
                        if target is not None and not target.skips(end):
                            self._truncate(target, self._relations[oid], end, seq)
                    continue
                target = self._target_by_oid.get(subject)
                if target is None or target.skips(end):
                    self.changes_skipped += 1
                    continue
                relation = self._relations[subject]
                if target.relation is not relation:
                    self._use_relation(target, relation)
                if target.mode == APPEND:
                    if op != "I":
                        self._warn_keyless(target, op)
                        continue
                    marker = target.append_marker
                    if marker is not None and (end, seq) <= marker:
                        self.changes_skipped += 1
                        continue
                target.pending.append((op, new, old, end, seq))
                target.pending_bytes += change_bytes
                self.pending_changes += 1
                self.pending_bytes += change_bytes
                if self.pending_changes >= self._max_changes or self.pending_bytes >= self._max_bytes:
                    self.flush()
        finally:
            txn.discard()
        self._complete_end = end
        self.transactions += 1

    def flush(self) -> None:
        """Write every pending batch to Delta; afterwards ``durable_lsn`` covers every completely added transaction."""
        for target in self._targets.values():
            if target.pending:
                self._flush_target(target)
        self.durable_lsn = LSN(self._complete_end)

    # -- schema

    def _use_relation(self, target: TableTarget, relation: Relation) -> None:
        previous = target.relation
        if (
            previous is not None
            and previous.columns == relation.columns
            and previous.replica_identity == relation.replica_identity
        ):
            target.relation = relation
            return
        if target.pending:
            self._flush_target(target)
        columns = self._types.columns(relation)
        key_index = tuple(i for i, column in enumerate(relation.columns) if column.is_key)
        if relation.replica_identity == "f":
            target.mode, target.key_index = FULL, tuple(range(len(relation.columns)))
        elif key_index:
            target.mode, target.key_index = KEYED, key_index
        else:
            target.mode, target.key_index = APPEND, ()
            if not target.append_marker_loaded:
                target.append_marker = read_append_marker(self._spark, target.path)
                target.append_marker_loaded = True
        self._reconcile_schema(target, columns)
        target.relation = relation
        target.columns = columns

    def _reconcile_schema(self, target: TableTarget, columns: list[PgColumnType]) -> None:
        if target.delta_schema is None:
            target.delta_schema = table_schema(self._spark, target.path)
        existing = {f.name: f.type for f in target.delta_schema}
        added: list[pa.Field] = []
        widened: dict[str, pa.DataType] = {}
        for column in columns:
            wanted = arrow_type(column)
            current = existing.get(column.column)
            if current is None:
                added.append(pa.field(column.column, wanted))
            elif _spark_type_name(current) != _spark_type_name(wanted):
                if not _is_safe_widening(current, wanted):
                    raise SchemaChangeError(
                        f"column {column.column!r} of {target.table} changed type from "
                        f"{_spark_type_name(current)} to {column.type_name} ({_spark_type_name(wanted)})",
                        RESNAPSHOT_FIX,
                    )
                widened[column.column] = wanted
        if widened:
            self._log(f"{target.table}: widening {', '.join(sorted(widened))} (rewrites the Delta table)")
            widen_columns(self._spark, target.path, widened)
        if added:
            self._log(f"{target.table}: adding column(s) {', '.join(f.name for f in added)}")
            add_columns(self._spark, target.path, pa.schema(added))
        if widened or added:
            target.delta_schema = table_schema(self._spark, target.path)
        names = {column.column for column in columns}
        target.dropped = [
            f for f in target.delta_schema if f.name not in names and not f.name.startswith("_pgcdc_")
        ]

    def _warn_keyless(self, target: TableTarget, op: str) -> None:
        self.changes_skipped += 1
        if not target.warned:
            target.warned = True
            kind = {"U": "an UPDATE", "D": "a DELETE"}[op]
            self._log(
                f"warning: {target.table} has no replica identity but {kind} arrived; skipped "
                "(give the table a primary key or REPLICA IDENTITY FULL, then re-snapshot it)"
            )

    # -- writing

    def _truncate(self, target: TableTarget, relation: Relation, end: int, seq: int) -> None:
        if target.relation is not relation:
            self._use_relation(target, relation)
        if target.mode == APPEND and target.append_marker is not None and (end, seq) <= target.append_marker:
            return
        if target.pending:
            self._flush_target(target)
        fault_point("before_merge")
        delete_all_rows(self._spark, target.path)
        target.stats.truncates += 1
        target.stats.applied_lsn = LSN(end)

    def _flush_target(self, target: TableTarget) -> None:
        rows, target.pending = target.pending, []
        self.pending_changes -= len(rows)
        self.pending_bytes -= target.pending_bytes
        target.pending_bytes = 0
        fault_point("before_merge")
        if target.mode == APPEND:
            self._append(target, rows)
        else:
            self._merge(target, rows)
        self.changes_applied += len(rows)
        target.stats.applied_lsn = LSN(max(rows[-1][3], target.stats.applied_lsn or 0))

    def _append(self, target: TableTarget, rows: list[tuple]) -> None:
        batch = self._arrow_batch(target, [row[1] for row in rows], [row[3] for row in rows], None)
        _, _, _, end, seq = rows[-1]
        marker = json.dumps({"pgcdc": {"kind": "append", "applied_lsn": str(LSN(end)), "applied_seq": seq}})
        append_rows(self._spark, target.path, batch, marker)
        target.append_marker = (end, seq)
        target.stats.inserted += len(rows)

    def _merge(self, target: TableTarget, rows: list[tuple]) -> None:
        """Fold to one change per key, then one MERGE."""
        index = target.key_index
        full = target.mode == FULL
        unchanged = UNCHANGED_TOAST
        final: dict[tuple, tuple] = {}
        old_key_of: dict[tuple, tuple] = {}
        inserted = updated = deleted = 0
        for op, new, old, end, _ in rows:
            if op == "I":
                key = tuple([new[i] for i in index])
                final[key] = ("I", new, end)
                old_key_of.pop(key, None)
                inserted += 1
            elif op == "U":
                values = new
                if unchanged in new:
                    values = list(new)
                    if full and old is not None:
                        values = [old[i] if value is unchanged else value for i, value in enumerate(values)]
                new_key = tuple([values[i] for i in index])
                old_key = new_key if old is None else tuple([old[i] for i in index])
                if unchanged in values:
                    earlier = final.get(old_key)
                    if earlier is not None and earlier[0] != "D":
                        source = earlier[1]
                        values = [source[i] if value is unchanged else value for i, value in enumerate(values)]
                if old_key != new_key:
                    final[old_key] = ("D", old, end)
                    if unchanged in values:
                        old_key_of[new_key] = old_key_of.get(old_key, old_key)
                    else:
                        old_key_of.pop(new_key, None)
                elif unchanged not in values:
                    old_key_of.pop(new_key, None)
                final[new_key] = ("U", values, end)
                updated += 1
            else:
                key = tuple([old[i] for i in index])
                final[key] = ("D", old, end)
                old_key_of.pop(key, None)
                deleted += 1
        changes = list(final.values())
        old_keys = None
        if old_key_of:
            old_keys = [old_key_of.get(key) for key in final]
        batch = self._arrow_batch(target, [change[1] for change in changes], [change[2] for change in changes], old_keys)
        batch = batch.append_column(OP_COLUMN, pa.array([change[0] for change in changes], pa.string()))
        key_columns = [target.columns[i].column for i in index]
        merge_batch(self._spark, target.path, batch, key_columns, null_safe_keys=full)
        stats = target.stats
        stats.inserted += inserted
        stats.updated += updated
        stats.deleted += deleted

    def _arrow_batch(
        self,
        target: TableTarget,
        images: list,
        lsns: list[int],
        old_keys: list[tuple | None] | None,
    ) -> pa.Table:
        """Rows of text values -> typed columns, plus unchanged-TOAST flags, ``_pgcdc_lsn`` and dropped columns."""
        unchanged = UNCHANGED_TOAST
        arrays: list[pa.Array] = []
        names: list[str] = []
        flags: list[tuple[str, pa.Array]] = []
        for i, column in enumerate(target.columns):
            values = [image[i] for image in images]
            if unchanged in values:
                flags.append(
                    (unchanged_flag_column(column.column), pa.array([value is unchanged for value in values], pa.bool_()))
                )
                values = [None if value is unchanged else value for value in values]
            arrays.append(self._convert(target, values, column))
            names.append(column.column)
        if old_keys is not None and flags:
            for position, i in enumerate(target.key_index):
                column = target.columns[i]
                values = [None if key is None else key[position] for key in old_keys]
                arrays.append(self._convert(target, values, column))
                names.append(OLD_KEY_PREFIX + column.column)
        for name, flag in flags:
            arrays.append(flag)
            names.append(name)
        arrays.append(pa.array(lsns, pa.int64()))
        names.append(LSN_COLUMN)
        for dropped in target.dropped:
            arrays.append(pa.nulls(len(images), dropped.type))
            names.append(dropped.name)
        return pa.Table.from_arrays(arrays, names)

    @staticmethod
    def _convert(target: TableTarget, values: Iterable[bytes | None], column: PgColumnType) -> pa.Array:
        try:
            return to_arrow(pa.array(values, pa.binary()), column)
        except PgValueError as exc:
            raise ChangeValueError(
                f"cannot apply a change to {target.table}: {exc}",
                "fix the value in PostgreSQL or replicate that column as text, then re-snapshot the table",
            ) from exc
