"""A table's SCD type 2 history: one row per version of each key, kept from the changes its MERGE applies (docs/history.md).

A version is the row's values plus when it held: ``_pgcdc_valid_from_lsn`` (the commit end LSN of
the change that opened it; the snapshot LSN for a snapshot's rows), ``_pgcdc_seq`` (where that change
stands in its transaction: ``2 * position + 1``, or ``2 * position`` for the fill of columns added
with a default right before the change at ``position``, as the changelog's markers count; -1 at a
snapshot), ``_pgcdc_valid_to_lsn`` (the change that closed it; NULL while
current), their commit times ``_pgcdc_valid_from`` / ``_pgcdc_valid_to`` (NULL at a snapshot),
``_pgcdc_is_current`` and ``_pgcdc_is_deleted`` (the version ended because its key stopped existing:
a DELETE, a key moved away, a TRUNCATE, a row gone at a re-snapshot). The table as of an LSN X is
its versions with ``valid_from_lsn <= X < valid_to_lsn`` (or no ``valid_to_lsn``).

The batch of changes is the changelog's (``resources/history/changelog.py``: commit order, unchanged TOAST
values resolved), so a key changed several times in a batch gets every version: the versions opened
and closed within the batch are written closed. It is one MERGE (``resources/history/scd2_merge.py``):
the current version of each key the batch closes is closed (deleted and inserted again closed), the
new versions are inserted and the marker row takes the changelog's marker (``changes_marker``), in
one commit that reads and rewrites only the closed keys' buckets (the history table is partitioned
by its table's key, finer: ``resources/history/scd2_merge.py``) and, with deletion vectors, marks the deleted rows instead of rewriting their files. A replay skips exactly what the
marker row says the table holds. A TRUNCATE, a fill and a snapshot's seed rewrite the current
versions whole, with the marker row.

Versions are per key: a table without one (REPLICA IDENTITY FULL without a primary key, or no
identity) has no versions to tell apart and is refused (:func:`history_key`); its changelog keeps
its past.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from datetime import datetime

import pyarrow as pa
import pyarrow.compute as pc

from resources.cdc.row_multiset import comparable_rows
from resources.cdc.tables import KEYED, TableTarget
from resources.delta.batch_columns import CLOSE_COLUMN, CURRENT_COLUMN, MARKER_COLUMN, VALID_TO_LSN_COLUMN
from resources.delta.destination import Destination
from resources.delta.layout import BUCKET_COLUMN, row_buckets
from resources.delta.markers import LSN_COLUMN
from resources.errors import PgcdcError
from resources.history.changelog import (
    COMMIT_TIME_COLUMN,
    COMMIT_TIME_TYPE,
    history_position,
    KEY_COLUMN,
    OLD_PREFIX,
    OP_COLUMN,
    SEQ_COLUMN,
    with_schema,
)

__all__ = [
    "CURRENT_COLUMN",
    "DELETED_COLUMN",
    "history_key",
    "MARKER_COLUMN",
    "VALID_FROM_COLUMN",
    "VALID_FROM_LSN_COLUMN",
    "VALID_TO_COLUMN",
    "VALID_TO_LSN_COLUMN",
    "write_seed",
    "write_versions",
]

VALID_FROM_LSN_COLUMN = "_pgcdc_valid_from_lsn"
VALID_FROM_COLUMN = "_pgcdc_valid_from"
VALID_TO_COLUMN = "_pgcdc_valid_to"
DELETED_COLUMN = "_pgcdc_is_deleted"

_META_PREFIX = "_pgcdc_"


def history_key(target: TableTarget, names: Sequence[str]) -> tuple[str, ...]:
    """The columns ``target``'s versions are per (its key, of the relation's columns ``names``), or the one-line refusal."""
    if target.mode != KEYED:
        raise PgcdcError(
            f"{target.table} has no key to keep SCD type 2 versions of (REPLICA IDENTITY FULL without a primary key, "
            "or no replica identity)",
            f"give it a primary key, or set history.tables.{target.table}: changelog",
        )
    return tuple(names[i] for i in target.key_index)


def write_seed(destination: Destination, target: TableTarget, snapshot_lsn: int, marker: str) -> None:
    """(Writer thread.) Start the history at the table's snapshot: every row a current version opened at
    ``snapshot_lsn``; over an existing history (a re-snapshot), close the current versions whose row
    vanished or changed and open the rows that appeared or changed, at ``snapshot_lsn``."""
    assert target.history_path is not None
    rows = destination.read_rows(target.path, None)
    rows = rows.drop_columns([name for name in (LSN_COLUMN, BUCKET_COLUMN) if name in rows.column_names])
    seed = _without_bucket(_evolve(destination, target, _versions(rows, snapshot_lsn, -1, None)))
    key = target.history_key

    def rewrite(current: pa.Table | None) -> pa.Table:
        if current is None:
            return pa.concat_tables([seed, _marker_row(seed.schema, marker)])
        versions = _without_marker(current)
        return pa.concat_tables([_reseed(versions, seed, key, snapshot_lsn), _marker_row(current.schema, marker)])

    destination.replace_versions(target.history_path, rewrite, target.history_deletion_vectors, target.layout)
    target.history_schema = None  # read again: the write added the bucket column


def write_versions(destination: Destination, target: TableTarget, changes: pa.Table, marker: str) -> None:
    """(Writer thread.) Write a batch of changelog rows (``resources/history/changelog.py``) as versions: row
    changes (close the current version of each changed key, open the new ones, one MERGE), or one
    whole-table event (``truncate`` closes every current version; ``fill`` closes each and opens it
    again with the values PostgreSQL gave the columns added with a default)."""
    assert target.history_path is not None
    ops = changes.column(OP_COLUMN)
    first = ops[0].as_py()
    if first in ("truncate", "fill"):
        lsn, seq = int(changes.column(LSN_COLUMN)[0].as_py()), int(changes.column(SEQ_COLUMN)[0].as_py())
        time = changes.column(COMMIT_TIME_COLUMN)[0].as_py()
        event: Callable[[pa.Table], pa.Table]
        if first == "truncate":
            event = functools.partial(_closed_all, lsn=lsn, time=time, gone=True)
        else:
            filled = json.loads(changes.column(KEY_COLUMN)[0].as_py())
            values = _without_bucket(_evolve(destination, target, changes.select(filled)))
            position = int(history_position(seq, before=True))
            event = functools.partial(_refilled, values=values, filled_names=filled, lsn=lsn, seq=position, time=time)

        def rewrite(current: pa.Table | None) -> pa.Table:
            assert current is not None, "a history is seeded before its first change"
            return pa.concat_tables([event(_without_marker(current)), _marker_row(current.schema, marker)])

        destination.replace_versions(target.history_path, rewrite, target.history_deletion_vectors, target.layout)
        target.history_schema = None  # read again: the write keeps the bucket column
        return
    key = target.history_key
    names = [name for name in changes.column_names if not name.startswith(_META_PREFIX)]
    opens = changes.filter(pc.is_in(ops, pa.array(["insert", "update"])))
    positions = pa.chunked_array([history_position(opens.column(SEQ_COLUMN).to_numpy())], pa.int64())
    opened = _versions(opens.select(names), opens.column(LSN_COLUMN), positions, opens.column(COMMIT_TIME_COLUMN))
    opened = _evolve(destination, target, opened)
    opened, closes = _closes(changes, opened, key)
    if BUCKET_COLUMN in opened.column_names:  # bucketed as the table is, by the table's own layout
        opened = opened.set_column(opened.column_names.index(BUCKET_COLUMN), BUCKET_COLUMN, _buckets(target, opened))
        closes = closes.append_column(BUCKET_COLUMN, _buckets(target, closes))
    closes = _aligned(closes, opened.schema)
    flag = CLOSE_COLUMN
    source = pa.concat_tables([
        closes.append_column(flag, pa.repeat(pa.scalar(True), closes.num_rows)),
        opened.append_column(flag, pa.repeat(pa.scalar(False), opened.num_rows)),
        _marker_row(opened.schema, marker).append_column(flag, pa.array([True])),
    ])  # fmt: skip
    destination.merge_versions(
        target.history_path, source, key, target.prune_buckets and BUCKET_COLUMN in opened.column_names
    )


def _marker_row(schema: pa.Schema, marker: str) -> pa.Table:
    """The marker row (``resources/history/scd2_merge.py``): NULL everywhere but its marker."""
    return pa.Table.from_arrays(
        [
            pa.array([marker], field.type) if field.name == MARKER_COLUMN else pa.nulls(1, field.type)
            for field in schema
        ],
        schema=schema,
    )


def _without_bucket(rows: pa.Table) -> pa.Table:
    """Rows for :meth:`Destination.replace_versions`, which buckets them by the table's layout itself."""
    return rows.drop_columns([BUCKET_COLUMN]) if BUCKET_COLUMN in rows.column_names else rows


