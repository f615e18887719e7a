"""The writes of tables without a usable key, each commit carrying its applied marker: keyless appends, and REPLICA IDENTITY FULL rewrites of the row values a batch changes (a multiset of rows, ``resources/cdc/row_multiset.py``)."""

from __future__ import annotations

import functools

import pyarrow as pa

from resources.cdc.apply_batches import BatchAssembly
from resources.cdc.row_batches import PendingRows
from resources.cdc.row_multiset import apply_row_deltas, fold_row_changes, NET_COLUMN, RowDelta
from resources.cdc.schema import RESNAPSHOT_FIX
from resources.cdc.tables import TableTarget
from resources.delta.layout import BUCKET_COLUMN
from resources.delta.markers import APPEND_MARKER, applied_marker, LSN_COLUMN, REPLACE_MARKER
from resources.errors import PgcdcError
from resources.pgoutput.tags import DELETE, INSERT, UPDATE
from resources.pgoutput.tuples import row_values, tuple_columns_at


class MarkedWrites(BatchAssembly):
    """Appends and REPLICA IDENTITY FULL rewrites, exactly once through their markers."""

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
        value_columns = [column.column for column in target.columns if not column.excluded]
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
            self._writer.write(
                self._destination.replace_rows,
                target.path,
                probe.select(value_columns),
                rewrite,
                applied_marker(REPLACE_MARKER, end, seq),
            )
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
        table = table.select([c.column for c in target.columns if not c.excluded] + bucket + [LSN_COLUMN])
        return table.append_column(NET_COLUMN, pa.array([delta.net for delta in changed.values()], pa.int64()))

    def _warn_missing_rows(self, target: TableTarget, missing: int) -> None:
        """Called on the writer thread when Delta lacks copies a change removes (Delta and PostgreSQL
        differed before it); PostgreSQL's subscriber logs such a change and goes on, and so does pgcdc."""
        self._log(
            f"warning: {target.table}: {missing} row(s) to delete or update were not in Delta (REPLICA IDENTITY "
            f"FULL: Delta differed from PostgreSQL before this change); {RESNAPSHOT_FIX} to realign it"
        )
