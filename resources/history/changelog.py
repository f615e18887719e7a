"""A table's changelog rows, built from the same pending changes its MERGE applies (docs/history.md).

One changelog row per row change, in commit order: its operation, commit end LSN, position in the
transaction, commit time and transaction id, the new image, and the old row's identifying columns
(``_pgcdc_old_<col>``, with ``_pgcdc_key`` naming the columns the old row is matched on: the key, or
every column under REPLICA IDENTITY FULL). A TRUNCATE is one row, and so is the back-fill of columns
added with a default (``fill``); a snapshot seeds the changelog with a ``reset`` row and one
``snapshot`` row per row of the table.

An unchanged TOAST value is never written as a placeholder: it is the value of an earlier image of
the same key in the batch, else (REPLICA IDENTITY FULL) of the old image PostgreSQL sent whole, else
the value the Delta table holds under the old key before the batch's MERGE, read for exactly those
keys (:class:`DeltaLookups`) on the writer thread, in order, right before the changelog append.

Every changelog commit carries a marker: the seed a snapshot marker, every commit of changes the
keyless appends' marker plus the seed's LSN (:func:`changes_marker`), so a drain learns where the
changelog stands from its newest commit alone, however long its history.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from resources.cdc.row_batches import PendingRows
from resources.cdc.schema import RESNAPSHOT_FIX
from resources.cdc.tables import FULL, TableTarget
from resources.delta.delta_types import is_safe_widening
from resources.delta.layout import BUCKET_COLUMN
from resources.delta.markers import LSN_COLUMN
from resources.errors import PgcdcError
from resources.lsn import LSN
from resources.pgoutput.messages import UNCHANGED_TOAST
from resources.pgoutput.tags import DELETE, INSERT, UPDATE
from resources.pgoutput.tuples import row_values, tuple_columns_at
from resources.pgtypes import PgColumnType

__all__ = [
    "changelog_rows",
    "changes_marker",
    "history_position",
    "COMMIT_TIME_TYPE",
    "COMMIT_TIME_COLUMN",
    "DeltaLookups",
    "event_row",
    "KEY_COLUMN",
    "OLD_PREFIX",
    "OP_COLUMN",
    "read_marker",
    "resolve_lookups",
    "seed_marker",
    "seed_rows",
    "SEQ_COLUMN",
    "with_schema",
    "XID_COLUMN",
]

OP_COLUMN = "_pgcdc_op"
"""insert, update, delete, truncate, fill; a snapshot's seed: reset, then snapshot per row."""
SEQ_COLUMN = "_pgcdc_seq"
"""The change's position in its transaction (the seed: -2 for reset, -1 for its rows)."""
COMMIT_TIME_COLUMN = "_pgcdc_commit_time"
XID_COLUMN = "_pgcdc_xid"
KEY_COLUMN = "_pgcdc_key"
"""JSON list of the columns an update or delete finds its old row by (``_pgcdc_old_<col>`` holds their values)."""
OLD_PREFIX = "_pgcdc_old_"

COMMIT_TIME_TYPE = pa.timestamp("us", tz="UTC")


@dataclass(frozen=True)
class DeltaLookups:
    """Unchanged TOAST values the batch does not hold: read from the Delta table under the old keys."""

    #: One row per old key (typed key columns, named as in Delta).
    keys: pa.Table
    #: Changelog column -> (rows of the changelog batch, index of their key in ``keys``).
    cells: dict[str, tuple[np.ndarray, np.ndarray]]


class _FromDelta:
    """An unchanged TOAST value to read from Delta under ``key`` (a key as text values)."""

    __slots__ = ("key",)

    def __init__(self, key: tuple) -> None:
        self.key = key