def _without_marker(rows: pa.Table) -> pa.Table:
    return rows.filter(pc.is_null(rows.column(MARKER_COLUMN)))


def _closes(changes: pa.Table, opened: pa.Table, key: Sequence[str]) -> tuple[pa.Table, pa.Table]:
    """The batch's new versions with those closed that a later change of the batch closes, and a close
    row (key, closing LSN and time, deleted or not) per key whose version from before the batch a change
    closes: the first change of each key in the batch. A delete, or a key moved away, closes its version
    deleted (the key stopped existing)."""
    ops = changes.column(OP_COLUMN).to_pylist()
    lsns = changes.column(LSN_COLUMN).to_pylist()
    times = changes.column(COMMIT_TIME_COLUMN).to_pylist()
    new_keys = _key_rows(changes, key)
    old_keys = _key_rows(changes, [OLD_PREFIX + name for name in key])
    opened_now: dict[tuple, int] = {}
    met: set[tuple] = set()
    closes_opened: dict[int, tuple[int, datetime | None, bool]] = {}
    close_rows: list[tuple[tuple, int, datetime | None, bool]] = []

    def close(version_key: tuple, i: int, gone: bool) -> None:
        at = opened_now.pop(version_key, None)
        if at is not None:
            closes_opened[at] = (lsns[i], times[i], gone)
        elif version_key not in met:
            close_rows.append((version_key, lsns[i], times[i], gone))
        met.add(version_key)

    opened_at = 0
    for i, op in enumerate(ops):
        if op != "insert" and old_keys[i] != new_keys[i] or op == "delete":
            close(old_keys[i], i, True)
        if op == "delete":
            continue
        close(new_keys[i], i, False)
        opened_now[new_keys[i]] = opened_at
        opened_at += 1
    columns = {
        name: pa.array([row[0][j] for row in close_rows], changes.schema.field(name).type) for j, name in enumerate(key)
    }
    columns[VALID_TO_LSN_COLUMN] = pa.array([row[1] for row in close_rows], pa.int64())
    columns[VALID_TO_COLUMN] = pa.array([row[2] for row in close_rows], COMMIT_TIME_TYPE)
    columns[CURRENT_COLUMN] = pa.array([False] * len(close_rows), pa.bool_())
    columns[DELETED_COLUMN] = pa.array([row[3] for row in close_rows], pa.bool_())
    return _with_closes(opened, closes_opened), pa.table(columns)


