"""Delta table == PostgreSQL table, value for value: the comparison the tests and the demo share.

Delta is read with delta-rs (``deltalake``), an engine independent of the Sail writer, through
its DataFusion reader, which applies deletion vectors (``resources.delta.reads.delta_rs_rows``),
and PostgreSQL with psycopg. The type Delta must hold each column in is derived from the
PostgreSQL catalog by the documented mapping (docs/type-mapping.md, written out here, not taken
from the writer's ``resources/pgtypes/``), and Delta's schema is checked against it. Columns
mapped to strings (numeric without a Spark precision, intervals, json, ...) are compared with
PostgreSQL's text output; timestamps as int64 microseconds since the epoch (infinity at the
int64 limits); every other type as Python values (Decimal, date, bytes, lists, ...).

``compare_table`` reads PostgreSQL through a connection the caller owns, so a caller can
compare against a snapshot it holds open (``REPEATABLE READ``) while writes go on.
``deltalake`` is imported on use: it comes with the ``dev`` extra.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence

import psycopg
import pyarrow as pa

from resources.config.columns import ColumnChoice
from resources.delta.layout import BUCKET_COLUMN, row_buckets, TableLayout
from resources.delta.markers import LAYOUT_PROPERTY
from resources.delta.reads import delta_rs_rows
from resources.names import TableName
from resources.pgtypes import SESSION_SETTINGS
from resources.postgres.connections import connect
from resources.sql import quote_ident

__all__ = [
    "arrow_rows",
    "assert_buckets_right",
    "assert_delta_equals_postgres",
    "compare_rows",
    "compare_table",
    "delta_rows",
]


class _ExactFloat(float):
    """A float equal to another exactly when PostgreSQL prints them alike: NaN equals NaN (Python's
    ``nan != nan`` would make every row holding one differ), ``-0.0`` differs from ``0.0``."""

    def _identity(self) -> str:
        return "nan" if math.isnan(self) else float.hex(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ExactFloat) and self._identity() == other._identity()

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self._identity())

    def __repr__(self) -> str:
        return float.__repr__(self)


def _hashable(value: object) -> object:
    """Lists (arrays) as tuples, floats compared as PostgreSQL prints them, so rows can be counted."""
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return _ExactFloat(value) if isinstance(value, float) else value


def _sort_key(row: tuple) -> tuple:
    return tuple((value is None, repr(value)) for value in row)


def delta_rows(path: str, storage_options: Mapping[str, str] | None = None) -> tuple[pa.Schema, list[dict]]:
    """Rows as Python values; timestamps as int64 microseconds, since pgcdc stores PostgreSQL's
    infinity at the int64 limits, beyond Python's datetime. ``storage_options`` reach an
    object-store lake (``LakeStorage.object_store_options``)."""
    return arrow_rows(delta_rs_rows(path, storage_options=storage_options))


def arrow_rows(table: pa.Table) -> tuple[pa.Schema, list[dict]]:
    """:func:`delta_rows` of rows already read (an as-of read of a changelog, say)."""
    schema = table.schema
    for i, f in enumerate(schema):
        if pa.types.is_timestamp(f.type):
            table = table.set_column(i, f.name, table.column(i).cast(pa.int64()))
        elif _is_list(f.type) and pa.types.is_timestamp(f.type.value_type):
            table = table.set_column(i, f.name, table.column(i).cast(pa.list_(pa.int64())))
    return schema, table.to_pylist()


def _is_list(arrow: pa.DataType) -> bool:
    return pa.types.is_list(arrow) or pa.types.is_large_list(arrow) or pa.types.is_list_view(arrow)


#: docs/type-mapping.md's table, written out here rather than taken from ``resources/pgtypes/``, so
#: that a regression of the writer's mapping (numeric written as string, say) fails the comparison.
#: Every type not named here, nor numeric, nor an array, is a string.
_DOCUMENTED_TYPES: dict[str, pa.DataType] = {
    "int2": pa.int16(),
    "int4": pa.int32(),
    "int8": pa.int64(),
    "float4": pa.float32(),
    "float8": pa.float64(),
    "bool": pa.bool_(),
    "bytea": pa.binary(),
    "date": pa.date32(),
    "timestamp": pa.timestamp("us"),
    "timestamptz": pa.timestamp("us", tz="UTC"),
}
_MAX_DECIMAL_PRECISION = 38


def _documented_numeric(typmod: int) -> pa.DataType:
    """numeric(p,s) as documented: decimal(p,s) with a negative scale folded into the precision and a
    scale above the precision raising it; unconstrained or p > 38: string."""
    if typmod < 4:  # no typmod: unconstrained
        return pa.string()
    precision = ((typmod - 4) >> 16) & 0xFFFF
    scale = (((typmod - 4) & 0x7FF) ^ 1024) - 1024  # 11-bit signed, as PostgreSQL stores it
    if scale < 0:
        precision, scale = precision - scale, 0
    precision = max(precision, scale)
    return pa.decimal128(precision, scale) if precision <= _MAX_DECIMAL_PRECISION else pa.string()


def _documented_type(conn: psycopg.Connection, type_oid: int, typmod: int) -> pa.DataType:
    """The Arrow type docs/type-mapping.md gives PostgreSQL type ``type_oid`` with ``typmod``, read from
    the catalog: domains as their base type with the domain's typmod, arrays as lists of their element."""
    ((name, namespace, kind, base, base_typmod, element, category, length),) = conn.execute(
        "SELECT t.typname::pg_catalog.text, n.nspname::pg_catalog.text, t.typtype::pg_catalog.text,"
        " t.typbasetype::pg_catalog.int8, t.typtypmod, t.typelem::pg_catalog.int8, t.typcategory::pg_catalog.text,"
        " t.typlen FROM pg_catalog.pg_type t"
        " JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) t.typnamespace"
        " WHERE t.oid OPERATOR(pg_catalog.=) %s::pg_catalog.oid",
        (type_oid,),
    ).fetchall()
    if kind == "d":
        return _documented_type(conn, base, base_typmod if base_typmod != -1 else typmod)
    if category == "A" and element and length == -1:
        return pa.list_(_documented_type(conn, element, typmod))
    if namespace != "pg_catalog":
        return pa.string()
    if name == "numeric":
        return _documented_numeric(typmod)
    return _DOCUMENTED_TYPES.get(name, pa.string())


