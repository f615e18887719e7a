"""As-of reads: a table as it was at an LSN, from its SCD type 2 table or folded from its changelog (docs/history.md).

An SCD type 2 table (``resources/history/scd2.py``) holds the answer directly: the versions with
``_pgcdc_valid_from_lsn <= X`` and no ``_pgcdc_valid_to_lsn`` or one above X (:func:`versions_as_of`).

The changelog holds, in commit order, a seed (``reset``, then the table's rows as its snapshot
wrote them) and every row change after it. Folding the rows up to an LSN replays them on an
empty table: ``reset`` and ``truncate`` empty it, ``snapshot`` and ``insert`` add their new
image, ``delete`` removes one row whose ``_pgcdc_key`` columns equal its old image, ``update``
removes that row and adds its new image, ``fill`` sets the ``_pgcdc_key`` columns of every row
to its values (columns added with a default). A table under REPLICA IDENTITY FULL is a multiset
(its key names every column), so one copy goes per change, as in PostgreSQL.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession

from resources.cdc.row_multiset import comparable_rows
from resources.config import PgcdcConfig
from resources.delta.lake_storage import LakeStorage
from resources.delta.markers import LSN_COLUMN
from resources.delta.reads import read_rows
from resources.delta.table_log import table_exists
from resources.errors import ConfigurationError, PgcdcError
from resources.history.changelog import (
    COMMIT_TIME_COLUMN,
    COMMIT_TIME_TYPE,
    KEY_COLUMN,
    OLD_PREFIX,
    OP_COLUMN,
    SEQ_COLUMN,
)
from resources.history.scd2 import (
    CURRENT_COLUMN,
    VALID_FROM_COLUMN,
    VALID_FROM_LSN_COLUMN,
    VALID_TO_COLUMN,
    VALID_TO_LSN_COLUMN,
)
from resources.lsn import LSN
from resources.postgres.catalog import TableName
from resources.runs.slot_guard import SlotGuard

__all__ = [
    "fold_changelog",
    "lsn_at_time",
    "read_as_of",
    "value_columns",
    "version_lsn_at_time",
    "versions_as_of",
]

_META_PREFIX = "_pgcdc_"


def value_columns(changes: pa.Schema) -> list[str]:
    """The table's own columns in a changelog (those of every time: added ones too, dropped ones kept)."""
    return [name for name in changes.names if not name.startswith(_META_PREFIX)]


def read_as_of(
    spark: SparkSession,
    config: PgcdcConfig,
    table: TableName,
    lsn: LSN | None = None,
    time: datetime | None = None,
    lake: LakeStorage | None = None,
    allow_stale: bool = False,
) -> pa.Table:
    """``table`` as it was once every transaction ending at or before ``lsn`` was applied (None: all of
    its changelog, which is the table as its Delta table holds it now); or, with ``time``, before the
    first transaction committed after it (:func:`lsn_at_time`). Read from the table's SCD type 2 table
    when its history is ``scd2``, else folded from its changelog. ``lake``: the object store holding it.

    An ``lsn`` past what the lake has drained (:func:`drained_position`) has no answer the lake can
    know, and is refused; ``allow_stale`` reads the lake as of its drained position instead."""
    path = _changelog_path(config, table, lake)
    if lsn is not None:
        lsn = _within_drained(config, lsn, lake, allow_stale)
    rows = _in_utc(read_rows(spark, path, None))
    scd2 = config.history.mode(table) == "scd2"
    if lsn is not None:
        _refuse_before_history(table, lsn, rows.column(VALID_FROM_LSN_COLUMN if scd2 else LSN_COLUMN))
    if scd2:
        return versions_as_of(rows, version_lsn_at_time(rows, time) if time is not None else lsn)
    return fold_changelog(rows, lsn_at_time(rows, time) if time is not None else lsn)


def drained_position(config: PgcdcConfig, lake: LakeStorage | None) -> LSN | None:
    """The position up to which the lake holds every change: the highest one pgcdc allowed its slot
    (recorded only once the Delta commits below it are durable: ``resources/runs/slot_guard.py``);
    None for a lake that records none yet."""
    record = SlotGuard(config.delta.root, config.slot, lake).read()
    return None if record is None else record.allowed


def _within_drained(config: PgcdcConfig, lsn: LSN, lake: LakeStorage | None, allow_stale: bool) -> LSN:
    """``lsn``, refused past the lake's drained position; with ``allow_stale``, that position instead."""
    drained = drained_position(config, lake)
    if drained is not None and lsn <= drained:
        return lsn
    where = f"the lake has drained up to {drained}" if drained is not None else "the lake records no drained position"
    if allow_stale and drained is not None:
        return drained
    raise PgcdcError(
        f"{lsn} is past what the lake knows ({where}): the table at that LSN may hold changes not drained yet",
        "run a drain first (the pgcdc_incremental job), or pass --allow-stale to read the lake as of its drained "
        "position",
    )