def changelog_rows(
    target: TableTarget,
    rows: PendingRows,
    keep: np.ndarray,
    transactions: Mapping[int, tuple[int, datetime]],
    convert: Callable[[pa.Array, PgColumnType], pa.Array],
) -> tuple[pa.Table, DeltaLookups | None]:
    """The changelog rows of the changes ``keep`` selects; every change of ``rows`` (kept or not) is an
    earlier image for the ones after it. ``transactions``: commit end LSN -> (xid, commit time)."""
    ncols = len(target.columns)
    names = [column.column for column in target.columns]
    changes = np.arange(len(rows))
    new_columns, unchanged = rows.image_columns(ncols, changes)
    old_columns, _ = rows.image_columns(ncols, changes + len(rows))
    full = target.relation is not None and target.relation.replica_identity == "f"
    matched_on = names if target.mode == FULL else [names[i] for i in target.key_index]
    kept = np.flatnonzero(keep)
    is_update = rows.ops == UPDATE
    lookups = None
    if any(mask.any() for mask in unchanged):
        new_columns, lookups = _resolve_unchanged(target, rows, new_columns, unchanged, full, kept, convert)
    new_typed = [
        convert(pc.cast(column, pa.binary()), pg).take(kept) for column, pg in zip(new_columns, target.columns)
    ]
    old_typed = []
    no_old_image = is_update & (rows.old < 0)
    for i, (column, pg) in enumerate(zip(old_columns, target.columns)):
        column = pc.cast(column, pa.binary())
        if i in target.key_index and no_old_image.any():  # the key did not change: the new image has it
            column = pc.if_else(pa.array(no_old_image), pc.cast(new_columns[i], pa.binary()), column)
        old_typed.append(convert(column, pg).take(kept))
    ops = rows.ops[kept]
    lsns = rows.lsns[kept]
    xids, times = _transaction_columns(lsns, transactions)
    key = json.dumps(matched_on)
    meta = {
        OP_COLUMN: pa.array(np.select([ops == INSERT, ops == UPDATE], ["insert", "update"], "delete"), pa.string()),
        LSN_COLUMN: pa.array(lsns, pa.int64()),
        SEQ_COLUMN: pa.array(rows.seqs[kept], pa.int64()),
        COMMIT_TIME_COLUMN: times,
        XID_COLUMN: xids,
        KEY_COLUMN: pa.array([None if op == INSERT else key for op in ops.tolist()], pa.string()),
    }
    arrays = list(meta.values()) + new_typed + old_typed
    return pa.Table.from_arrays(arrays, list(meta) + names + [OLD_PREFIX + name for name in names]), lookups


def _resolve_unchanged(
    target: TableTarget,
    rows: PendingRows,
    new_columns: list[pa.Array],
    unchanged: list[np.ndarray],
    full: bool,
    kept: np.ndarray,
    convert: Callable[[pa.Array, PgColumnType], pa.Array],
) -> tuple[list[pa.Array], DeltaLookups | None]:
    """New images with every unchanged TOAST value replaced by its value, change by change in order:
    from the old image (REPLICA IDENTITY FULL sends it whole), else from the newest image of the same
    key earlier in the batch, else marked for :class:`DeltaLookups` under the old key."""
    ncols = len(target.columns)
    new_images = row_values(new_columns, unchanged)
    old_images = row_values(*tuple_columns_at(rows.data, rows.old, ncols))
    index = target.key_index
    images: dict[tuple, list] = {}
    resolved: list[list | tuple] = []
    for op, old_at, new, old in zip(rows.ops.tolist(), rows.old.tolist(), new_images, old_images):
        if op == DELETE:
            images.pop(tuple([old[i] for i in index]), None)
            resolved.append(new)
            continue
        new_key = tuple([new[i] for i in index])
        old_key = tuple([old[i] for i in index]) if old_at >= 0 else new_key
        values = list(new)
        if UNCHANGED_TOAST in values:
            earlier = images.get(old_key)
            for c, value in enumerate(values):
                if value is UNCHANGED_TOAST:
                    if full and old[c] is not UNCHANGED_TOAST:
                        values[c] = old[c]
                    elif earlier is not None:
                        values[c] = earlier[c]
                    else:
                        values[c] = _FromDelta(old_key)
        if old_key != new_key:
            images.pop(old_key, None)
        images[new_key] = values
        resolved.append(values)
    origins: dict[tuple, int] = {}
    cells: dict[str, tuple[list[int], list[int]]] = {}
    position_of = {i: position for position, i in enumerate(kept.tolist())}
    columns: list[pa.Array] = []
    for c in range(ncols):
        values = [image[c] for image in resolved]
        for i, value in enumerate(values):
            if type(value) is _FromDelta:
                values[i] = None
                if i in position_of:
                    at, ids = cells.setdefault(target.columns[c].column, ([], []))
                    at.append(position_of[i])
                    ids.append(origins.setdefault(value.key, len(origins)))
        columns.append(pa.array(values, pa.binary()))
    if not origins:
        return columns, None
    keys = list(origins)
    key_table = pa.table({
        target.columns[i].column: convert(pa.array([key[j] for key in keys], pa.binary()), target.columns[i])
        for j, i in enumerate(index)
    })  # fmt: skip
    return columns, DeltaLookups(key_table, {name: (np.array(at), np.array(ids)) for name, (at, ids) in cells.items()})