def expected_types(conn: psycopg.Connection, schema_name: str, table_name: str) -> dict[str, tuple[str, pa.DataType]]:
    """Each column of the PostgreSQL table: its type as PostgreSQL names it, and the Arrow type Delta
    must hold it in by the documented mapping (independent of the writer's ``resources/pgtypes/``)."""
    rows = conn.execute(
        "SELECT attname::pg_catalog.text, atttypid::pg_catalog.int8, atttypmod, pg_catalog.format_type(atttypid, atttypmod)"
        " FROM pg_catalog.pg_attribute WHERE attrelid OPERATOR(pg_catalog.=) %s::pg_catalog.regclass"
        " AND attnum OPERATOR(pg_catalog.>) 0 AND NOT attisdropped ORDER BY attnum",
        (f"{quote_ident(schema_name)}.{quote_ident(table_name)}",),
    ).fetchall()
    return {name: (shown, _documented_type(conn, oid, typmod)) for name, oid, typmod, shown in rows}


def _as_read(arrow: pa.DataType) -> pa.DataType:
    """A Delta column's type as read, with the large and view layouts a reader may choose folded away."""
    if pa.types.is_large_string(arrow) or pa.types.is_string_view(arrow):
        return pa.string()
    if pa.types.is_large_binary(arrow) or pa.types.is_binary_view(arrow):
        return pa.binary()
    if _is_list(arrow):
        return pa.list_(_as_read(arrow.value_type))
    return arrow


def _pg_expression(name: str, arrow: pa.DataType) -> str:
    """The SELECT expression giving PostgreSQL's value in the form Delta's column is compared in."""
    return _pg_value(quote_ident(name), arrow)


