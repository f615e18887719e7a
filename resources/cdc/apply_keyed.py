"""The keyed fold: a batch folded to one row per key (last change wins; unchanged TOAST from an earlier change of the key or from Delta) and MERGEd in pieces of bounded rows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from resources.cdc.apply_batches import BatchAssembly
from resources.cdc.row_batches import PendingRows
from resources.cdc.tables import TableTarget
from resources.delta.batch_columns import OP_COLUMN
from resources.pgoutput.messages import UNCHANGED_TOAST
from resources.pgoutput.tags import DELETE, INSERT, UPDATE
from resources.pgoutput.tuples import row_values, tuple_columns_at


class KeyedFold(BatchAssembly):
    """Keyed tables' pending changes folded per key and merged."""

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
                self._writer.write_behind(
                    self._destination.merge_batch, target.path, piece, key_columns, target.prune_buckets
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
        images = np.stack([np.arange(n) + n, np.arange(n)], axis=1).ravel()  # as rows.image_columns numbers them
        ops = np.stack([np.full(n, DELETE, np.uint8), rows.ops], axis=1).ravel()
        lsns = np.repeat(rows.lsns, 2)
        present = positions >= 0
        positions, images, ops, lsns = positions[present], images[present], ops[present], lsns[present]
        columns, unchanged = rows.image_columns(len(target.columns), images)
        if any(mask.any() for mask in unchanged):
            return False
        keys = {f"k{i}": pc.cast(columns[i], pa.binary()) for i in target.key_index}
        keys["row"] = pa.array(np.arange(len(positions), dtype=np.int64))
        last = (
            pa.table(keys).group_by([f"k{i}" for i in target.key_index], use_threads=False).aggregate([("row", "max")])
        )
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
        inserted = updated = deleted = 0
        values: Sequence[object]  # a row image: a tuple as decoded, a list once unchanged TOAST is filled in
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