def _versions(
    values: pa.Table, lsn: int | pa.ChunkedArray, seq: int | pa.ChunkedArray, time: pa.ChunkedArray | None
) -> pa.Table:
    """``values`` as current versions opened at ``lsn`` / ``seq`` (one each, or one per row), at ``time``."""
    n = values.num_rows
    return values.append_column(VALID_FROM_LSN_COLUMN, pa.array([lsn] * n, pa.int64()) if isinstance(lsn, int) else lsn) \
        .append_column(SEQ_COLUMN, pa.array([seq] * n, pa.int64()) if isinstance(seq, int) else seq) \
        .append_column(VALID_TO_LSN_COLUMN, pa.nulls(n, pa.int64())) \
        .append_column(VALID_FROM_COLUMN, pa.nulls(n, COMMIT_TIME_TYPE) if time is None else time) \
        .append_column(VALID_TO_COLUMN, pa.nulls(n, COMMIT_TIME_TYPE)) \
        .append_column(CURRENT_COLUMN, pa.array([True] * n, pa.bool_())) \
        .append_column(DELETED_COLUMN, pa.array([False] * n, pa.bool_())) \
        .append_column(MARKER_COLUMN, pa.nulls(n, pa.string()))  # fmt: skip


def _buckets(target: TableTarget, values: pa.Table) -> pa.Array:
    """Each row's bucket, as the table's own layout puts its key (the MERGE puts it in the SCD type 2
    table's finer one: ``resources/history/scd2_merge.py``; NULL where it cannot be computed; the
    history table is bucketed only when the layout is known, so only NULL's own rows lack it)."""
    layout = target.layout
    if layout is None or any(name not in values.column_names for name in layout.key):
        return pa.nulls(values.num_rows, pa.int64())
    return row_buckets(layout, {name: values.column(name).combine_chunks() for name in layout.key}, values.num_rows)


def _evolve(destination: Destination, target: TableTarget, rows: pa.Table) -> pa.Table:
    """Bring the history table's columns along (columns added to the table, safe widenings), as the
    changelog does; returns ``rows`` in the history table's columns (a dropped column NULL)."""
    assert target.history_path is not None
    schema = target.history_schema
    if schema is None:
        schema = destination.table_schema(target.history_path)
    if not len(schema):
        target.history_schema = rows.schema
        return rows
    rows, added, widened = with_schema(rows, schema)
    if widened:
        destination.widen_columns(target.history_path, widened)
    if len(added):
        destination.add_columns(target.history_path, added)
    target.history_schema = rows.schema
    return rows


