"""Row occurrences for REPLICA IDENTITY FULL tables: a table as a multiset of rows.

A FULL table may hold identical rows, and PostgreSQL changes exactly one matching row per
change (its own subscriber does the same): an insert adds one copy, a delete removes one
copy equal to the old image, an update replaces one such copy by the new image. Adding and
removing copies commute, so a batch of changes folds into one *net* count per distinct row
value (:func:`fold_row_changes`), and the batch is applied by rewriting just the copies of
those values (:func:`apply_row_deltas`; the Delta side is ``resources/delta/merge.py: replace_rows``).

Rows are compared as pgoutput sends them: the text form of every column, NULL equal to NULL.
That is stricter than PostgreSQL's equality operators, and exactly right: the old image is
the text of the very row PostgreSQL changed, and two values with the same text form are the
same value (``SESSION_SETTINGS`` make the text exact, e.g. ``extra_float_digits=3``), while
equal-but-different values (``-0`` and ``0``, ``1.0`` and ``1.00`` as unconstrained numeric)
stay apart. On the Delta side the same identity holds for the typed values
(:func:`comparable_rows`): floats compare by their bits (NaN as one value), timestamps and
dates by their integer, arrays element by element, everything else by value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from resources.errors import PgcdcError
from resources.pgoutput.messages import UNCHANGED_TOAST
from resources.pgoutput.tags import DELETE, INSERT, UPDATE

__all__ = [
    "NET_COLUMN",
    "FoldedChanges",
    "RowDelta",
    "apply_row_deltas",
    "comparable_rows",
    "fold_row_changes",
]

NET_COLUMN = "_pgcdc_net"
"""Column of the folded batch: copies to add (positive) or remove (negative) per row value."""


@dataclass
class RowDelta:
    """What a batch does to one row value: ``net`` copies more (fewer when negative); new copies
    carry ``lsn``, the commit LSN of the newest change that added one."""

    net: int = 0
    lsn: int = 0


@dataclass
class FoldedChanges:
    """The net effect of the changes ``[start, stop)`` of a batch, per row value (text form)."""

    start: int
    stop: int
    deltas: dict[tuple, RowDelta] = field(default_factory=dict)

    def changed(self) -> dict[tuple, RowDelta]:
        """The values whose count changes (a copy added and removed again leaves Delta alone)."""
        return {row: delta for row, delta in self.deltas.items() if delta.net}


def fold_row_changes(
    ops: Sequence[int],
    old_images: Sequence[tuple],
    new_images: Sequence[tuple],
    lsns: Sequence[int],
    max_values: int,
) -> Iterator[FoldedChanges]:
    """Fold changes (op byte ``I``/``U``/``D``, old and new image as tuples of text bytes or None,
    commit LSN) in commit order into groups of consecutive changes touching at most
    ``max_values`` distinct row values each (a change touches at most two, so a group holds at
    least one change). Each group is written as one Delta commit; the bound keeps its predicate
    small. An update's unchanged-TOAST values come from its old image, which FULL sends whole.
    """
    group = FoldedChanges(0, 0)
    limit = max(2, max_values)
    for index, (op, old, new, lsn) in enumerate(zip(ops, old_images, new_images, lsns)):
        if op == UPDATE and UNCHANGED_TOAST in new:
            new = tuple(before if value is UNCHANGED_TOAST else value for before, value in zip(old, new))
        touched = [(old, -1)] if op == DELETE else [(new, 1)] if op == INSERT else [(old, -1), (new, 1)]
        if len(group.deltas) + len({row for row, _ in touched} - group.deltas.keys()) > limit:
            yield group
            group = FoldedChanges(index, index)
        for row, step in touched:
            if UNCHANGED_TOAST in row:
                raise PgcdcError(
                    "a REPLICA IDENTITY FULL row image lacks an unchanged TOAST value",
                    "the replication stream is inconsistent; restart replication",
                )
            delta = group.deltas.setdefault(row, RowDelta())
            delta.net += step
            if step > 0:
                delta.lsn = lsn
        group.stop = index + 1
    if group.stop > group.start:
        yield group


def apply_row_deltas(
    current: pa.Table,
    changes: pa.Table,
    value_columns: Sequence[str],
    lsn_column: str,
    on_missing: Callable[[int], None],
) -> pa.Table:
    """The rows that replace ``current`` (every Delta row that may equal a changed value; rows
    equal to none are kept as they are) after the folded ``changes`` (typed values,
    :data:`NET_COLUMN`, ``lsn_column``).

    A value losing copies loses its newest ones (highest ``lsn_column``): identical rows are
    indistinguishable in PostgreSQL, so which copy goes is not observable there. New copies get
    the change's LSN and NULL in columns ``changes`` lacks (columns dropped in PostgreSQL).
    Copies to remove that Delta does not have (Delta no longer matches PostgreSQL) are counted
    and passed to ``on_missing``; PostgreSQL's subscriber logs and skips those too.
    """
    nets = changes.column(NET_COLUMN).to_pylist()
    change_keys = comparable_rows(changes, value_columns)
    to_remove = {key: -net for key, net in zip(change_keys, nets) if net < 0}
    newest_first = np.argsort(-current.column(lsn_column).to_numpy(zero_copy_only=False), kind="stable")
    current_keys = comparable_rows(current, value_columns)
    keep = np.ones(current.num_rows, bool)
    for row in newest_first.tolist():
        pending = to_remove.get(current_keys[row], 0)
        if pending:
            keep[row] = False
            to_remove[current_keys[row]] = pending - 1
    missing = sum(to_remove.values())
    if missing:
        on_missing(missing)
    copies = np.repeat(np.arange(changes.num_rows), np.maximum(np.asarray(nets, np.int64), 0))
    added = changes.take(pa.array(copies, pa.int64()))
    columns = [
        added.column(f.name).cast(f.type) if f.name in added.column_names else pa.nulls(added.num_rows, f.type)
        for f in current.schema
    ]
    return pa.concat_tables([current.filter(pa.array(keep)), pa.Table.from_arrays(columns, schema=current.schema)])


def comparable_rows(table: pa.Table, columns: Sequence[str]) -> list[tuple]:
    """One hashable tuple per row of the named columns, equal exactly when the rows hold the same
    values: the identity of PostgreSQL's text form carried over to the typed Delta values."""
    lists = []
    for name in columns:
        array = _comparable(table.column(name).combine_chunks())
        values = array.to_pylist()
        # only arrays come out as (unhashable) lists; other columns need no per-value call
        lists.append([_hashable(value) for value in values] if _is_list(array.type) else values)
    return list(zip(*lists)) if lists else [()] * table.num_rows


_NAN_BITS = {32: np.float32("nan").view(np.int32), 64: np.float64("nan").view(np.int64)}


def _comparable(array: pa.Array) -> pa.Array:
    """Values that compare in Python as their text forms do in PostgreSQL: floats by their bits
    (``-0.0`` apart from ``0.0``, every NaN one value), timestamps and dates as integers (no
    Python datetime holds PostgreSQL's infinity), arrays element by element."""
    kind = array.type
    if _is_list(kind):
        return type(array).from_arrays(array.offsets, _comparable(array.values), mask=array.is_null())
    if pa.types.is_floating(kind):
        width = kind.bit_width
        values = array.fill_null(0).to_numpy(zero_copy_only=False)
        bits = values.view(np.int32 if width == 32 else np.int64).copy()
        bits[np.isnan(values)] = _NAN_BITS[width]
        return pa.array(bits, mask=array.is_null().to_numpy(zero_copy_only=False))
    if pa.types.is_timestamp(kind) or pa.types.is_date64(kind):
        return array.cast(pa.int64())
    if pa.types.is_date32(kind):
        return array.cast(pa.int32())
    return array


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)


def _hashable(value: object) -> object:
    return tuple(_hashable(item) for item in value) if isinstance(value, list) else value