def _pg_value(value: str, arrow: pa.DataType) -> str:
    """``value`` (a column or an array element) in the form Delta's ``arrow`` type is compared in. Arrays
    element by element, in order: their elements get the same treatment as a column of the element type."""
    if pa.types.is_list(arrow):
        element = _pg_value("element", arrow.value_type)
        return (
            f"CASE WHEN {value} IS NULL THEN NULL ELSE ARRAY(SELECT {element}"
            f" FROM pg_catalog.unnest({value}) WITH ORDINALITY AS elements(element, position) ORDER BY position) END"
        )
    if pa.types.is_string(arrow):
        # The type's output function, as COPY and pgoutput use it: a ::text cast would differ
        # for some types (char(n) loses its blank padding, inet gains a /32 mask).
        return f"CASE WHEN {value} IS NULL THEN NULL ELSE pg_catalog.format('%s', {value}) END"
    if pa.types.is_timestamp(arrow):
        return (
            f"CASE WHEN {value} OPERATOR(pg_catalog.=) 'infinity' THEN 9223372036854775807"
            f" WHEN {value} OPERATOR(pg_catalog.=) '-infinity' THEN -9223372036854775808"
            f" ELSE (extract(epoch FROM {value}) OPERATOR(pg_catalog.*) 1000000)::bigint END"
        )
    if pa.types.is_float32(arrow):
        # Exact: every float4 is a float8. psycopg would read float4's shortest text ("0.1") as the double
        # nearest to it, not as the float32 Delta holds.
        return f"{value}::pg_catalog.float8"
    return value


def compare_table(
    conn: psycopg.Connection,
    table: str | TableName,
    path: str,
    *,
    key: Sequence[str] = (),
    extra_delta_columns: Sequence[str] = (),
    storage_options: Mapping[str, str] | None = None,
    columns: Mapping[str, ColumnChoice] | None = None,
) -> int:
    """Raise AssertionError with a readable diff unless the Delta table at ``path`` equals
    ``table`` (``schema.name``, split at its first dot, or a ``TableName`` for any names) as ``conn``
    sees it, ignoring ``_pgcdc_*`` columns; returns the row count.

    ``extra_delta_columns`` are Delta columns PostgreSQL no longer has (dropped columns,
    kept in Delta by design); they are not compared. ``key`` only shapes the diff. ``columns``: the
    pipeline's configured choices for this table's columns, by PostgreSQL name (as text: a string
    holding PostgreSQL's text output; renamed: under the Delta name; excluded: not in Delta).
    """
    return compare_rows(
        conn, table, *delta_rows(path, storage_options), key=key, extra_delta_columns=extra_delta_columns,
        columns=columns,
    )  # fmt: skip


def compare_rows(
    conn: psycopg.Connection,
    table: str | TableName,
    schema: pa.Schema,
    delta: list[dict],
    *,
    key: Sequence[str] = (),
    extra_delta_columns: Sequence[str] = (),
    columns: Mapping[str, ColumnChoice] | None = None,
) -> int:
    """:func:`compare_table` of rows already read (``schema`` and rows as :func:`arrow_rows` gives them)."""
    schema_name, table_name = (table.schema, table.name) if isinstance(table, TableName) else table.partition(".")[::2]
    expected, in_delta = _configured(expected_types(conn, schema_name, table_name), columns or {})
    pg_columns = [in_delta[name] for name in expected]
    delta_columns = [f.name for f in schema if not f.name.startswith("_pgcdc_")]
    unexpected = set(delta_columns) - set(pg_columns) - set(extra_delta_columns)
    missing = set(pg_columns) - set(delta_columns)
    if unexpected or missing:
        raise AssertionError(f"{table}: Delta columns {sorted(delta_columns)} vs PostgreSQL {pg_columns}")
    mistyped = [
        f"{name} ({shown}): Delta holds {schema.field(in_delta[name]).type}, the documented mapping gives {arrow}"
        for name, (shown, arrow) in expected.items()
        if _as_read(schema.field(in_delta[name]).type) != arrow
    ]
    if mistyped:
        raise AssertionError(f"{table}: Delta's schema is not the documented mapping: {'; '.join(mistyped)}")
    select = ", ".join(_pg_expression(name, arrow) for name, (_, arrow) in expected.items())
    pg_rows = [
        tuple(_hashable(value) for value in row)
        for row in conn.execute(f"SELECT {select} FROM {quote_ident(schema_name)}.{quote_ident(table_name)}").fetchall()
    ]
    delta_tuples = [tuple(_hashable(row[name]) for name in pg_columns) for row in delta]
    if Counter(delta_tuples) != Counter(pg_rows):
        raise AssertionError(_diff(table, pg_columns, key, pg_rows, delta_tuples))
    return len(pg_rows)