def resolve_lookups(batch: pa.Table, lookups: DeltaLookups, found: pa.Table, table: object) -> pa.Table:
    """``batch`` with the cells ``lookups`` names set from ``found`` (the Delta rows under its keys)."""
    key_names = lookups.keys.column_names
    where = {tuple(row): n for n, row in enumerate(zip(*(found.column(name).to_pylist() for name in key_names)))}
    wanted = list(zip(*(lookups.keys.column(name).to_pylist() for name in key_names)))
    rows_of_keys = [where.get(key) for key in wanted]
    if any(row is None for row in rows_of_keys):
        raise PgcdcError(
            f"{table}: an update kept an unchanged TOAST value of a row Delta does not hold (Delta differed from "
            "PostgreSQL before this change)",
            RESNAPSHOT_FIX,
        )
    for name, (at, ids) in lookups.cells.items():
        column = batch.column(name).combine_chunks()
        values = found.column(name).take(pa.array(np.asarray(rows_of_keys)[ids])).cast(column.type).combine_chunks()
        mask = np.zeros(batch.num_rows, bool)
        mask[at] = True
        batch = batch.set_column(
            batch.column_names.index(name), name, pc.replace_with_mask(column, pa.array(mask), values)
        )
    return batch


def _transaction_columns(
    lsns: np.ndarray, transactions: Mapping[int, tuple[int, datetime]]
) -> tuple[pa.Array, pa.Array]:
    distinct, inverse = np.unique(lsns, return_inverse=True)
    xids = pa.array([transactions[lsn][0] for lsn in distinct.tolist()], pa.int64())
    times = pa.array([transactions[lsn][1] for lsn in distinct.tolist()], COMMIT_TIME_TYPE)
    take = pa.array(inverse.astype(np.int64))
    return xids.take(take), times.take(take)


def event_row(op: str, values: pa.Table | None, end: int, seq: int, transaction: tuple[int, datetime]) -> pa.Table:
    """The changelog row of a change to the whole table: ``truncate`` (no values), or ``fill``: the
    value (one row of ``values``) PostgreSQL gave every existing row in columns added with a default,
    which ``_pgcdc_key`` names."""
    meta = pa.table({
        OP_COLUMN: pa.array([op], pa.string()),
        LSN_COLUMN: pa.array([end], pa.int64()),
        SEQ_COLUMN: pa.array([seq], pa.int64()),
        COMMIT_TIME_COLUMN: pa.array([transaction[1]], COMMIT_TIME_TYPE),
        XID_COLUMN: pa.array([transaction[0]], pa.int64()),
        KEY_COLUMN: pa.array([None if values is None else json.dumps(values.column_names)], pa.string()),
    })  # fmt: skip
    if values is None:
        return meta
    return pa.Table.from_arrays([*meta.columns, *values.columns], [*meta.column_names, *values.column_names])