def _refuse_before_history(table: TableName, lsn: LSN, positions: pa.ChunkedArray) -> None:
    """An LSN before the table's history begins (its seed: the snapshot it starts at) has no answer here."""
    first = pc.min(positions).as_py()
    if first is not None and int(lsn) < first:
        raise PgcdcError(
            f"{lsn} is before the history of {table}, which begins at {LSN(first)} (its snapshot)",
            "ask for an LSN at or after it; what the table held before is not in the lake",
        )


def _lsn_scalar(lsn: int) -> pa.Scalar:
    """``lsn`` as the int64 the LSN columns hold; any LSN past the int64 range is past every stored one."""
    return pa.scalar(min(int(lsn), _INT64_MAX), pa.int64())


_INT64_MAX = 2**63 - 1


def _in_utc(rows: pa.Table) -> pa.Table:
    """``rows`` with every zoned timestamp in UTC, as pgcdc maps timestamptz on every engine (a Spark
    session answers in its own time zone's name, e.g. ``Etc/UTC``; the instants are the same)."""
    fields = [
        field.with_type(pa.timestamp(field.type.unit, "UTC"))
        if pa.types.is_timestamp(field.type) and field.type.tz is not None else field
        for field in rows.schema
    ]  # fmt: skip
    return rows.cast(pa.schema(fields, rows.schema.metadata))


def versions_as_of(versions: pa.Table, lsn: int | None = None) -> pa.Table:
    """The table's columns as of ``lsn`` from its SCD type 2 versions (None: the current versions)."""
    if lsn is None:
        alive = pc.fill_null(versions.column(CURRENT_COLUMN), False)
    else:
        at = _lsn_scalar(lsn)
        valid_to = versions.column(VALID_TO_LSN_COLUMN)
        alive = pc.and_(
            pc.less_equal(versions.column(VALID_FROM_LSN_COLUMN), at),
            pc.or_(pc.is_null(valid_to), pc.greater(pc.fill_null(valid_to, 0), at)),
        )
    return versions.filter(alive).select(value_columns(versions.schema))


def version_lsn_at_time(versions: pa.Table, time: datetime) -> int | None:
    """:func:`lsn_at_time` for an SCD type 2 table: the LSN just before the first transaction after
    ``time`` that opened or closed a version (None: none did)."""
    _require_zone(time)
    at = pa.scalar(time, COMMIT_TIME_TYPE)
    lsns = [
        pc.min(
            versions.column(lsn_column).filter(pc.fill_null(pc.greater(versions.column(time_column), at), False))
        ).as_py()
        for lsn_column, time_column in (
            (VALID_FROM_LSN_COLUMN, VALID_FROM_COLUMN),
            (VALID_TO_LSN_COLUMN, VALID_TO_COLUMN),
        )
    ]
    after = [lsn for lsn in lsns if lsn is not None]
    return int(min(after)) - 1 if after else None


def _require_zone(time: datetime) -> None:
    if time.tzinfo is None:
        raise ConfigurationError(
            f"the time {time.isoformat()} has no time zone", "give one, e.g. 2026-11-25T18:00:00+00:00"
        )


def lsn_at_time(changes: pa.Table, time: datetime) -> int | None:
    """The LSN just before the first transaction in the changelog that committed after ``time`` (None:
    none did, the whole changelog).

    Commit times follow commit order only as far as the server's clock does, so an LSN is the exact
    way to name a moment. The seed has no commit time: a time before the snapshot gives the seed.
    """
    _require_zone(time)
    after = changes.filter(pc.greater(changes.column(COMMIT_TIME_COLUMN), pa.scalar(time, COMMIT_TIME_TYPE)))
    return int(pc.min(after.column(LSN_COLUMN)).as_py()) - 1 if after.num_rows else None


def _changelog_path(config: PgcdcConfig, table: TableName, lake: LakeStorage | None) -> str:
    if not table_exists(config.table_path(table.schema, table.name), lake):
        raise ConfigurationError(
            f"{table} is not replicated by this pipeline: no Delta table at {config.table_path(table.schema, table.name)}",
            f"name a table of publication {config.publication} (schema.table), or snapshot it first",
        )
    path = config.history_path(table.schema, table.name)
    if path is None:
        raise ConfigurationError(
            f"{table} keeps no history",
            f"set history.tables.{table}: changelog (or scd2), then snapshot the table again",
        )
    if not table_exists(path, lake):
        raise PgcdcError(
            f"{table} has no history yet at {path}", "it starts with the first drain that meets a change of the table"
        )
    return path


