"""PostgreSQL column types to Arrow / Delta types, and text values to typed Arrow arrays.

Both ingestion paths (COPY for snapshots, pgoutput tuples for CDC) hand us PostgreSQL's
*text output* for each value. Converting that text column-at-a-time with
``pyarrow.compute`` casts keeps the common scalar types at C speed; only rare shapes
(arrays, bytea, infinite or BC timestamps) go through Python per value.

The text forms parsed here are only stable under fixed session settings, so every
connection that produces values for this module must apply :data:`SESSION_SETTINGS`.

Decisions a data engineer should know (also tabulated in ``docs/type-mapping.md``):

* **numeric(p,s)** with an effective precision <= 38 becomes ``decimal(p,s)``, because that
  is what such columns hold in practice (money amounts, quantities) and what downstream SQL
  wants. Such a column can still hold ``NaN`` (and ``Infinity`` on PostgreSQL 14+), which no
  Spark decimal can represent: converting one raises :class:`PgValueError` naming the
  column, instead of writing a null or a clamp that nobody would notice. The remedy is to
  replicate that column as text (``PgColumnType.as_text``, set by the configuration's
  ``columns: {"schema.table.column": text}``: ``resources/config/columns.py``). Unconstrained ``numeric`` and
  precisions above 38 become ``string`` holding PostgreSQL's exact text: nothing is lost.
* **timestamp / timestamptz** keep their type. ``infinity`` / ``-infinity`` become the largest /
  smallest int64 microsecond values (year 294247 / -290308): no finite PostgreSQL value maps
  there (the few finite instants at or beyond year 294247 are refused), so the mapping is
  reversible and keeps PostgreSQL's ordering (``valid_to > now()`` still holds for
  infinity). BC timestamps are stored exactly (proleptic Gregorian, astronomical years:
  44 BC is year -43), as PostgreSQL itself computes them.
* **date** keeps its type for 0001-01-01..9999-12-31, the range Spark documents and the only
  one Sail 0.7.2 can write (it panics on other dates). ``infinity``, BC dates and years
  above 9999 raise :class:`PgValueError` naming the column; no in-range value is free to
  stand for infinity without colliding with a real date such as 9999-12-31.
* **Arrays** become ``array<element>`` with NULL elements kept. PostgreSQL does not enforce
  dimensions (``int[][]`` and ``int[]`` are one type), so the Delta type cannot follow a
  value's shape: a multi-dimensional value, or one with non-default bounds
  (``[0:1]={...}``), raises :class:`PgValueError` rather than being flattened.
* **money** becomes ``string``: its text depends on ``lc_monetary`` (currency symbol,
  grouping, fraction digits), so parsing it into a decimal would guess.
* Anything else (time, interval, network, ranges, enums, composites, extension types)
  becomes ``string`` holding PostgreSQL's text output, which loses nothing.

The package by concern: ``mapping`` (column types to Arrow types, the session settings),
``catalog`` (the catalog query describing column types), ``spark_ddl`` (Delta type names),
``text`` (text output to Arrow arrays). Its public names are importable from the package itself.
"""

from __future__ import annotations

from resources.pgtypes.catalog import column_type_from_catalog, pg_type_catalog_params, pg_type_catalog_query
from resources.pgtypes.mapping import (
    arrow_schema,
    arrow_type,
    csv_direct_type,
    numeric_precision_scale,
    PgColumnType,
    PgValueError,
    SESSION_SETTINGS,
    SPARK_DECIMAL_MAX_PRECISION,
    TIMESTAMP_NEGATIVE_INFINITY,
    TIMESTAMP_POSITIVE_INFINITY,
    with_choices,
)
from resources.pgtypes.spark_ddl import spark_ddl_type
from resources.pgtypes.text import parse_array_literal, to_arrow

__all__ = [
    "arrow_schema",
    "arrow_type",
    "column_type_from_catalog",
    "csv_direct_type",
    "numeric_precision_scale",
    "parse_array_literal",
    "pg_type_catalog_params",
    "pg_type_catalog_query",
    "PgColumnType",
    "PgValueError",
    "SESSION_SETTINGS",
    "SPARK_DECIMAL_MAX_PRECISION",
    "spark_ddl_type",
    "TIMESTAMP_NEGATIVE_INFINITY",
    "TIMESTAMP_POSITIVE_INFINITY",
    "to_arrow",
    "with_choices",
]