def _aligned(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """``rows`` in ``schema``'s columns and types (the versions as the engine read them)."""
    return pa.Table.from_arrays(
        [rows.column(field.name).cast(field.type) if field.name in rows.column_names else pa.nulls(rows.num_rows, field.type)
         for field in schema],
        schema=schema,
    )  # fmt: skip


def _with_closes(versions: pa.Table, closes: dict[int, tuple[int, datetime | None, bool]]) -> pa.Table:
    """``versions`` with those at the given rows closed at (LSN, commit time), deleted or not."""
    if not closes:
        return versions
    to_lsn = versions.column(VALID_TO_LSN_COLUMN).to_pylist()
    to_time = versions.column(VALID_TO_COLUMN).to_pylist()
    current = versions.column(CURRENT_COLUMN).to_pylist()
    deleted = versions.column(DELETED_COLUMN).to_pylist()
    for i, (lsn, time, gone) in closes.items():
        to_lsn[i], to_time[i], current[i], deleted[i] = lsn, time, False, gone
    for name, values in (
        (VALID_TO_LSN_COLUMN, to_lsn),
        (VALID_TO_COLUMN, to_time),
        (CURRENT_COLUMN, current),
        (DELETED_COLUMN, deleted),
    ):
        at = versions.column_names.index(name)
        versions = versions.set_column(at, name, pa.array(values, versions.schema.field(name).type))
    return versions


def _key_rows(table: pa.Table, names: Sequence[str]) -> list[tuple]:
    return list(zip(*(table.column(name).to_pylist() for name in names))) if table.num_rows else []


def _closed_all(current: pa.Table, lsn: int, time: datetime | None, gone: bool) -> pa.Table:
    """Every current version closed at ``lsn`` (a TRUNCATE: deleted)."""
    n = current.num_rows
    for name, values in (
        (VALID_TO_LSN_COLUMN, pa.array([lsn] * n, pa.int64())),
        (VALID_TO_COLUMN, pa.array([time] * n, COMMIT_TIME_TYPE)),
        (CURRENT_COLUMN, pa.array([False] * n, pa.bool_())),
        (DELETED_COLUMN, pa.array([gone] * n, pa.bool_())),
    ):
        at = current.column_names.index(name)
        current = current.set_column(at, name, values.cast(current.schema.field(name).type))
    return current


def _refilled(
    current: pa.Table, values: pa.Table, filled_names: Sequence[str], lsn: int, seq: int, time: datetime | None
) -> pa.Table:
    """Every current version closed at ``lsn``, and opened again with ``values`` (one row) in the columns ``filled_names``."""
    reopened = current
    n = current.num_rows
    for name in filled_names:
        at = reopened.column_names.index(name)
        reopened = reopened.set_column(
            at, name, pa.repeat(values.column(name)[0], n).cast(reopened.schema.field(name).type)
        )
    opened = _versions(reopened.drop_columns([name for name in reopened.column_names if name in _VERSION_COLUMNS]), lsn, seq,
                       pa.chunked_array([pa.array([time] * n, COMMIT_TIME_TYPE)]))  # fmt: skip
    return pa.concat_tables([_closed_all(current, lsn, time, False), _aligned(opened, current.schema)])


_VERSION_COLUMNS = frozenset({
    VALID_FROM_LSN_COLUMN, SEQ_COLUMN, VALID_TO_LSN_COLUMN, VALID_FROM_COLUMN, VALID_TO_COLUMN, CURRENT_COLUMN, DELETED_COLUMN,
    MARKER_COLUMN,
})  # fmt: skip


def _reseed(current: pa.Table, seed: pa.Table, key: Sequence[str], snapshot_lsn: int) -> pa.Table:
    """A re-snapshot over an existing history: the current versions whose key vanished (deleted) or whose
    values differ from the snapshot's row closed at ``snapshot_lsn``, and the snapshot's rows that are
    new or changed opened there."""
    names = [name for name in seed.column_names if not name.startswith(_META_PREFIX)]
    # Compared as integers where Python's datetimes end short of PostgreSQL's infinity (comparable_rows).
    seed_rows = comparable_rows(seed, names)
    at_key = [names.index(name) for name in key]
    seed_at = {tuple(row[p] for p in at_key): j for j, row in enumerate(seed_rows)}
    closes: dict[int, tuple[int, datetime | None, bool]] = {}
    unchanged: set[int] = set()
    present = [name for name in names if name in current.column_names]
    at_present = [names.index(name) for name in present]
    for i, row in enumerate(comparable_rows(current, present)):
        j = seed_at.get(tuple(row[present.index(name)] for name in key))
        # a column the history lacks is NULL in it
        if (
            j is not None
            and all(seed_rows[j][p] is None for p in range(len(names)) if p not in at_present)
            and all(value == seed_rows[j][p] for value, p in zip(row, at_present))
        ):
            unchanged.add(j)
        else:
            closes[i] = (snapshot_lsn, None, j is None)
    opened = seed.take(pa.array([j for j in range(seed.num_rows) if j not in unchanged], pa.int64()))
    return pa.concat_tables([_with_closes(current, closes), _aligned(opened, current.schema)])