def _configured(
    expected: dict[str, tuple[str, pa.DataType]], choices: Mapping[str, ColumnChoice]
) -> tuple[dict[str, tuple[str, pa.DataType]], dict[str, str]]:
    """The documented types as the configured choices change them (excluded columns left out, a column
    as text a string), and each kept column's Delta name."""
    kept: dict[str, tuple[str, pa.DataType]] = {}
    in_delta: dict[str, str] = {}
    for name, (shown, arrow) in expected.items():
        choice = choices.get(name, ColumnChoice())
        if choice.exclude:
            continue
        kept[name] = (shown, pa.string() if choice.as_text else arrow)
        in_delta[name] = choice.rename or name
    return kept, in_delta


def assert_delta_equals_postgres(
    dsn: str,
    table: str | TableName,
    path: str,
    *,
    key: Sequence[str] = (),
    extra_delta_columns: Sequence[str] = (),
    storage_options: Mapping[str, str] | None = None,
    columns: Mapping[str, ColumnChoice] | None = None,
) -> int:
    """:func:`compare_table` on a fresh connection to ``dsn``."""
    with connect(dsn, application_name="pgcdc-verify", session_settings=SESSION_SETTINGS) as conn:
        return compare_table(
            conn, table, path, key=key, extra_delta_columns=extra_delta_columns, storage_options=storage_options,
            columns=columns,
        )  # fmt: skip


#: A value's repr longer than this shows as its start and its length, so a diff of wide rows stays readable.
SHOWN_VALUE_CHARS = 60


def _shown(values: object) -> str:
    """``values`` (a row, a key, a list of rows or None) as its repr with every long value cut to its start."""
    if isinstance(values, (tuple, list)):
        inner = ", ".join(_shown(value) for value in values)
        return f"({inner}{',' if len(values) == 1 else ''})" if isinstance(values, tuple) else f"[{inner}]"
    text = repr(values)
    return text if len(text) <= SHOWN_VALUE_CHARS else f"{text[:SHOWN_VALUE_CHARS]}...({len(text)} chars)"


def _diff(
    table: str | TableName, columns: list[str], key: Sequence[str], pg_rows: list[tuple], delta_rows_: list[tuple]
) -> str:
    """A readable diff: rows per key that differ, or multiset differences without a key; long values elided."""
    lines = [f"Delta differs from PostgreSQL for {table} (columns {columns}):"]
    if key:
        positions = [columns.index(name) for name in key]
        by_key_pg = {tuple(row[i] for i in positions): row for row in pg_rows}
        by_key_delta: dict[tuple, list[tuple]] = {}
        for row in delta_rows_:
            by_key_delta.setdefault(tuple(row[i] for i in positions), []).append(row)
        for k in sorted(set(by_key_pg) | set(by_key_delta), key=_sort_key):
            expected, got = by_key_pg.get(k), by_key_delta.get(k, [])
            if got != ([expected] if expected is not None else []):
                lines.append(f"  key {_shown(k)}: PostgreSQL {_shown(expected)}")
                lines.append(f"  {' ' * len(f'key {_shown(k)}')}  Delta      {_shown(got)}")
    else:
        pg_count, delta_count = Counter(pg_rows), Counter(delta_rows_)
        for row in sorted((pg_count - delta_count).elements(), key=_sort_key):
            lines.append(f"  only in PostgreSQL: {_shown(row)}")
        for row in sorted((delta_count - pg_count).elements(), key=_sort_key):
            lines.append(f"  only in Delta:      {_shown(row)}")
    if len(lines) > 41:
        lines = lines[:41] + [f"  ... {len(lines) - 41} more lines"]
    return "\n".join(lines)