def fold_changelog(changes: pa.Table, lsn: int | None = None) -> pa.Table:
    """The table's columns as of ``lsn`` (None: everything), by replaying ``changes`` in commit order."""
    names = value_columns(changes.schema)
    if lsn is not None:
        changes = changes.filter(pc.less_equal(changes.column(LSN_COLUMN), _lsn_scalar(lsn)))
    # A fill shares the position of the change it comes before (commits may be read in any order).
    after_fill = pc.not_equal(changes.column(OP_COLUMN), "fill")
    order = pa.table({"lsn": changes.column(LSN_COLUMN), "seq": changes.column(SEQ_COLUMN), "after_fill": after_fill})
    changes = changes.take(
        pc.sort_indices(order, [("lsn", "ascending"), ("seq", "ascending"), ("after_fill", "ascending")])
    )
    ops = changes.column(OP_COLUMN).to_pylist()
    keys = changes.column(KEY_COLUMN).to_pylist()
    lsns = changes.column(LSN_COLUMN).to_pylist()
    # timestamps and dates as integers: Python's datetimes end short of PostgreSQL's infinity
    new = [[_canonical(value) for (value,) in comparable_rows(changes, [name])] for name in names]
    old = [
        [_canonical(value) for (value,) in comparable_rows(changes, [OLD_PREFIX + name])]
        if OLD_PREFIX + name in changes.column_names else [None] * changes.num_rows
        for name in names
    ]  # fmt: skip
    rows = _Rows(new)
    positions_of: dict[str, tuple[int, ...]] = {}
    for i, op in enumerate(ops):
        if op in ("insert", "snapshot"):
            rows.add(i)
        elif op in ("update", "delete"):
            key = keys[i]
            positions = positions_of.get(key)
            if positions is None:
                positions = positions_of[key] = tuple(names.index(name) for name in json.loads(key))
            if not rows.remove(positions, tuple([old[p][i] for p in positions])):
                raise PgcdcError(
                    f"the changelog's {op} at {LSN(lsns[i])} finds no row with its old values",
                    "the changelog does not start at a snapshot of the table; snapshot the table again",
                )
            if op == "update":
                rows.add(i)
        elif op in ("reset", "truncate"):
            rows.clear()
        elif op == "fill":
            rows.fill(tuple(names.index(name) for name in json.loads(keys[i])), i)
        else:
            raise PgcdcError(
                f"the changelog holds an unknown operation {op!r} at {LSN(lsns[i])}", "it was written by another writer"
            )
    return pa.table(
        {name: changes.column(name).take(pa.array(rows.sources(p), pa.int64())) for p, name in enumerate(names)}
    )


class _Rows:
    """The rows alive and lookups by column subsets. A row is the changelog row whose new image it is
    (its number), with the changelog rows of the fills that set some of its columns since."""

    def __init__(self, new: list[list[Any]]) -> None:
        self._new = new
        self._alive: dict[int, dict[int, int] | None] = {}
        self._by: dict[tuple[int, ...], dict[tuple, list[int]]] = {}

    def _values(self, i: int, positions: tuple[int, ...]) -> tuple:
        filled = self._alive[i]
        if filled is None:
            return tuple([self._new[p][i] for p in positions])
        return tuple([self._new[p][filled.get(p, i)] for p in positions])

    def add(self, i: int) -> None:
        self._alive[i] = None
        for positions, index in self._by.items():
            index.setdefault(self._values(i, positions), []).append(i)

    def remove(self, positions: tuple[int, ...], values: tuple) -> bool:
        index = self._by.get(positions)
        if index is None:
            index = self._by[positions] = {}
            for i in self._alive:
                index.setdefault(self._values(i, positions), []).append(i)
        found = index.get(values)
        if not found:
            return False
        i = found.pop()
        for other, other_index in self._by.items():
            if other != positions:
                other_index[self._values(i, other)].remove(i)
        del self._alive[i]
        return True

    def fill(self, positions: tuple[int, ...], j: int) -> None:
        """Every row takes changelog row ``j``'s values in the columns at ``positions``."""
        for i, filled in self._alive.items():
            self._alive[i] = {**(filled or {}), **dict.fromkeys(positions, j)}
        self._by.clear()  # lookups are built again on use

    def sources(self, p: int) -> list[int]:
        """For each row alive, the changelog row holding its value of column ``p``."""
        return [i if filled is None else filled.get(p, i) for i, filled in self._alive.items()]

    def clear(self) -> None:
        self._alive.clear()
        self._by.clear()


def _canonical(value: Any) -> Any:
    """A hashable value equal exactly when PostgreSQL prints the values alike, as the applier compares
    REPLICA IDENTITY FULL rows: NaN equals NaN, ``-0.0`` differs from ``0.0``, ``1.0`` from ``1.00``."""
    if isinstance(value, float):
        return ("float", "nan" if math.isnan(value) else value.hex())
    if isinstance(value, Decimal):
        return ("numeric", str(value))
    if isinstance(value, list):
        return tuple(_canonical(item) for item in value)
    if isinstance(value, dict):
        return tuple((key, _canonical(item)) for key, item in value.items())
    return value
