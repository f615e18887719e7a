"""The drain rule of a table snapshotted in primary-key ranges: each row image is applied or skipped by its range's own consistent point, a range not yet copied is copied again (docs/contracts.md, "Chunked snapshots in primary-key ranges")."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from resources.cdc.apply_state import ApplierState
from resources.cdc.row_batches import PendingRows
from resources.cdc.schema import RESNAPSHOT_FIX, SchemaChangeError
from resources.cdc.tables import KEYED, TableTarget
from resources.errors import ConfigurationError, PgcdcError, TableFault
from resources.lsn import LSN
from resources.pgoutput.tags import DELETE
from resources.pgoutput.tuples import tuple_columns_at


class KeyRangeRule(ApplierState):
    """Which pending row images of a key-range table apply, and the re-copy of a range."""

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
            self._recopy(
                target, k, int(rows.lsns[stop]), "a row moved into it kept unchanged-TOAST values of a row not in Delta"
            )
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
        try:
            self._writer.commit(self._recopy_range, target.table, target.path, target.log, k)
        except ConfigurationError as error:  # a grant missing on this table (the drain itself needs none): its fault
            raise TableFault(
                f"key range {k + 1} of {target.table} must be copied again ({why}) and cannot be: {error.cause}",
                f"{error.fix.removesuffix(', then run again')}, then {RESNAPSHOT_FIX}",
            ) from error
        target.log = self._writer.call(self._destination.read_table_log, target.path, target.log)
        chunks = target.log.chunks if target.log is not None else None
        point = chunks.points[k] if chunks is not None else None
        if point is None or point < lsn:
            raise PgcdcError(
                f"{target.table}: key range {k} was copied again but its log does not show it done after {LSN(lsn)}",
                "another writer changed the table's Delta directory; re-snapshot the table",
            )


def _integer_keys(values: pa.Array) -> np.ndarray:
    """Integer key values from their text (absent images: 0, never used)."""
    return (
        pc.cast(pc.cast(pc.cast(values, pa.binary()), pa.string()), pa.int64())
        .fill_null(0)
        .to_numpy(zero_copy_only=False)
    )


def _halves(rows: PendingRows, start: int, new_applies: np.ndarray, old_applies: np.ndarray) -> PendingRows:
    """Rows ``start``.. (as many as the masks) with only the row images that apply: a change keeping
    only its old image is the delete of that key; one keeping neither is dropped."""
    stop = start + len(new_applies)
    ops = np.where(new_applies, rows.ops[start:stop], DELETE).astype(rows.ops.dtype)
    new = np.where(new_applies, rows.new[start:stop], -1)
    old = np.where(old_applies, rows.old[start:stop], -1)
    keep = new_applies | old_applies
    return PendingRows(
        rows.data, ops[keep], new[keep], old[keep], rows.lsns[start:stop][keep], rows.seqs[start:stop][keep]
    )