def seed_rows(table: pa.Table, snapshot_lsn: int) -> pa.Table:
    """The seed of a changelog: a ``reset`` row, then each row of the table as a ``snapshot`` row."""
    values = table.drop_columns([name for name in (BUCKET_COLUMN, LSN_COLUMN) if name in table.column_names])
    n = values.num_rows
    ops = pa.array(["reset"] + ["snapshot"] * n, pa.string())
    meta = {
        OP_COLUMN: ops,
        LSN_COLUMN: pa.array([snapshot_lsn] * (n + 1), pa.int64()),
        SEQ_COLUMN: pa.array([-2] + [-1] * n, pa.int64()),
        COMMIT_TIME_COLUMN: pa.nulls(n + 1, COMMIT_TIME_TYPE),
        XID_COLUMN: pa.nulls(n + 1, pa.int64()),
        KEY_COLUMN: pa.nulls(n + 1, pa.string()),
    }
    body = [pa.concat_arrays([pa.nulls(1, column.type), *column.chunks]) for column in values.columns]
    return pa.Table.from_arrays(list(meta.values()) + body, list(meta) + values.column_names)


def seed_marker(snapshot_lsn: int, table: str) -> str:
    """The seed commit's marker: a snapshot marker, so the changelog's log says which snapshot it starts from."""
    return json.dumps(
        {"pgcdc": {"kind": "snapshot", "snapshot_lsn": str(LSN(snapshot_lsn)), "table": table, "history": True}}
    )


def history_position(seq: int | np.ndarray, before: bool = False) -> int | np.ndarray:
    """Where a changelog row stands among its transaction's rows, as its commit's marker records it:
    ``2 * seq + 1`` for the change at ``seq`` (or a truncate), ``2 * seq`` for a fill that comes
    right before that change. A fill takes no position of its own in the transaction, so a marker
    counting ``seq`` alone could not tell the fill from the change before it or after it."""
    return 2 * seq + (0 if before else 1)


def changes_marker(end: int, position: int, seed_lsn: int) -> str:
    """The marker of a commit of changes: the keyless appends' marker (rows up to ``position``,
    :func:`history_position`, of the transaction ending at ``end``), plus the seed it continues, so the
    newest commit says it all."""
    return json.dumps(
        {
            "pgcdc": {
                "kind": "append",
                "applied_lsn": str(LSN(end)),
                "applied_seq": position,
                "history_of": str(LSN(seed_lsn)),
            }
        }
    )


def read_marker(table: object, marker: dict[str, Any] | None) -> tuple[int | None, tuple[int, int] | None]:
    """The seed's LSN and the newest change's (commit end LSN, position) a changelog's newest marker
    names (None, None: no changelog yet)."""
    if marker is None:
        return None, None
    if marker.get("kind") == "snapshot" and marker.get("history"):
        return int(LSN.parse(marker["snapshot_lsn"])), None
    if marker.get("kind") == "append" and "history_of" in marker:
        return int(LSN.parse(marker["history_of"])), (int(LSN.parse(marker["applied_lsn"])), int(marker["applied_seq"]))
    raise PgcdcError(
        f"the changelog of {table} has a commit pgcdc's changelogs do not write (marker {marker})",
        "move that directory away (another writer's table?), then snapshot the table again to start its changelog",
    )


def with_schema(batch: pa.Table, schema: pa.Schema) -> tuple[pa.Table, pa.Schema, dict[str, pa.DataType]]:
    """``batch`` in the changelog's columns: returns it, the columns the changelog lacks (to add) and the
    changelog columns to widen first. A changelog column the batch lacks (a dropped column) is NULL."""
    added = pa.schema([field.with_nullable(True) for field in batch.schema if field.name not in schema.names])
    widened: dict[str, pa.DataType] = {}
    arrays: list[pa.Array] = []
    for field in schema:
        if field.name not in batch.column_names:
            arrays.append(pa.nulls(batch.num_rows, field.type))
            continue
        column = batch.column(field.name)
        if column.type != field.type and is_safe_widening(field.type, column.type):
            widened[field.name] = column.type
        elif column.type != field.type:
            column = column.cast(field.type)
        arrays.append(column)
    arrays += [batch.column(name) for name in added.names]
    return pa.Table.from_arrays(arrays, schema.names + added.names), added, widened
