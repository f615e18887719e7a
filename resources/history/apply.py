"""The change applier's hand-off to a table's changelog (docs/history.md): started with the table's log, seeded at its snapshot, written before each change batch of the table."""

from __future__ import annotations

import functools

import numpy as np
import pyarrow as pa

from resources.cdc.apply_batches import BatchAssembly
from resources.cdc.row_batches import PendingRows
from resources.cdc.tables import TableTarget
from resources.crash_points import fault_point
from resources.delta.markers import EXPIRED_SNAPSHOT_LSN
from resources.errors import PgcdcError
from resources.history import scd2
from resources.history.changelog import (
    changelog_rows,
    changes_marker,
    DeltaLookups,
    event_row,
    history_position,
    read_marker,
    resolve_lookups,
    seed_marker,
    seed_rows,
    with_schema,
)


class HistoryHandOff(BatchAssembly):
    """Changelog rows of the pending changes, written through the destination before the table's own commit."""

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
        read_marker_of = self._destination.versions_marker if target.history_scd2 else self._destination.newest_marker
        version, marker = read_marker_of(target.history_path)
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
        if target.history_scd2:
            target.history_seed_due = True  # once the relation names its key: before its first history write
            return
        self._writer.write(self._seed_history, target, target.history_seed)

    def _seed_history(self, target: TableTarget, snapshot_lsn: int) -> None:
        """(Writer thread.) The table's rows, as its snapshot wrote them, as the changelog's seed."""
        if target.history_scd2:
            scd2.write_seed(self._destination, target, snapshot_lsn, seed_marker(snapshot_lsn, str(target.table)))
            fault_point("after_history_commit")
            return
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
        self._seed_if_due(target)
        batch, lookups = changelog_rows(
            target, rows, keep, self._transactions, functools.partial(self._convert, target)
        )
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
        if target.history_path is None or (
            target.history_marker is not None and (end, position) <= target.history_marker
        ):
            return
        self._seed_if_due(target)
        row = event_row(op, values, end, seq, self._transactions[end])
        self._writer.write(self._append_history, target, row, None, self._history_marker(target, end, position))
        target.history_marker = (end, position)
        target.stats.history_rows += 1

    def _seed_if_due(self, target: TableTarget) -> None:
        if target.history_seed_due:
            target.history_seed_due = False
            self._writer.write(self._seed_history, target, target.history_seed)

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
            batch = resolve_lookups(
                batch, lookups, self._destination.read_rows(target.path, lookups.keys), target.table
            )
        if target.history_scd2:
            scd2.write_versions(self._destination, target, batch, marker)
            fault_point("after_history_commit")
            return
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