def assert_buckets_right(
    path: str,
    storage_options: Mapping[str, str] | None = None,
    known: TableLayout | None = None,
    unbucketed_rows: bool = False,
) -> TableLayout | None:
    """Raise AssertionError unless every row of the Delta table at ``path`` sits in the bucket its
    key gives it under the layout its newest snapshot marker and its table property recorded (the two
    must agree; the property alone once log cleanup removed the marker), and the table is partitioned
    by the bucket column; a table without a layout must have no bucket column. Returns the layout.
    ``known``: the layout the caller knows the table has, for a table whose log no longer names it
    (its marker gone, no property: Delta on Spark, or a table that adopted buckets by a re-snapshot);
    where the log names one, the two must agree. A row in the NULL bucket whose key has a bucket is
    wrong unless ``unbucketed_rows`` says the test wrote such rows (a layout whose columns were gone).

    :func:`compare_table` ignores the bucket column (it is not PostgreSQL's); this is its check.
    """
    import deltalake  # the dev extra

    options = dict(storage_options) if storage_options else None
    delta = deltalake.DeltaTable(path, storage_options=options)
    # the marker; once log cleanup removed it, the table property (resources/delta/markers.py)
    configured = delta.metadata().configuration.get(LAYOUT_PROPERTY) or "none"
    layout = TableLayout.from_json(json.loads(configured)) if configured != "none" else None
    for commit in delta.history():  # newest first
        marker = json.loads(commit["userMetadata"]) if str(commit.get("userMetadata") or "").startswith("{") else {}
        pgcdc = marker.get("pgcdc") if isinstance(marker, dict) else None
        if isinstance(pgcdc, dict) and pgcdc.get("kind") == "snapshot":
            marked = TableLayout.from_json(pgcdc["layout"]) if pgcdc.get("layout") else None
            # a table created unbucketed (or by an earlier pgcdc) may have adopted a layout since
            assert layout is None or marked == layout, (
                f"{path}: the snapshot marker says {marked}, the table property {layout}"
            )
            layout = marked
            break
    else:
        if layout is None:  # the marker is gone and no property names a layout
            layout = known
    assert known is None or layout == known, f"{path}: the log says {layout}, the caller knows {known}"
    table = delta_rs_rows(path, storage_options=storage_options)
    if layout is None:
        assert BUCKET_COLUMN not in table.column_names, f"{path}: a bucket column but no layout in the snapshot marker"
        return None
    assert delta.metadata().partition_columns == [BUCKET_COLUMN], (
        f"{path}: partitioned by {delta.metadata().partition_columns}"
    )
    expected = row_buckets(
        layout, {name: table.column(name) for name in layout.key if name in table.column_names}, table.num_rows
    )
    stored = table.column(BUCKET_COLUMN).combine_chunks()
    # NULL is a bucket every MERGE predicate includes, for rows written while their bucket could not be
    # computed (``unbucketed_rows``: the caller made such rows); anywhere else a NULL is a row lost to pruning
    wrong = [
        i
        for i, (got, want) in enumerate(zip(stored.to_pylist(), expected.to_pylist()))
        if got != want and not (got is None and unbucketed_rows)
    ]
    if wrong:
        rows = table.take(wrong[:5]).select([*layout.key, BUCKET_COLUMN]).to_pylist()
        raise AssertionError(
            f"{path}: {len(wrong)} row(s) outside their key's bucket ({layout.describe()}), e.g. {rows}"
        )
    return layout
