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

A fault of one table (:class:`~resources.errors.TableFault`: a value Delta cannot hold, a schema
change that needs a re-snapshot; or a write of it the engine refuses) goes to ``set_aside``, which
decides whether it is confined to that table and records the quarantine before returning (so no
confirm passes the table's unapplied changes unrecorded). Confined, the table's pending changes
are dropped and its later ones skipped, while every other table is applied and the slot moves on.

A Relation message under a table's name with another relation OID than the one its snapshot copied
(recorded in the snapshot marker) is another table, dropped and created again or renamed to the name:
the old table's pending changes are written, then the new one is refused as a fault of the table
(:meth:`ChangeApplier._adopt`), so the two never mix.

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

from collections.abc import Callable, Mapping
from datetime import datetime

import numpy as np

from resources.cdc.apply_relations import OtherRelationError, RelationHandling
from resources.cdc.row_batches import RowBatch
from resources.cdc.schema import RESNAPSHOT_FIX, SchemaReconciler
from resources.cdc.tables import APPEND, MARKED_MODES, TableTarget
from resources.cdc.transactions import CommittedTransaction
from resources.cdc.writer import OrderedWriter
from resources.delta.destination import Destination, TableLog
from resources.lsn import LSN
from resources.pgoutput.messages import Relation
from resources.pgoutput.tags import INSERT
from resources.postgres.catalog import TableName
from resources.postgres.column_types import ColumnTypes

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


class ChangeApplier(RelationHandling):
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
        set_aside: Callable[[TableName, int, Exception], bool] | None = None,
        write_concurrency: int = 1,
        claim: tuple[Callable[[str], None], Callable[[str], None]] | None = None,
    ) -> None:
        """``heartbeat`` is called about every :data:`~resources.cdc.writer.HEARTBEAT_SECONDS` while this thread waits
        for Delta (e.g. ``ReplicationStream.keepalive``, so the walsender does not time out).

        ``recopy_range(table, path, log, k)`` copies range k of a table snapshotted in key ranges
        (``log``: its log as this drain knows it, ranges and layout) again, at a new consistent point,
        in one commit carrying its marker (see :meth:`_key_range_pieces`
        for when); without it such a table's drain stops there with an error.

        ``set_aside(table, lsn, error)`` hears a fault of one table (``lsn``: the commit end LSN of its
        first change not applied); it returns whether the fault is confined to that table, having
        recorded the quarantine durably. Without it every fault fails the run.

        ``claim`` = (take, give back), by Delta path: the table's lock against other runs that write it
        (``resources/postgres/table_locks.py``), taken when the run first meets a change of the table (it may
        wait while a snapshot or maintenance of it runs), given back at once when the table has no snapshot
        (this run writes nothing to it). The run holds the rest until it ends.

        ``write_concurrency``: how many tables' writes run at once (:class:`~resources.cdc.writer.OrderedWriter`:
        each table's in order, the durable position behind all of them)."""
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
        self._writes_prepared = False
        #: Commit end LSN -> (xid, commit time) of the transactions the pending changes belong to (changelogs).
        self._transactions: dict[int, tuple[int, datetime]] = {}
        self._writer = OrderedWriter(heartbeat, write_concurrency)
        self._set_aside_table = set_aside
        self._claim = claim
        self._writer.on_failure = self._write_failed
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
                            relation = self._relations[oid]
                            if target.relation is relation or self._adopt(target, relation, end, seq):
                                self._confined(target, end, self._truncate, target, relation, end, seq)
                    seq += 1
        finally:
            txn.discard()
        self._complete_end = end
        self.transactions += 1

    def _add_rows(self, batch: RowBatch, end: int, seq: int, change_bytes: int) -> None:
        """Route a run of row changes to their tables' pending batches, a table at a time."""
        oids = batch.oids
        relations = batch.relation_oids()
        for oid in relations:
            index = np.arange(len(oids)) if len(relations) == 1 else np.flatnonzero(oids == oid)
            target = self._target_by_oid.get(oid)
            if target is None or self._skips(target, end):
                self.changes_skipped += len(index)
                if target is not None and target.quarantined:
                    target.stats.quarantine_skipped += len(index)
                continue
            relation = self._relations[oid]
            if target.relation is not relation:
                if not self._adopt(target, relation, end, seq):
                    self.changes_skipped += len(index)
                    target.stats.quarantine_skipped += len(index)
                    continue
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
                    if target.quarantined:  # its flush set it aside: the rest of its changes are skipped
                        self.changes_skipped += len(index)
                        target.stats.quarantine_skipped += len(index)
                        break

    def _skips(self, target: TableTarget, end: int) -> bool:
        """:meth:`TableTarget.skips`, reading the table's own log the first time the run meets it.

        Only tables with changes are read, and only once a run: this run's writes to the table
        all come after, and it tracks the applied marker itself from then on. The read is of a
        table no queued write touches yet, so it need not wait for the writer thread. A table whose
        log the run read before its changes (one the state did not list) takes its applied marker
        and starts its history here all the same. A quarantined table skips everything.
        """
        if target.quarantined:
            return True
        if not target.met:
            target.met = True
            if not self._writes_prepared:  # the run's first changes: its engine gets ready beside their decoding
                self._writer.write(self._destination.prepare_writes)
                self._writes_prepared = True
            if self._claim is not None:
                self._claim[0](target.path)
            if target.log is None or (self._claim is not None and not target.log.being_snapshotted):
                # Read under the claim: a first snapshot that held the table is committed by now.
                target.log = self._destination.read_table_log(target.path, target.known)
                target.stats.version_read = target.log.version
            if self._claim is not None and not target.log.being_snapshotted:
                # Not written by this run, and a snapshot of it starting from now on begins past this run's end.
                self._claim[1](target.path)
            target.applied_marker = target.log.applied_marker
            if target.history_path is not None:
                self._start_history(target)
        return target.skips(end)

    def flush(self) -> None:
        """Send every pending batch to Delta; once written, every completely added transaction is durable."""
        for target in self._targets.values():
            if target.pending:
                self._confined(target, target.pending[-1][2], self._flush_target, target)
        self._writer.durable_after_queued(self._complete_end)

    # -- one table's fault

    def _adopt(self, target: TableTarget, relation: Relation, end: int, seq: int) -> bool:
        """Adopt ``relation`` for ``target`` (:meth:`_use_relation`), confined to the table; False when the
        table was set aside instead.

        pgoutput names a table by its OID in every change and by its name in the Relation message; pgcdc
        maps names to Delta tables, as PostgreSQL's subscriber maps them to its tables. A relation of
        another OID than the one the table's snapshot copied (or than this run met under the name) is
        another table: the old one's pending changes are written first, then the table is refused
        (quarantined, with the re-snapshot fix), so neither table's rows land in the other's."""
        expected = target.relation.oid if target.relation is not None else None
        if expected is None and target.log is not None and target.log.columns is not None:
            expected = target.log.columns.relid
        if expected is None or relation.oid == expected:
            return self._confined(target, end, self._use_relation, target, relation, end, seq)
        if target.pending and not self._confined(target, end, self._flush_target, target):
            return False
        error = OtherRelationError(
            f"{target.table} is another table than the one its Delta table holds (relation OID {relation.oid}, "
            f"its rows are of OID {expected}): it was dropped and created again, or another table was renamed "
            "to its name; its changes are not mixed into the old table's rows",
            RESNAPSHOT_FIX,
        )
        return self._confined(target, end, _raise, error)

    def _confined(self, target: TableTarget, end: int, action: Callable[..., None], *args: object) -> bool:
        """Run ``action(*args)`` for ``target`` (its writes tagged with it); returns False when a fault of the
        table set it aside instead (``end``: the commit end LSN being applied when it surfaced)."""
        if target.quarantined:
            return False
        first = target.pending[0][2] if target.pending else end
        owner, self._writer.owner = self._writer.owner, target
        since, self._writer.since = self._writer.since, first
        try:
            action(*args)
        except Exception as error:
            if not self._set_aside(target, first, error):
                raise
            return False
        finally:
            self._writer.owner, self._writer.since = owner, since
        return True

    def _write_failed(self, owner: object, error: Exception) -> bool:
        """(Writer's ``on_failure``.) A failed write of a table: set the table aside if the fault is its own."""
        assert isinstance(owner, TableTarget)
        since = self._writer.failed_since  # its first change the failed write left unapplied
        return self._set_aside(owner, since if since is not None else self._complete_end, error)

    def _set_aside(self, target: TableTarget, lsn: int, error: Exception) -> bool:
        """Quarantine ``target`` when ``set_aside`` confines ``error`` to it: its pending changes are dropped,
        its later ones skipped. A table already set aside swallows the failures of its writes still in flight."""
        if target.quarantined:
            return True
        if self._set_aside_table is None or not self._set_aside_table(target.table, lsn, error):
            return False
        target.quarantined = True
        dropped = sum(len(taken) for _, taken, _, _ in target.pending)
        self.pending_changes -= dropped
        self.pending_bytes -= target.pending_bytes
        self.changes_skipped += dropped
        target.stats.quarantine_skipped += dropped
        target.pending, target.pending_bytes = [], 0
        return True

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


def _raise(error: Exception) -> None:
    raise error
