"""Committed transactions -> per-table Arrow batches -> Delta (MERGE, or append for keyless tables).

Changes are gathered per table as the undecoded tuples of ``resources.cdc.transactions`` (the
message bytes and where its row images start). When a table's batch is flushed, all its row
images are parsed column-wise with numpy (:func:`tuple_columns`) and converted with
``pgtypes.to_arrow``, so the per-change Python cost is one tuple in a list.

How each table is written, decided from its Relation message:

* **keyed** (primary key or replica identity index): one MERGE per batch, matched on the
  key. A batch holds at most one row per key (MERGE refuses two), so it is folded first:
  the last change per key wins (commit order, then position; an Arrow group-by on the
  parsed key columns), and an update that changes the key also deletes the row under the
  old key. A batch with unchanged-TOAST values is folded change by change instead: such a
  value is taken from an earlier change of that key in the batch when there is one, else
  the MERGE keeps Delta's value (or, for a moved key, the value under the old key).
* **full** (REPLICA IDENTITY FULL): the table is a multiset of rows, which may repeat, and
  each change adds or removes one copy (``resources/cdc/row_multiset.py``): a batch folds into a
  net count per row value and rewrites only the copies of those values
  (``delta_engine.replace_rows``), in commits of a few thousand values, each carrying the
  marker ``{"pgcdc": {"kind": "replace", "applied_lsn", "applied_seq"}}``; unchanged-TOAST
  values come from the old row image, which FULL sends whole.
* **append** (no usable identity: PostgreSQL refuses UPDATE/DELETE on such published
  tables, so only inserts and truncates arrive): appends whose commit carries the marker
  ``{"pgcdc": {"kind": "append", "applied_lsn", "applied_seq"}}``.

A replay skips every change of a **full** or **append** table at or below its newest marker,
which makes adding and removing copies exactly-once (a keyed MERGE is idempotent instead).

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

import functools
import json
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession
from pyspark.sql.pandas.types import from_arrow_type
from pyspark.sql.types import DecimalType

from resources.cdc.row_multiset import apply_row_deltas, fold_row_changes, NET_COLUMN, RowDelta
from resources.cdc.transactions import CommittedTransaction, RowBatch
from resources.delta.engine import (
    add_columns,
    append_rows,
    delete_all_rows,
    fill_columns,
    merge_batch,
    OLD_KEY_PREFIX,
    OP_COLUMN,
    read_commit_metadata,
    replace_rows,
    table_schema,
    unchanged_flag_column,
    widen_columns,
)
from resources.errors import PgcdcError
from resources.lsn import LSN
from resources.pgoutput.messages import Relation, UNCHANGED_TOAST
from resources.pgoutput.tags import BINARY, DELETE, INSERT, NULL, TEXT, UNCHANGED, UPDATE
from resources.pgtypes import (
    arrow_type,
    column_type_from_catalog,
    pg_type_catalog_query,
    PgColumnType,
    PgValueError,
    to_arrow,
)
from resources.postgres.catalog import TableName
from resources.testing.faults import fault_point

__all__ = [
    "LSN_COLUMN",
    "ChangeApplier",
    "SchemaChangeError",
    "TableStats",
    "TableTarget",
    "TypeResolver",
    "read_applied_marker",
]

LSN_COLUMN = "_pgcdc_lsn"
KEYED, FULL, APPEND = "keyed", "full", "append"
MARKED_MODES = (FULL, APPEND)
"""Modes whose Delta commits carry an applied-position marker: replaying their changes is not idempotent."""
_MARKER_KINDS = {FULL: "replace", APPEND: "append"}
DEFAULT_REPLACE_VALUES = 2_000
"""Most distinct row values one REPLICA IDENTITY FULL commit rewrites: its predicate lists their
hashes, and Sail 0.7.2 plans about 0.2 ms per listed value (docs/contracts.md)."""
DEFAULT_MERGE_ROWS = 200_000
"""Most source rows per MERGE. Smaller pieces lowered Sail's memory only at a steep throughput cost
(docs/engine-notes.md: 25k rows 1.4 GiB at 0.3x the speed; 50k no lower than one MERGE per chunk), so
by default a chunk (200k changes) is still one MERGE per table."""
HEARTBEAT_SECONDS = 0.1
"""How often a thread waiting for Delta calls the heartbeat (which decides itself whether to send)."""
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

    def added_columns(self, relation: Relation, names: list[str]) -> dict[str, set[tuple]]:
        """What PostgreSQL gave the existing rows of the named columns, per column: the set over
        the table's storage (the table, or every leaf partition) of (type oid, has a missing
        value, that value as text output, has a default). A column that is gone (dropped or
        renamed since) is absent."""
        rows = self._conn.execute(
            "SELECT a.attname, a.atttypid::pg_catalog.int8, a.atthasmissing,"
            " pg_catalog.array_to_string(a.attmissingval, ''::pg_catalog.text), a.atthasdef"
            " FROM pg_catalog.pg_attribute a WHERE a.attrelid OPERATOR(pg_catalog.=) ANY ("
            "   SELECT relid FROM pg_catalog.pg_partition_tree(%(oid)s::pg_catalog.oid::pg_catalog.regclass)"
            "   WHERE isleaf UNION SELECT oid FROM pg_catalog.pg_class"
            "   WHERE oid OPERATOR(pg_catalog.=) %(oid)s::pg_catalog.oid AND relkind OPERATOR(pg_catalog.<>) 'p')"
            " AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped"
            " AND a.attname OPERATOR(pg_catalog.=) ANY (%(names)s::pg_catalog.name[])",
            {"oid": relation.oid, "names": names},
        ).fetchall()
        found: dict[str, set[tuple]] = {}
        for name, type_oid, has_missing, missing, has_default in rows:
            found.setdefault(name, set()).add((type_oid, has_missing, missing if has_missing else None, has_default))
        return found


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
    #: (commit end LSN, position) of the last change in Delta, for keyless and FULL tables.
    applied_marker: tuple[int, int] | None = None
    applied_marker_loaded: bool = False
    #: (row batch, indexes of this table's rows in it, commit end LSN, position of the batch's first change)
    pending: list[tuple] = field(default_factory=list)
    pending_bytes: int = 0
    warned: bool = False

    def skips(self, end_lsn: int) -> bool:
        return self.snapshot_lsn is None or end_lsn <= self.snapshot_lsn


def read_applied_marker(spark: SparkSession, path: str) -> tuple[int, int] | None:
    """The newest applied-position marker (commit end LSN, position) of an append or FULL
    rewrite commit in the table's commit log, unless a snapshot replaced the table since:
    the rows a marker vouches for went with it."""
    for commit in read_commit_metadata(spark, path):
        try:
            marker = json.loads(commit.user_metadata or "")
        except ValueError:
            continue
        pgcdc = marker.get("pgcdc") if isinstance(marker, dict) else None
        kind = pgcdc.get("kind") if isinstance(pgcdc, dict) else None
        if kind == "snapshot":
            return None
        if kind in _MARKER_KINDS.values():
            return int(LSN.parse(pgcdc["applied_lsn"])), int(pgcdc["applied_seq"])  # type: ignore[index]
    return None


def _applied_marker(mode: str, end: int, seq: int) -> str:
    return json.dumps({"pgcdc": {"kind": _MARKER_KINDS[mode], "applied_lsn": str(LSN(end)), "applied_seq": seq}})


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

    :meth:`durable_lsn` is the end LSN of the newest transaction all of whose changes are in
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
        heartbeat: Callable[[], None] | None = None,
        max_merge_rows: int = DEFAULT_MERGE_ROWS,
        max_replace_values: int = DEFAULT_REPLACE_VALUES,
    ) -> None:
        """``heartbeat`` is called about every :data:`HEARTBEAT_SECONDS` while this thread waits
        for Delta (e.g. ``ReplicationStream.keepalive``, so the walsender does not time out)."""
        self._spark = spark
        self._heartbeat = heartbeat
        self._types = types
        self._targets = targets
        self._max_changes = max(1, max_changes)
        self._max_bytes = max(1, max_bytes)
        self._max_merge_rows = max(1, max_merge_rows)
        self._max_replace_values = max(2, max_replace_values)
        self._log = log
        self._relations: dict[int, Relation] = {}
        self._target_by_oid: dict[int, TableTarget | None] = {}
        self._complete_end = 0
        self._durable = 0
        # One Delta write runs in the background while the next chunk is decoded and folded
        # (the Spark call waits on the engine, not on Python): writes stay in order, and at
        # most one chunk is in flight besides the one being built. Every Spark call of the
        # applier runs on this thread; the caller's thread only waits for it (see _wait).
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pgcdc-delta-write")
        self._in_flight: deque[tuple[Future[None], int | None]] = deque()
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
        change_bytes = max(1, txn.nbytes // max(1, txn.change_count))
        seq = 0  # a change's position in its transaction
        try:
            for segment in txn.segments():
                if type(segment) is RowBatch:
                    self._add_rows(segment, end, seq, change_bytes)
                    seq += len(segment)
                    continue
                op, subject = segment[0], segment[1]  # type: ignore[index]
                if op == "R":
                    self._relations[subject.oid] = subject
                    self._target_by_oid[subject.oid] = self._targets.get(TableName(subject.namespace, subject.name))
                elif op == "T":
                    for oid in subject:
                        target = self._target_by_oid.get(oid)
                        if target is not None and not target.skips(end):
                            self._truncate(target, self._relations[oid], end, seq)
                seq += 1
        finally:
            txn.discard()
        self._complete_end = end
        self.transactions += 1

    def _add_rows(self, batch: RowBatch, end: int, seq: int, change_bytes: int) -> None:
        """Route a run of row changes to their tables' pending batches, a table at a time."""
        oids = batch.oids
        unique = np.unique(oids)
        for oid in unique.tolist():
            index = np.arange(len(oids)) if len(unique) == 1 else np.flatnonzero(oids == oid)
            target = self._target_by_oid.get(oid)
            if target is None or target.skips(end):
                self.changes_skipped += len(index)
                continue
            relation = self._relations[oid]
            if target.relation is not relation:
                self._use_relation(target, relation, end, seq)
            if target.mode == APPEND:
                inserts = batch.ops[index] == INSERT
                if not inserts.all():
                    self._warn_keyless(target, chr(int(batch.ops[index[~inserts][0]])))
                    self.changes_skipped += int((~inserts).sum()) - 1
                    index = index[inserts]
            if target.mode in MARKED_MODES:
                marker = target.applied_marker
                if marker is not None and end <= marker[0]:
                    applied = index + seq <= marker[1] if end == marker[0] else np.ones(len(index), bool)
                    self.changes_skipped += int(applied.sum())
                    index = index[~applied]
            while len(index):
                room = min(
                    self._max_changes - self.pending_changes,
                    -(-(self._max_bytes - self.pending_bytes) // change_bytes),
                )
                taken, index = index[: max(1, room)], index[max(1, room) :]
                target.pending.append((batch, taken, end, seq))
                added = len(taken) * change_bytes
                target.pending_bytes += added
                self.pending_changes += len(taken)
                self.pending_bytes += added
                if self.pending_changes >= self._max_changes or self.pending_bytes >= self._max_bytes:
                    self.flush()

    def flush(self) -> None:
        """Send every pending batch to Delta; once written, every completely added transaction is durable."""
        for target in self._targets.values():
            if target.pending:
                self._flush_target(target)
        if self._in_flight:
            self._in_flight.append((self._writer.submit(lambda: None), self._complete_end))
        else:
            self._durable = self._complete_end

    def durable_lsn(self) -> LSN:
        """The end LSN of the newest transaction whose changes are all committed to Delta (does not wait)."""
        self._collect(wait=False)
        return LSN(self._durable)

    def finish(self) -> LSN:
        """Wait for every write; returns :meth:`durable_lsn`."""
        self._collect(wait=True)
        return LSN(self._durable)

    def close(self) -> None:
        """Wait for a write in flight (it cannot be cancelled), then stop the writer thread."""
        for future, _ in self._in_flight:
            try:
                self._wait(future)
            except Exception:  # noqa: BLE001 - closing after a failure: the failure is already on its way
                break
        self._writer.shutdown(wait=True)

    def _write(self, operation: Callable[..., None], *args: object, **kwargs: object) -> None:
        """Run a Delta write in the writer thread, after those submitted before it."""
        self._collect(wait=False)
        while self._in_flight:
            self._collect_one()
        self._in_flight.append((self._writer.submit(operation, self._spark, *args, **kwargs), None))

    def _collect(self, wait: bool) -> None:
        while self._in_flight and (wait or self._in_flight[0][0].done()):
            self._collect_one()

    def _collect_one(self) -> None:
        future, durable = self._in_flight.popleft()
        self._wait(future)  # a failed write fails the run here, before anything later is confirmed
        if durable is not None:
            self._durable = durable

    def _wait(self, future: Future):  # type: ignore[type-arg]
        """The future's result; calls the heartbeat while waiting, however long a Delta commit takes."""
        heartbeat = self._heartbeat
        if heartbeat is not None:
            while not future.done():
                heartbeat()
                wait((future,), timeout=HEARTBEAT_SECONDS, return_when=FIRST_COMPLETED)
        return future.result()

    def _call(self, operation: Callable[..., object], *args: object) -> object:
        """Run a Spark call on the writer thread after every queued write, and wait for its result."""
        self._collect(wait=True)
        return self._wait(self._writer.submit(operation, self._spark, *args))

    # -- schema

    def _use_relation(self, target: TableTarget, relation: Relation, end: int, seq: int) -> None:
        """Adopt a table's Relation message (at position ``seq`` of the transaction ending at ``end``)."""
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
        self._collect(wait=True)  # the schema is read and changed below, behind the queued writes
        columns = self._types.columns(relation)
        key_index = tuple(i for i, column in enumerate(relation.columns) if column.is_key)
        if relation.replica_identity == "f":
            target.mode, target.key_index = FULL, tuple(range(len(relation.columns)))
        elif key_index:
            target.mode, target.key_index = KEYED, key_index
        else:
            target.mode, target.key_index = APPEND, ()
        if target.mode in MARKED_MODES and not target.applied_marker_loaded:
            target.applied_marker = self._call(read_applied_marker, target.path)  # type: ignore[assignment]
            target.applied_marker_loaded = True
        self._reconcile_schema(target, columns, previous, relation, end, seq)
        target.relation = relation
        target.columns = columns

    def _reconcile_schema(
        self,
        target: TableTarget,
        columns: list[PgColumnType],
        previous: Relation | None,
        relation: Relation,
        end: int,
        seq: int,
    ) -> None:
        if target.delta_schema is None:
            target.delta_schema = self._call(table_schema, target.path)  # type: ignore[assignment]
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
        # Columns new since the previous Relation message (or, for the first one of the run, new
        # to Delta): the rows already in Delta need what PostgreSQL gave its existing rows.
        seen = {c.name for c in previous.columns} if previous is not None else set(existing)
        fills = self._fills(target, relation, columns, [c for c in columns if c.column not in seen], end, seq)
        added = [f for f in added if f.name not in fills]
        if widened:
            self._log(f"{target.table}: widening {', '.join(sorted(widened))} (rewrites the Delta table)")
            self._call(widen_columns, target.path, widened)
        if added:
            self._log(f"{target.table}: adding column(s) {', '.join(f.name for f in added)}")
            self._call(add_columns, target.path, pa.schema(added))
        if fills:
            self._log(
                f"{target.table}: setting {', '.join(fills)} in the rows written up to {LSN(end)} to the value "
                "PostgreSQL gave the rows that existed when the column was added (rewrites the Delta table)"
            )
            values = pa.table({name: value for name, value in fills.items()})
            self._call(fill_columns, target.path, values, LSN_COLUMN, end)
        if widened or added or fills:
            target.delta_schema = self._call(table_schema, target.path)  # type: ignore[assignment]
        names = {column.column for column in columns}
        target.dropped = [
            f for f in target.delta_schema if f.name not in names and not f.name.startswith("_pgcdc_")
        ]

    def _fills(
        self,
        target: TableTarget,
        relation: Relation,
        columns: list[PgColumnType],
        new: list[PgColumnType],
        end: int,
        seq: int,
    ) -> dict[str, pa.Array]:
        """The value (one-element typed array) each newly appearing column must get in the rows
        already in Delta, for the columns that need one.

        ``ALTER TABLE ... ADD COLUMN c ... DEFAULT x`` gives existing rows ``x`` without any row
        change in the WAL: PostgreSQL 11+ stores a non-volatile default once as the column's
        missing value (pg_attribute.attmissingval). A volatile default, or one set after the
        column was added, is in the rows themselves and cannot be told from the catalog.
        """
        if not new:
            return {}
        if target.mode in MARKED_MODES and target.applied_marker is not None and target.applied_marker >= (end, seq):
            return {}  # a replay: changes after this Relation message are in Delta, so it was handled before
        facts = self._types.added_columns(relation, [c.column for c in new])
        in_delta = {f.name for f in target.delta_schema or []}
        fills: dict[str, pa.Array] = {}
        for column, attribute in zip(columns, relation.columns):
            if column not in new:
                continue
            name = column.column
            seen = facts.get(name)
            if not seen:
                # Gone again (dropped or renamed) before we looked, which also clears its missing value.
                # It is a dropped column in Delta from here on; only the rows written before it was
                # added lack what PostgreSQL gave them there (NULL instead), which no longer exists in
                # PostgreSQL. Refusing would stop every ADD COLUMN ... DROP COLUMN between two runs.
                self._log(
                    f"warning: {target.table}: column {name} was added and is gone again (dropped or renamed) "
                    "before this run: rows written before it was added hold NULL in it in Delta"
                )
                continue
            if len(seen) > 1:
                raise SchemaChangeError(
                    f"column {name!r} of {target.table} differs between its partitions: "
                    "what its existing rows hold cannot be told from the catalog",
                    RESNAPSHOT_FIX,
                )
            ((type_oid, has_missing, missing, has_default),) = seen
            if has_missing and type_oid != attribute.type_oid:
                # A type change rewrites the table and clears the missing value: this one belongs to
                # a column of the same name added again since.
                raise SchemaChangeError(
                    f"column {name!r} of {target.table} was added and has since been dropped and added again: "
                    "what its existing rows held cannot be read any more",
                    RESNAPSHOT_FIX,
                )
            if has_missing:
                try:
                    fills[name] = to_arrow(pa.array([missing], pa.string()), column)
                except PgValueError as exc:
                    raise ChangeValueError(
                        f"cannot apply the default of the added column {name!r} to {target.table}: {exc}",
                        "fix the value in PostgreSQL or replicate that column as text, then re-snapshot the table",
                    ) from exc
            elif has_default:
                raise SchemaChangeError(
                    f"column {name!r} of {target.table} was added with a default that PostgreSQL wrote into the "
                    "existing rows without logging them (a volatile default, or a default set after the column "
                    "was added)",
                    RESNAPSHOT_FIX,
                )
            elif name in in_delta:
                # Added again under the name of a column dropped earlier (kept in Delta): existing rows are NULL.
                fills[name] = pa.nulls(1, arrow_type(column))
        return fills

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
            self._use_relation(target, relation, end, seq)
        if target.mode in MARKED_MODES and target.applied_marker is not None and (end, seq) <= target.applied_marker:
            return
        if target.pending:
            self._flush_target(target)
        fault_point("before_merge")
        self._write(delete_all_rows, target.path)
        target.stats.truncates += 1
        target.stats.applied_lsn = LSN(end)

    def _flush_target(self, target: TableTarget) -> None:
        pending, target.pending = target.pending, []
        self.pending_changes -= sum(len(taken) for _, taken, _, _ in pending)
        self.pending_bytes -= target.pending_bytes
        target.pending_bytes = 0
        for rows in _gather(pending):
            fault_point("before_merge")
            if target.mode == APPEND:
                self._append(target, rows)
            elif target.mode == FULL:
                self._replace_full(target, rows)
            elif not self._merge_columnar(target, rows):
                self._merge_by_row(target, rows)
            self.changes_applied += len(rows)
            target.stats.applied_lsn = LSN(max(int(rows.lsns.max()), target.stats.applied_lsn or 0))

    def _merge(self, target: TableTarget, batch: pa.Table, key_columns: list[str]) -> None:
        """MERGE a folded batch, in pieces of at most ``max_merge_rows`` source rows.

        The batch holds one change per key, so the pieces touch disjoint rows and their order
        does not matter, with one exception: a moved row that keeps unchanged-TOAST values reads
        them from the row under its old key, which the batch deletes; deletes therefore go last.
        The pieces are queued together; the batch is durable when the last one is.
        """
        limit = self._max_merge_rows
        if batch.num_rows <= limit:
            self._write(merge_batch, target.path, batch, key_columns)
            return
        batch = batch.take(pc.sort_indices(pc.equal(batch.column(OP_COLUMN), "D")))  # stable: deletes last
        for start in range(0, batch.num_rows, limit):
            piece = batch.slice(start, limit)
            if start == 0:
                self._write(merge_batch, target.path, piece, key_columns)
            else:
                future = self._writer.submit(merge_batch, self._spark, target.path, piece, key_columns)
                self._in_flight.append((future, None))

    def _append(self, target: TableTarget, rows: PendingRows) -> None:
        columns, _ = tuple_columns_at(rows.data, rows.new, len(target.columns))
        lsns = pa.array(rows.lsns, pa.int64())
        batch = self._arrow_batch(target, columns, [None] * len(columns), lsns, None)
        end, seq = int(rows.lsns[-1]), int(rows.seqs[-1])
        self._write(append_rows, target.path, batch, _applied_marker(APPEND, end, seq))
        target.applied_marker = (end, seq)
        target.stats.inserted += len(rows)

    def _replace_full(self, target: TableTarget, rows: PendingRows) -> None:
        """REPLICA IDENTITY FULL: fold the changes into net copies per row value, then rewrite the
        copies of the changed values, a commit (with its applied marker) per few thousand values."""
        ncols = len(target.columns)
        new_images = _row_values(*tuple_columns_at(rows.data, rows.new, ncols))
        old_images = _row_values(*tuple_columns_at(rows.data, rows.old, ncols))
        ops = rows.ops.tolist()
        if any(op == UPDATE for op, old in zip(ops, rows.old.tolist()) if old < 0):
            raise PgcdcError(
                f"an UPDATE of {target.table} (REPLICA IDENTITY FULL) arrived without its old row",
                "PostgreSQL sends the old row only for a table (for a partition: the partition itself) with REPLICA "
                "IDENTITY FULL; set it there, then re-snapshot the table",
            )
        value_columns = [column.column for column in target.columns]
        for group in fold_row_changes(ops, old_images, new_images, rows.lsns.tolist(), self._max_replace_values):
            changed = group.changed()
            if not changed:
                continue  # copies added and removed again within the batch: Delta stays as it is
            end, seq = int(rows.lsns[group.stop - 1]), int(rows.seqs[group.stop - 1])
            probe = self._row_values_table(target, changed)
            rewrite = functools.partial(
                apply_row_deltas,
                changes=probe,
                value_columns=value_columns,
                lsn_column=LSN_COLUMN,
                on_missing=functools.partial(self._warn_missing_rows, target),
            )
            self._write(replace_rows, target.path, probe.select(value_columns), rewrite, _applied_marker(FULL, end, seq))
            target.applied_marker = (end, seq)
        stats = target.stats
        stats.inserted += int((rows.ops == INSERT).sum())
        stats.updated += int((rows.ops == UPDATE).sum())
        stats.deleted += int((rows.ops == DELETE).sum())

    def _row_values_table(self, target: TableTarget, changed: dict[tuple, RowDelta]) -> pa.Table:
        """Folded row values (text form) as typed columns, with their net count and new copies' LSN."""
        values = list(changed)
        columns = [pa.array([row[i] for row in values], pa.binary()) for i in range(len(target.columns))]
        lsns = pa.array([delta.lsn for delta in changed.values()], pa.int64())
        table = self._arrow_batch(target, columns, [None] * len(columns), lsns, None)
        table = table.select([column.column for column in target.columns] + [LSN_COLUMN])
        return table.append_column(NET_COLUMN, pa.array([delta.net for delta in changed.values()], pa.int64()))

    def _warn_missing_rows(self, target: TableTarget, missing: int) -> None:
        """Called on the writer thread when Delta lacks copies a change removes (Delta and PostgreSQL
        differed before it); PostgreSQL's subscriber logs such a change and goes on, and so does pgcdc."""
        self._log(
            f"warning: {target.table}: {missing} row(s) to delete or update were not in Delta (REPLICA IDENTITY "
            f"FULL: Delta differed from PostgreSQL before this change); {RESNAPSHOT_FIX} to realign it"
        )

    def _merge_columnar(self, target: TableTarget, rows: PendingRows) -> bool:
        """The fast path for keyed tables: parse every row image column-wise, keep the last per key.

        Returns False, having written nothing, when a value is unchanged TOAST: folding those
        needs the earlier images of the same key (``_merge_by_row``).
        """
        n = len(rows)
        # Each change contributes its old key's image first (a delete, or the row an update
        # moved away from), then its new image.
        positions = np.stack([rows.old, rows.new], axis=1).ravel()
        ops = np.stack([np.full(n, DELETE, np.uint8), rows.ops], axis=1).ravel()
        lsns = np.repeat(rows.lsns, 2)
        present = positions >= 0
        positions, ops, lsns = positions[present], ops[present], lsns[present]
        columns, unchanged = tuple_columns_at(rows.data, positions, len(target.columns))
        if any(mask.any() for mask in unchanged):
            return False
        keys = {f"k{i}": pc.cast(columns[i], pa.binary()) for i in target.key_index}
        keys["row"] = pa.array(np.arange(len(positions), dtype=np.int64))
        last = pa.table(keys).group_by([f"k{i}" for i in target.key_index], use_threads=False).aggregate([("row", "max")])
        index = np.sort(last.column("row_max").to_numpy())
        batch = self._arrow_batch(target, columns, [None] * len(columns), pa.array(lsns[index]), None, pa.array(index))
        kept = ops[index]
        op_names = np.where(kept == INSERT, "I", np.where(kept == UPDATE, "U", "D"))
        batch = batch.append_column(OP_COLUMN, pa.array(op_names, pa.string()))
        key_columns = [target.columns[i].column for i in target.key_index]
        self._merge(target, batch, key_columns)
        stats = target.stats
        stats.inserted += int((rows.ops == INSERT).sum())
        stats.updated += int((rows.ops == UPDATE).sum())
        stats.deleted += int((rows.ops == DELETE).sum())
        return True

    def _merge_by_row(self, target: TableTarget, rows: PendingRows) -> None:
        """Fold change by change (keyed tables with unchanged TOAST), then one MERGE."""
        ncols = len(target.columns)
        new_images = _row_values(*tuple_columns_at(rows.data, rows.new, ncols))
        old_images = _row_values(*tuple_columns_at(rows.data, rows.old, ncols))
        index = target.key_index
        unchanged = UNCHANGED_TOAST
        final: dict[tuple, tuple] = {}
        old_key_of: dict[tuple, tuple] = {}
        inserted = updated = deleted = 0
        ops = [chr(op) for op in rows.ops.tolist()]
        for op, old_start, end, new, old in zip(ops, rows.old.tolist(), rows.lsns.tolist(), new_images, old_images):
            if op == "I":
                key = tuple([new[i] for i in index])
                final[key] = ("I", new, end)
                old_key_of.pop(key, None)
                inserted += 1
            elif op == "U":
                values = new
                new_key = tuple([values[i] for i in index])
                old_key = new_key if old_start < 0 else tuple([old[i] for i in index])
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
        columns: list[pa.Array] = []
        flags: list[pa.Array | None] = []
        for i in range(ncols):
            values = [change[1][i] for change in changes]
            if unchanged in values:
                flags.append(pa.array([value is unchanged for value in values], pa.bool_()))
                values = [None if value is unchanged else value for value in values]
            else:
                flags.append(None)
            columns.append(pa.array(values, pa.binary()))
        old_keys = None
        if old_key_of:
            moved = [old_key_of.get(key) for key in final]
            old_keys = [
                pa.array([None if key is None else key[position] for key in moved], pa.binary())
                for position in range(len(index))
            ]
        lsns = pa.array([change[2] for change in changes], pa.int64())
        batch = self._arrow_batch(target, columns, flags, lsns, old_keys)
        batch = batch.append_column(OP_COLUMN, pa.array([change[0] for change in changes], pa.string()))
        key_columns = [target.columns[i].column for i in index]
        self._merge(target, batch, key_columns)
        stats = target.stats
        stats.inserted += inserted
        stats.updated += updated
        stats.deleted += deleted

    def _arrow_batch(
        self,
        target: TableTarget,
        columns: list[pa.Array],
        flags: list[pa.Array | None],
        lsns: pa.Array,
        old_keys: list[pa.Array] | None,
        index: pa.Array | None = None,
    ) -> pa.Table:
        """Text columns -> typed columns (then the rows at ``index``, if given), plus unchanged-TOAST
        flags, ``_pgcdc_lsn`` and dropped columns."""
        arrays = [self._convert(target, values, column) for values, column in zip(columns, target.columns)]
        if index is not None:
            arrays = [array.take(index) for array in arrays]
        names = [column.column for column in target.columns]
        if old_keys is not None and any(flag is not None for flag in flags):
            for values, i in zip(old_keys, target.key_index):
                arrays.append(self._convert(target, values, target.columns[i]))
                names.append(OLD_KEY_PREFIX + target.columns[i].column)
        for flag, column in zip(flags, target.columns):
            if flag is not None:
                arrays.append(flag)
                names.append(unchanged_flag_column(column.column))
        arrays.append(lsns)
        names.append(LSN_COLUMN)
        for dropped in target.dropped:
            arrays.append(pa.nulls(len(lsns), dropped.type))
            names.append(dropped.name)
        return pa.Table.from_arrays(arrays, names)

    @staticmethod
    def _convert(target: TableTarget, values: pa.Array, column: PgColumnType) -> pa.Array:
        try:
            return to_arrow(values, column)
        except PgValueError as exc:
            raise ChangeValueError(
                f"cannot apply a change to {target.table}: {exc}",
                "fix the value in PostgreSQL or replicate that column as text, then re-snapshot the table",
            ) from exc


# --------------------------------------------------------------------------- column-wise TupleData parsing

_SLICE_BYTES = 1 << 30
"""Payload bytes parsed at once: string views address their buffer with 32-bit offsets."""
_LANES = np.arange(12)


def tuple_columns(payloads: list[bytes], starts: list[int], ncols: int) -> tuple[list[pa.Array], list[np.ndarray]]:
    """Parse the TupleData at ``starts[i]`` in ``payloads[i]`` (-1: none, all NULL) into columns.

    Returns per column a ``binary_view`` array of the values' text (NULL where NULL, absent
    or unchanged TOAST) and a boolean mask of the unchanged-TOAST cells. The work is numpy
    over all rows per column, never Python per value: the views point into one joined
    buffer of the payloads, and only values of at most 12 bytes are copied (inline).
    """
    if not payloads:
        return tuple_columns_at(b"", np.zeros(0, np.int64), ncols)
    pieces: list[tuple[list[pa.Array], list[np.ndarray]]] = []
    first = 0
    total = 0
    for i, payload in enumerate(payloads):
        if total + len(payload) > _SLICE_BYTES and i > first:
            pieces.append(_parse_payloads(payloads[first:i], starts[first:i], ncols))
            first, total = i, 0
        total += len(payload)
    pieces.append(_parse_payloads(payloads[first:], starts[first:], ncols))
    if len(pieces) == 1:
        return pieces[0]
    columns = [pa.concat_arrays([piece[0][c] for piece in pieces]) for c in range(ncols)]
    masks = [np.concatenate([piece[1][c] for piece in pieces]) for c in range(ncols)]
    return columns, masks


def _parse_payloads(payloads: list[bytes], starts: list[int], ncols: int) -> tuple[list[pa.Array], list[np.ndarray]]:
    n = len(payloads)
    sizes = np.fromiter(map(len, payloads), np.int64, n)
    base = np.zeros(n, np.int64)
    np.cumsum(sizes[:-1], out=base[1:])
    start = np.asarray(starts, np.int64)
    return tuple_columns_at(b"".join(payloads), np.where(start >= 0, base + start, -1), ncols)


def tuple_columns_at(data: bytes, positions: np.ndarray, ncols: int) -> tuple[list[pa.Array], list[np.ndarray]]:
    """:func:`tuple_columns` for TupleData at absolute ``positions`` in ``data`` (-1: none, all NULL).

    ``data`` must stay under 2 GiB (string views address it with 32-bit offsets).
    """
    n = len(positions)
    if not n:
        return [pa.array([], pa.binary_view()) for _ in range(ncols)], [np.zeros(0, bool) for _ in range(ncols)]
    if len(data) >= 1 << 31:
        raise ValueError("TupleData buffer over 2 GiB")
    buf = np.frombuffer(data, np.uint8)
    last = len(buf) - 1
    start = np.asarray(positions, np.int64)
    present = start >= 0
    pos = np.where(present, start, 0) + 2
    if pos.max() > last + 1:
        raise PgcdcError("a row image lies outside its message", "the replication stream is inconsistent; restart replication")
    counts = (buf[pos - 2].astype(np.int64) << 8) | buf[pos - 1]
    if (counts[present] != ncols).any():
        raise PgcdcError(
            f"a row image has {int(counts[present][counts[present] != ncols][0])} columns where its Relation message"
            f" has {ncols}",
            "the replication stream is inconsistent; restart replication",
        )
    data_buffer = pa.py_buffer(data)
    columns: list[pa.Array] = []
    masks: list[np.ndarray] = []
    for _ in range(ncols):
        at = np.where(present, np.minimum(pos, last), 0)
        kind = np.where(present, buf[at], NULL)
        has = (kind == TEXT) | (kind == BINARY)
        length_bytes = buf[np.minimum(at[:, None] + np.arange(1, 5), last)].astype(np.int64)
        size = np.where(
            has,
            (length_bytes[:, 0] << 24) | (length_bytes[:, 1] << 16) | (length_bytes[:, 2] << 8) | length_bytes[:, 3],
            0,
        )
        data_at = at + 5
        if (has & (data_at + size > len(buf))).any():
            raise PgcdcError("a value runs past the end of its message", "the replication stream is inconsistent; restart replication")
        inline = buf[np.minimum(data_at[:, None] + _LANES, last)]
        inline[_LANES[None, :] >= size[:, None]] = 0
        views = np.zeros((n, 16), np.uint8)
        views[:, 0:4] = size.astype("<i4").view(np.uint8).reshape(n, 4)
        views[:, 4:16] = inline
        long = size > 12
        if long.any():
            views[long, 8:12] = 0  # buffer index 0: the joined payloads
            views[long, 12:16] = data_at[long].astype("<i4").view(np.uint8).reshape(-1, 4)
        validity = np.packbits(has, bitorder="little")
        columns.append(
            pa.Array.from_buffers(pa.binary_view(), n, [pa.py_buffer(validity), pa.py_buffer(views), data_buffer])
        )
        masks.append(present & (kind == UNCHANGED))
        pos = pos + np.where(has, 5 + size, 1)
    return columns, masks


class PendingRows:
    """Pending row changes of one table, gathered for a write: one buffer and column arrays."""

    __slots__ = ("data", "ops", "new", "old", "lsns", "seqs")

    def __init__(self, data: bytes, ops: np.ndarray, new: np.ndarray, old: np.ndarray, lsns: np.ndarray, seqs: np.ndarray) -> None:
        self.data, self.ops, self.new, self.old, self.lsns, self.seqs = data, ops, new, old, lsns, seqs

    def __len__(self) -> int:
        return len(self.ops)


def _gather(pending: list[tuple[RowBatch, np.ndarray, int, int]]) -> list[PendingRows]:
    """Pending slices (batch, row indexes, commit end LSN, first position) -> PendingRows, in order;
    more than one only when their buffers together would pass :data:`_SLICE_BYTES`."""
    groups: list[PendingRows] = []
    first = 0
    while first < len(pending):
        offsets: dict[int, int] = {}
        buffers: list[bytes] = []
        total = 0
        stop = first
        while stop < len(pending):
            batch = pending[stop][0]
            if id(batch) not in offsets:
                if buffers and total + len(batch.data) > _SLICE_BYTES:
                    break
                offsets[id(batch)] = total
                buffers.append(batch.data)
                total += len(batch.data)
            stop += 1
        parts = pending[first:stop]
        shifts = [offsets[id(batch)] for batch, _, _, _ in parts]
        new = np.concatenate([_shifted(batch.new[index], shift) for (batch, index, _, _), shift in zip(parts, shifts)])
        old = np.concatenate([_shifted(batch.old[index], shift) for (batch, index, _, _), shift in zip(parts, shifts)])
        ops = np.concatenate([batch.ops[index] for batch, index, _, _ in parts])
        lsns = np.concatenate([np.full(len(index), end, np.int64) for _, index, end, _ in parts])
        seqs = np.concatenate([index + seq for _, index, _, seq in parts])
        groups.append(PendingRows(b"".join(buffers), ops, new, old, lsns, seqs))
        first = stop
    return groups


def _shifted(positions: np.ndarray, shift: int) -> np.ndarray:
    return np.where(positions >= 0, positions + shift, -1) if shift else positions


def _row_values(columns: list[pa.Array], masks: list[np.ndarray]) -> list[tuple]:
    """Columns back to row tuples of bytes / None / UNCHANGED_TOAST, for the change-by-change fold."""
    lists = []
    for column, mask in zip(columns, masks):
        values = column.to_pylist()
        if mask.any():
            for i in np.flatnonzero(mask):
                values[i] = UNCHANGED_TOAST
        lists.append(values)
    return list(zip(*lists))
