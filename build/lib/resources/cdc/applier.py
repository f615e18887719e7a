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
  (``resources/delta/merge.py: replace_rows``), in commits of a few thousand values, each carrying the
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
consistent point is a record boundary, so that is exactly the set the snapshot holds). A table
snapshotted in primary-key ranges decides per row image instead, by its range's own point
(:meth:`ChangeApplier._key_range_pieces`; docs/contracts.md, "Chunked snapshots in primary-key ranges").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from resources.cdc.history import (
    changelog_rows,
    changes_marker,
    history_position,
    DeltaLookups,
    event_row,
    read_marker,
    resolve_lookups,
    seed_marker,
    seed_rows,
    with_schema,
)
from resources.cdc.row_batches import gather, PendingRows, RowBatch
from resources.cdc.row_multiset import apply_row_deltas, fold_row_changes, NET_COLUMN, RowDelta
from resources.cdc.schema import ChangeValueError, RESNAPSHOT_FIX, SchemaChangeError, SchemaReconciler
from resources.cdc.tables import APPEND, FULL, KEYED, MARKED_MODES, TableTarget
from resources.cdc.transactions import CommittedTransaction
from resources.cdc.writer import OrderedWriter
from resources.delta.destination import Destination, TableLog
from resources.delta.layout import BUCKET_COLUMN, row_buckets
from resources.delta.markers import APPEND_MARKER, applied_marker, EXPIRED_SNAPSHOT_LSN, LSN_COLUMN, REPLACE_MARKER
from resources.delta.merge import OLD_KEY_PREFIX, OP_COLUMN, unchanged_flag_column
from resources.errors import PgcdcError
from resources.lsn import LSN
from resources.pgoutput.messages import Relation, UNCHANGED_TOAST
from resources.pgoutput.tags import DELETE, INSERT, UPDATE
from resources.pgoutput.tuples import row_values, tuple_columns_at
from resources.pgtypes import arrow_type, PgColumnType, PgValueError, to_arrow
from resources.postgres.catalog import TableName
from resources.postgres.column_types import ColumnTypes
from resources.crash_points import fault_point

__all__ = [
    "ChangeApplier",
]


DEFAULT_REPLACE_VALUES = 2_000
"""Most distinct row values one REPLICA IDENTITY FULL commit rewrites: its predicate lists their
hashes, and Sail 0.7.2 plans about 0.2 ms per listed value (docs/contracts.md)."""
DEFAULT_MERGE_ROWS = 200_000
"""Most source rows per MERGE. Smaller pieces lowered Sail's memory only at a steep throughput cost
(docs/engine-notes.md: 25k rows 1.4 GiB at 0.3x the speed; 50k no lower than one MERGE per chunk), so
by default a chunk (200k changes) is still one MERGE per table."""


