"""Pending row images to one Arrow batch in the table's Delta schema: columns parsed column-wise, converted by ``pgtypes.to_arrow``, the LSN and bucket columns added."""

from __future__ import annotations

import pyarrow as pa

from resources.cdc.apply_state import ApplierState
from resources.cdc.schema import ChangeValueError
from resources.cdc.tables import TableTarget
from resources.config.columns import as_text_fix
from resources.delta.batch_columns import OLD_KEY_PREFIX, unchanged_flag_column
from resources.delta.layout import BUCKET_COLUMN, row_buckets
from resources.delta.markers import LSN_COLUMN
from resources.pgtypes import PgColumnType, PgValueError, to_arrow


class BatchAssembly(ApplierState):
    """Arrow batches of a table's pending row images."""

    def _arrow_batch(
        self,
        target: TableTarget,
        columns: list[pa.Array],
        flags: list[pa.Array | None],
        lsns: pa.Array,
        old_keys: list[pa.Array] | None,
        index: pa.Array | None = None,
    ) -> pa.Table:
        """Text columns -> typed columns (then the rows at ``index``, ascending and distinct, if given),
        plus the bucket (of the row's key, and of the old key of a moved row), unchanged-TOAST flags,
        ``_pgcdc_lsn`` and dropped columns."""
        kept = [(values, column) for values, column in zip(columns, target.columns) if not column.excluded]
        arrays = [self._convert(target, values, column) for values, column in kept]
        if index is not None and arrays and len(index) < len(arrays[0]):  # as many as the rows: all of them
            arrays = [array.take(index) for array in arrays]
        names = [column.column for _, column in kept]
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
            if flag is not None and not column.excluded:
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
            converted = to_arrow(values, column)
        except PgValueError as exc:
            fix = "fix the value in PostgreSQL" if exc.column is None else as_text_fix(target.table, exc.column)
            raise ChangeValueError(
                f"cannot apply a change to {target.table}: {exc}", fix, column=exc.column or column.column
            ) from exc
        wider = target.delta_wider.get(column.column)
        return converted if wider is None else converted.cast(wider)