class ChangeApplier:
    """Routes committed transactions into per-table batches and writes them to Delta.

    :meth:`durable_lsn` is the end LSN of the newest transaction all of whose changes are in
    Delta: the only position that may be confirmed to the slot. A transaction larger than
    the chunk bound is written in several Delta commits (readers may see part of it
    meanwhile); it becomes durable with the last one.
    """

    def __init__(
        self,
        destination: Destination,
        types: ColumnTypes,
        targets: Mapping[TableName, TableTarget],
        *,
        max_changes: int,
        max_bytes: int,
        log: Callable[[str], None],
        heartbeat: Callable[[], None] | None = None,
        max_merge_rows: int = DEFAULT_MERGE_ROWS,
        max_replace_values: int = DEFAULT_REPLACE_VALUES,
        recopy_range: Callable[[TableName, str, TableLog, int], None] | None = None,
    ) -> None:
        """``heartbeat`` is called about every :data:`~resources.cdc.writer.HEARTBEAT_SECONDS` while this thread waits
        for Delta (e.g. ``ReplicationStream.keepalive``, so the walsender does not time out).

        ``recopy_range(table, path, log, k)`` copies range k of a table snapshotted in key ranges
        (``log``: its log as this drain knows it, ranges and layout) again, at a new consistent point,
        in one commit carrying its marker (see :meth:`_key_range_pieces`
        for when); without it such a table's drain stops there with an error."""
        self._destination = destination
        self._types = types
        self._targets = targets
        self._max_changes = max(1, max_changes)
        self._max_bytes = max(1, max_bytes)
        self._max_merge_rows = max(1, max_merge_rows)
        self._max_replace_values = max(2, max_replace_values)
        self._recopy_range = recopy_range
        self._log = log
        self._relations: dict[int, Relation] = {}
        self._target_by_oid: dict[int, TableTarget | None] = {}
        self._complete_end = 0
        #: Commit end LSN -> (xid, commit time) of the transactions the pending changes belong to (changelogs).
        self._transactions: dict[int, tuple[int, datetime]] = {}
        self._writer = OrderedWriter(heartbeat)
        self._schema = SchemaReconciler(destination, self._writer, types, log, before_fill=self._write_fill_history)
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
        if not self.pending_changes:
            self._transactions.clear()
        self._transactions[end] = (txn.xid, txn.commit_time)
        # A change's position in its transaction, counting row changes and TRUNCATEs only: the server
        # sends a Relation message when its session first needs one, so a replay in a new session
        # carries Relation messages where the first stream had none, and positions counted with
        # them would not match the applied marker's (changes would be applied twice).
        seq = 0
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
                        if target is not None and not self._skips(target, end):
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
            if target is None or self._skips(target, end):
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

    def _skips(self, target: TableTarget, end: int) -> bool:
        """:meth:`TableTarget.skips`, reading the table's own log the first time the run meets it.

        Only tables with changes are read, and only once a run: this run's writes to the table
        all come after, and it tracks the applied marker itself from then on. The read is of a
        table no queued write touches yet, so it need not wait for the writer thread.
        """
        if target.log is None:
            target.log = self._destination.read_table_log(target.path, target.known)
            target.applied_marker = target.log.applied_marker
            if target.history_path is not None:
                self._start_history(target)
        return target.skips(end)

    # -- changelogs (docs/history.md)

    def _start_history(self, target: TableTarget) -> None:
        """Read the changelog's marker; seed the changelog from the table when it does not start at the
        table's snapshot yet, which is exact only while the table's rows are that snapshot's (no commit
        after it but maintenance: a table property, compaction).

        A table whose snapshot commit has left its log (maintenance cleaned it) says no snapshot LSN
        any more: its changelog, seeded while the commit was there, goes on."""
        assert target.log is not None and target.history_path is not None
        log = target.log
        if log.chunks is not None:
            raise PgcdcError(
                f"{target.table}: a changelog starts at a snapshot of the whole table, and this one is snapshotted "
                "in primary-key ranges",
                "set its history to none, or raise snapshot.chunked_above_mb above its size and snapshot it again",
            )
        if log.snapshot_lsn is None:
            return  # no change applies to it: nothing to record
        version, marker = self._destination.newest_marker(target.history_path)
        if version is None:
            target.history_schema = pa.schema([])
        target.history_seed, target.history_marker = read_marker(target.table, marker)
        if target.history_seed is not None and (
            target.history_seed == log.snapshot_lsn or log.snapshot_lsn == EXPIRED_SNAPSHOT_LSN
        ):
            return
        if (
            log.snapshot_version is None
            or log.version is None
            or not self._destination.rows_unchanged_after(target.path, log.snapshot_version, log.version)
        ):
            raise PgcdcError(
                f"{target.table}: its changelog must start at a snapshot, and changes were applied to the table "
                f"since its latest one (at {log.snapshot_lsn})",
                "snapshot the table again (pgcdc_snapshot) to start its changelog, or set its history to none",
            )
        target.history_seed, target.history_marker = int(log.snapshot_lsn), None
        self._writer.write(self._seed_history, target, target.history_seed)

    def _seed_history(self, target: TableTarget, snapshot_lsn: int) -> None:
        """(Writer thread.) The table's rows, as its snapshot wrote them, as the changelog's seed."""
        rows = seed_rows(self._destination.read_rows(target.path, None), snapshot_lsn)
        self._append_history(target, rows, None, seed_marker(snapshot_lsn, str(target.table)))

    def _write_history(self, target: TableTarget, rows: PendingRows) -> None:
        """Queue the changelog rows of ``rows`` not in the changelog yet, ahead of the table's write of them."""
        marker = target.history_marker
        keep = np.ones(len(rows), bool)
        if marker is not None:
            keep = (rows.lsns > marker[0]) | ((rows.lsns == marker[0]) & (history_position(rows.seqs) > marker[1]))
        kept = np.flatnonzero(keep)
        if not len(kept):
            return
        batch, lookups = changelog_rows(target, rows, keep, self._transactions, functools.partial(self._convert, target))
        end, position = int(rows.lsns[kept[-1]]), int(history_position(rows.seqs[kept[-1]]))
        self._writer.write(self._append_history, target, batch, lookups, self._history_marker(target, end, position))
        self._writer.next_behind()  # the table's write of the same changes follows, while the next chunk is built
        target.history_marker = (end, position)
        target.stats.history_rows += len(kept)

    def _write_fill_history(self, target: TableTarget, values: pa.Table, end: int, seq: int) -> None:
        """The changelog row of a back-fill: the value PostgreSQL gave the existing rows in added columns.

        ``seq`` is the position of the change that brought the Relation message into use: the fill
        comes right before that change (a Relation message has no position of its own)."""
        self._write_event_history(target, "fill", values, end, seq, int(history_position(seq, before=True)))

    def _write_event_history(
        self, target: TableTarget, op: str, values: pa.Table | None, end: int, seq: int, position: int
    ) -> None:
        """Queue a changelog row for the whole table (a truncate, a fill) unless the changelog has it."""
        if target.history_path is None or (target.history_marker is not None and (end, position) <= target.history_marker):
            return
        row = event_row(op, values, end, seq, self._transactions[end])
        self._writer.write(self._append_history, target, row, None, self._history_marker(target, end, position))
        target.history_marker = (end, position)
        target.stats.history_rows += 1

    @staticmethod
    def _history_marker(target: TableTarget, end: int, seq: int) -> str:
        assert target.history_seed is not None, "a changelog is written after its seed"
        return changes_marker(end, seq, target.history_seed)

    def _append_history(self, target: TableTarget, batch: pa.Table, lookups: DeltaLookups | None, marker: str) -> None:
        """(Writer thread.) Fill the unchanged TOAST values the batch lacks from the table (before the
        batch's own write changes it), bring the changelog's columns along, append with the marker."""
        assert target.history_path is not None
        path = target.history_path
        if lookups is not None:
            batch = resolve_lookups(batch, lookups, self._destination.read_rows(target.path, lookups.keys), target.table)
        schema = target.history_schema
        if schema is None:
            schema = self._destination.table_schema(path)
        if len(schema):
            batch, added, widened = with_schema(batch, schema)
            if widened:
                self._destination.widen_columns(path, widened)
            if len(added):
                self._destination.add_columns(path, added)
        self._destination.append_rows(path, batch, marker)
        target.history_schema = batch.schema
        fault_point("after_history_commit")

    def flush(self) -> None:
        """Send every pending batch to Delta; once written, every completely added transaction is durable."""
        for target in self._targets.values():
            if target.pending:
                self._flush_target(target)
        self._writer.durable_after_queued(self._complete_end)

    def durable_lsn(self) -> LSN:
        """The end LSN of the newest transaction whose changes are all committed to Delta (does not wait)."""
        self._writer.collect(wait=False)
        return LSN(self._writer.durable)

    def finish(self) -> LSN:
        """Wait for every write; returns :meth:`durable_lsn`."""
        self._writer.collect(wait=True)
        return LSN(self._writer.durable)

    def close(self) -> None:
        """Wait for a write in flight (it cannot be cancelled), then stop the writer thread."""
        self._writer.close()

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
        self._writer.collect(wait=True)  # the schema is read and changed below, behind the queued writes
        columns = self._types.columns(relation)
        key_index = tuple(i for i, column in enumerate(relation.columns) if column.is_key)
        if relation.replica_identity == "f":
            # A primary key rules out duplicate rows: such a table is matched per key, as a keyed one.
            names = [column.name for column in relation.columns]
            primary_key = self._types.primary_key(relation)
            if primary_key and all(name in names for name in primary_key):
                target.mode, target.key_index = KEYED, tuple(names.index(name) for name in primary_key)
            else:
                target.mode, target.key_index = FULL, tuple(range(len(relation.columns)))
        elif key_index:
            target.mode, target.key_index = KEYED, key_index
        else:
            target.mode, target.key_index = APPEND, ()
        if self._schema.reconcile(target, columns, previous, relation, end, seq):
            target.stats.schema_changed = True
        target.relation = relation
        target.columns = columns
        self._choose_bucket_pruning(target)

    def _choose_bucket_pruning(self, target: TableTarget) -> None:
        """Decide how a bucketed table's MERGEs find their rows under this relation.

        A row's bucket is a function of the layout's key columns alone (``resources/delta/layout.py``),
        whatever the replica identity says, and a row whose bucket cannot be computed is written to the
        NULL bucket, which every bucket predicate includes. A MERGE names its batch's buckets only when
        they locate every row it can touch: the changes are matched by a key that contains the layout's
        key, whose columns the layout still buckets. Otherwise (replica identity FULL without a primary
        key, an index without the layout's columns, a layout column dropped or retyped, a layout no
        record names any more) the MERGE reads every bucket: exact, as PostgreSQL's subscriber is under
        any identity, and said in the run's metadata with what restores the pruning.
        """
        bucketed = target.delta_schema is not None and BUCKET_COLUMN in target.delta_schema.names
        layout = target.layout
        target.prune_buckets = False
        if layout is None and not bucketed:
            return
        if not bucketed:
            raise SchemaChangeError(
                f"the snapshot of {target.table} recorded {layout.describe()} but its Delta table has no {BUCKET_COLUMN} "  # type: ignore[union-attr]
                "column (rewritten by another writer?)",
                RESNAPSHOT_FIX,
            )
        if target.mode == APPEND:
            return  # appends read nothing
        types = {column.column: arrow_type(column) for column in target.columns}
        matched = [target.columns[i].column for i in target.key_index] if target.mode == KEYED else []
        if layout is None:
            why = "no record of its layout is left (its snapshot commit left the Delta log and the pgcdc state has none)"
            restore = "remove the table's Delta directory and snapshot the table again"
        elif any(name not in types for name in layout.key):
            why = f"its layout column(s) ({', '.join(layout.key)}) are no longer published"
            restore = "publish them again, or remove the table's Delta directory and snapshot the table again"
        elif not layout.can_bucket([types[name] for name in layout.key]):
            why = f"its layout column(s) ({', '.join(layout.key)}) changed type"
            restore = "remove the table's Delta directory and snapshot the table again"
        elif not set(layout.key) <= set(matched):
            identity = f"({', '.join(matched)})" if matched else "whole rows (REPLICA IDENTITY FULL)"
            why = f"its changes are matched by {identity}, which does not hold its layout's key ({', '.join(layout.key)})"
            restore = f"a replica identity that includes ({', '.join(layout.key)}) again"
        else:
            target.prune_buckets = True
            target.stats.unpruned = None
            return
        target.stats.unpruned = f"{why}: its MERGEs read every bucket until {restore}"
        self._log(f"{target.table}: {target.stats.unpruned}")

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
        self._write_event_history(target, "truncate", None, end, seq, int(history_position(seq)))
        self._writer.write(self._destination.delete_all_rows, target.path)
        target.stats.truncates += 1
        target.stats.applied_lsn = LSN(end)
        chunks = target.log.chunks if target.log is not None else None
        if chunks is not None:
            # A range copied at or after the truncate holds rows written after it, which the delete
            # just removed: copy each such range again (its new point lies beyond this change).
            for k, point in enumerate(chunks.points):
                if point is not None and point >= end:
                    self._recopy(target, k, end, "a TRUNCATE emptied it after its copy")

    def _flush_target(self, target: TableTarget) -> None:
        pending, target.pending = target.pending, []
        self.pending_changes -= sum(len(taken) for _, taken, _, _ in pending)
        self.pending_bytes -= target.pending_bytes
        target.pending_bytes = 0
        for gathered in gather(pending):
            assert target.log is not None, "the table's log is read before its changes are queued"
            pieces = self._key_range_pieces(target, gathered) if target.log.chunks is not None else (gathered,)
            for rows in pieces:
                fault_point("before_merge")
                if target.history_path is not None:
                    self._write_history(target, rows)
                if target.mode == APPEND:
                    self._append(target, rows)
                elif target.mode == FULL:
                    self._replace_full(target, rows)
                elif not self._merge_columnar(target, rows):
                    self._merge_by_row(target, rows)
                self._writer.next_behind(False)  # spent by the table's write, if the batch needed one
                self.changes_applied += len(rows)
                target.stats.applied_lsn = LSN(max(int(rows.lsns.max()), target.stats.applied_lsn or 0))

    def _key_range_pieces(self, target: TableTarget, rows: PendingRows) -> Iterator[PendingRows]:
        """The changes of a table snapshotted in key ranges that apply, by the drain rule per row image
        (:meth:`KeyRanges.applies`, docs/contracts.md): a change keeping only its old half becomes the
        delete of its old key, one keeping only its new half an upsert of its new key.

        One case has no sound answer from the stream: a row moved into a done range by an update that
        keeps unchanged-TOAST values, while its old half does not apply (its old row is not in Delta,
        so the kept values are unknown). Then the changes before it are written, the new key's range
        is copied again at a new consistent point (beyond this change, so the change is in that copy),
        and the rule goes on with the new point. Nothing wrong or NULL is ever written for it.
        """
        assert target.log is not None and target.log.chunks is not None
        names = [column.column for column in target.columns]
        if target.mode != KEYED or [names[i] for i in target.key_index] != [target.log.chunks.key]:
            raise SchemaChangeError(
                f"{target.table} is being snapshotted in ranges of its primary key ({target.log.chunks.key}), which is "
                "no longer its replica identity key",
                RESNAPSHOT_FIX,
            )
        key_at = target.key_index[0]
        new_columns, unchanged = tuple_columns_at(rows.data, rows.new, len(names))
        old_columns, _ = tuple_columns_at(rows.data, rows.old, len(names))
        new_keys, old_keys = _integer_keys(new_columns[key_at]), _integer_keys(old_columns[key_at])
        has_new, has_old = rows.new >= 0, rows.old >= 0
        kept_toast = np.logical_or.reduce(unchanged) if unchanged else np.zeros(len(rows), bool)
        moved_with_toast = has_old & has_new & (old_keys != new_keys) & kept_toast
        start = 0
        while start < len(rows):
            chunks = target.log.chunks
            assert chunks is not None
            lsns = rows.lsns[start:]
            new_applies = has_new[start:] & chunks.applies(new_keys[start:], lsns)
            old_applies = has_old[start:] & chunks.applies(old_keys[start:], lsns)
            holes = np.flatnonzero(new_applies & moved_with_toast[start:] & ~old_applies)
            stop = start + int(holes[0]) if len(holes) else len(rows)
            taken = stop - start
            piece = _halves(rows, start, new_applies[:taken], old_applies[:taken])
            self.changes_skipped += taken - len(piece)
            if len(piece):
                yield piece
            if stop == len(rows):
                return
            k = int(chunks.ranges_of(new_keys[stop : stop + 1])[0])
            self._recopy(target, k, int(rows.lsns[stop]), "a row moved into it kept unchanged-TOAST values of a row not in Delta")
            start = stop

    def _recopy(self, target: TableTarget, k: int, lsn: int, why: str) -> None:
        """Copy range k of the table again (after every queued write), then re-read its log from the
        range's commit on; its new point must lie at or beyond ``lsn``, the change that needed it."""
        assert target.log is not None and target.log.chunks is not None
        if self._recopy_range is None:
            raise PgcdcError(
                f"{target.table}: key range {k} must be copied again ({why}) and this run cannot copy",
                "run the table's snapshot (pgcdc_snapshot) to continue its snapshot in key ranges",
            )
        self._log(f"{target.table}: copying key range {k + 1} of {target.log.chunks.count} again: {why}")
        self._writer.call(self._recopy_range, target.table, target.path, target.log, k)
        target.log = self._writer.call(self._destination.read_table_log, target.path, target.log)
        chunks = target.log.chunks if target.log is not None else None
        point = chunks.points[k] if chunks is not None else None
        if point is None or point < lsn:
            raise PgcdcError(
                f"{target.table}: key range {k} was copied again but its log does not show it done after {LSN(lsn)}",
                "another writer changed the table's Delta directory; re-snapshot the table",
            )

    def _merge(self, target: TableTarget, batch: pa.Table, key_columns: list[str]) -> None:
        """MERGE a folded batch, in pieces of at most ``max_merge_rows`` source rows.

        The batch holds one change per key, so the pieces touch disjoint rows and their order
        does not matter, with one exception: a moved row that keeps unchanged-TOAST values reads
        them from the row under its old key, which the batch deletes; deletes therefore go last.
        The pieces are queued together; the batch is durable when the last one is.
        """
        limit = self._max_merge_rows
        if batch.num_rows <= limit:
            self._writer.write(self._destination.merge_batch, target.path, batch, key_columns, target.prune_buckets)
            return
        batch = batch.take(pc.sort_indices(pc.equal(batch.column(OP_COLUMN), "D")))  # stable: deletes last
        for start in range(0, batch.num_rows, limit):
            piece = batch.slice(start, limit)
            if start == 0:
                self._writer.write(self._destination.merge_batch, target.path, piece, key_columns, target.prune_buckets)
            else:
                self._writer.write_behind(self._destination.merge_batch, target.path, piece, key_columns, target.prune_buckets)

    def _append(self, target: TableTarget, rows: PendingRows) -> None:
        columns, _ = tuple_columns_at(rows.data, rows.new, len(target.columns))
        lsns = pa.array(rows.lsns, pa.int64())
        batch = self._arrow_batch(target, columns, [None] * len(columns), lsns, None)
        end, seq = int(rows.lsns[-1]), int(rows.seqs[-1])
        self._writer.write(self._destination.append_rows, target.path, batch, applied_marker(APPEND_MARKER, end, seq))
        target.applied_marker = (end, seq)
        target.stats.inserted += len(rows)

    def _replace_full(self, target: TableTarget, rows: PendingRows) -> None:
        """REPLICA IDENTITY FULL: fold the changes into net copies per row value, then rewrite the
        copies of the changed values, a commit (with its applied marker) per few thousand values."""
        ncols = len(target.columns)
        new_images = row_values(*tuple_columns_at(rows.data, rows.new, ncols))
        old_images = row_values(*tuple_columns_at(rows.data, rows.old, ncols))
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
            self._writer.write(self._destination.replace_rows, target.path, probe.select(value_columns), rewrite, applied_marker(REPLACE_MARKER, end, seq))
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
        bucket = [BUCKET_COLUMN] if BUCKET_COLUMN in table.column_names else []  # new copies land in their own bucket
        table = table.select([column.column for column in target.columns] + bucket + [LSN_COLUMN])
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
        new_images = row_values(*tuple_columns_at(rows.data, rows.new, ncols))
        old_images = row_values(*tuple_columns_at(rows.data, rows.old, ncols))
        index = target.key_index
        unchanged = UNCHANGED_TOAST
        final: dict[tuple, tuple] = {}
        old_key_of: dict[tuple, tuple] = {}
        values: Sequence[object]  # a row image: a tuple as decoded, a list once unchanged TOAST is filled in
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
        """Text columns -> typed columns (then the rows at ``index``, if given), plus the bucket (of the
        row's key, and of the old key of a moved row), unchanged-TOAST flags, ``_pgcdc_lsn`` and dropped columns."""
        arrays = [self._convert(target, values, column) for values, column in zip(columns, target.columns)]
        if index is not None:
            arrays = [array.take(index) for array in arrays]
        names = [column.column for column in target.columns]
        layout = target.layout
        bucketed = target.delta_schema is not None and BUCKET_COLUMN in target.delta_schema.names
        if bucketed:
            buckets = pa.nulls(len(lsns), pa.int64())
            if layout is not None:
                buckets = row_buckets(layout, dict(zip(names, arrays)), len(lsns))
            arrays.append(buckets)
            names.append(BUCKET_COLUMN)
        if old_keys is not None and any(flag is not None for flag in flags):
            old_by_name: dict[str, pa.Array] = {}
            for values, i in zip(old_keys, target.key_index):
                old_by_name[target.columns[i].column] = self._convert(target, values, target.columns[i])
                arrays.append(old_by_name[target.columns[i].column])
                names.append(OLD_KEY_PREFIX + target.columns[i].column)
            if bucketed:
                # The row under the old key (which holds the kept TOAST values) lives in the old key's bucket.
                old_buckets = pa.nulls(len(lsns), pa.int64())
                if layout is not None:
                    old_buckets = row_buckets(layout, old_by_name, len(lsns))
                arrays.append(old_buckets)
                names.append(OLD_KEY_PREFIX + BUCKET_COLUMN)
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


def _integer_keys(values: pa.Array) -> np.ndarray:
    """Integer key values from their text (absent images: 0, never used)."""
    return pc.cast(pc.cast(pc.cast(values, pa.binary()), pa.string()), pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)


def _halves(rows: PendingRows, start: int, new_applies: np.ndarray, old_applies: np.ndarray) -> PendingRows:
    """Rows ``start``.. (as many as the masks) with only the row images that apply: a change keeping
    only its old image is the delete of that key; one keeping neither is dropped."""
    stop = start + len(new_applies)
    ops = np.where(new_applies, rows.ops[start:stop], DELETE).astype(rows.ops.dtype)
    new = np.where(new_applies, rows.new[start:stop], -1)
    old = np.where(old_applies, rows.old[start:stop], -1)
    keep = new_applies | old_applies
    return PendingRows(rows.data, ops[keep], new[keep], old[keep], rows.lsns[start:stop][keep], rows.seqs[start:stop][keep])
