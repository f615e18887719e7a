"""PostgreSQL column types to Arrow types: the column description, the session settings its text
forms depend on, and the decisions listed in the package's docstring."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import pyarrow as pa

from resources.config.columns import ColumnChoice

SESSION_SETTINGS: dict[str, str] = {
    "TimeZone": "UTC",
    "DateStyle": "ISO, MDY",
    "IntervalStyle": "postgres",
    "extra_float_digits": "3",
    "bytea_output": "hex",
}
"""Settings every source session must apply before producing text values for ``resources.pgtypes``."""

SPARK_DECIMAL_MAX_PRECISION = 38
TIMESTAMP_POSITIVE_INFINITY = 2**63 - 1
"""Microseconds since the Unix epoch that stand for PostgreSQL's timestamp 'infinity'."""
TIMESTAMP_NEGATIVE_INFINITY = -(2**63)
"""Microseconds since the Unix epoch that stand for PostgreSQL's timestamp '-infinity'."""

_STRING_TYPES = frozenset({"text", "varchar", "bpchar", "name", "citext", "char", "uuid", "json", "jsonb", "xml"})
INTEGER_TYPES: dict[str, pa.DataType] = {"int2": pa.int16(), "int4": pa.int32(), "int8": pa.int64()}
FLOAT_TYPES: dict[str, pa.DataType] = {"float4": pa.float32(), "float8": pa.float64()}
_TIMESTAMP_TYPES: dict[str, pa.DataType] = {
    "timestamp": pa.timestamp("us"),
    "timestamptz": pa.timestamp("us", tz="UTC"),
}
_NUMERIC_TYPMOD_HEADER = 4


class PgValueError(ValueError):
    """A PostgreSQL value that the column's Delta type cannot hold without losing it.

    ``column`` names the column whose values PostgreSQL's text would keep (``as_text``): the
    callers, who know the table, turn it into the configuration key to set."""

    def __init__(self, message: str, column: str | None = None) -> None:
        super().__init__(message)
        self.column = column


@dataclass(frozen=True, slots=True)
class PgColumnType:
    """What the mapping needs to know about one column, taken from the catalog.

    ``base_name``/``kind``/``typmod`` describe the type after resolving domains, because a
    domain is stored exactly like its base type. ``type_name`` is ``format_type()`` of the
    declared type and only serves people reading errors and docs.
    """

    column: str
    type_oid: int
    type_name: str
    base_name: str
    kind: str = "b"
    typmod: int = -1
    element_name: str | None = None
    element_kind: str | None = None
    element_typmod: int = -1
    nullable: bool = True
    as_text: bool = False
    """Replicate as PostgreSQL's text whatever the type: the escape hatch for values the
    typed mapping refuses (numeric NaN, infinite dates, multi-dimensional arrays), set by the
    configuration's ``columns`` (``resources/config/columns.py``)."""
    source: str | None = None
    """The PostgreSQL name when ``column``, the Delta name, was renamed by the configuration."""
    excluded: bool = False
    """Left out of Delta by the configuration: a Relation message's row images still hold it."""

    @property
    def source_name(self) -> str:
        """The column's name in PostgreSQL (the catalog's, the Relation message's)."""
        return self.column if self.source is None else self.source

    @property
    def is_array(self) -> bool:
        return self.element_name is not None

    def element_type(self) -> PgColumnType:
        """The element as a column of its own, so arrays reuse the scalar converters."""
        if self.element_name is None:
            raise ValueError(f"column {self.column!r} ({self.type_name}) is not an array")
        return PgColumnType(
            column=self.column,
            type_oid=0,
            type_name=self.type_name.removesuffix("[]"),
            base_name=self.element_name,
            kind=self.element_kind or "b",
            typmod=self.element_typmod,
            source=self.source,
        )


def with_choices(columns: Iterable[PgColumnType], choices: Mapping[str, ColumnChoice]) -> list[PgColumnType]:
    """``columns`` (by PostgreSQL name) as the configuration's ``columns`` wants them in Delta: as text,
    renamed. Excluded columns are kept here, marked (a Relation message's row images hold them): whoever
    writes Delta's columns leaves them out."""
    result = []
    for col in columns:
        choice = choices.get(col.column)
        if choice is None:
            result.append(col)
            continue
        rename = {} if choice.rename is None else {"column": choice.rename, "source": col.column}
        result.append(
            replace(col, as_text=col.as_text or choice.as_text, excluded=choice.exclude, **rename)  # type: ignore[arg-type]
        )
    return result


def numeric_precision_scale(typmod: int) -> tuple[int, int] | None:
    """Decode ``numeric(p,s)``'s typmod; None when unconstrained.

    The scale is an 11-bit signed field since PostgreSQL 15 (``numeric(2,-3)``).
    """
    if typmod < _NUMERIC_TYPMOD_HEADER:
        return None
    packed = typmod - _NUMERIC_TYPMOD_HEADER
    precision = (packed >> 16) & 0xFFFF
    scale = ((packed & 0x7FF) ^ 1024) - 1024
    return precision, scale


def _decimal_shape(col: PgColumnType) -> tuple[int, int] | None:
    """The Spark decimal holding every value of ``numeric(p,s)``, or None when none can.

    Negative scales (whole multiples of 10^-s) and scales above the precision (PG15+)
    have no Spark spelling, but a wider decimal with 0 <= s <= p holds the same values.
    """
    declared = numeric_precision_scale(col.typmod)
    if declared is None:
        return None
    precision, scale = declared
    if scale < 0:
        precision, scale = precision - scale, 0
    elif scale > precision:
        precision = scale
    if precision > SPARK_DECIMAL_MAX_PRECISION:
        return None
    return precision, scale


def replicated_as_text(col: PgColumnType) -> bool:
    if col.as_text or col.kind != "b":
        return True
    if col.base_name == "numeric":
        return _decimal_shape(col) is None
    return not (
        col.base_name in INTEGER_TYPES
        or col.base_name in FLOAT_TYPES
        or col.base_name in _TIMESTAMP_TYPES
        or col.base_name in ("bool", "bytea", "date")
    )


def arrow_type(col: PgColumnType) -> pa.DataType:
    """The Arrow type :func:`to_arrow` produces for this column."""
    if col.is_array and not col.as_text:
        return pa.list_(arrow_type(col.element_type()))
    if replicated_as_text(col):
        return pa.string()
    name = col.base_name
    if name in INTEGER_TYPES:
        return INTEGER_TYPES[name]
    if name in FLOAT_TYPES:
        return FLOAT_TYPES[name]
    if name in _TIMESTAMP_TYPES:
        return _TIMESTAMP_TYPES[name]
    if name == "numeric":
        precision, scale = _decimal_shape(col)  # type: ignore[misc]
        return pa.decimal128(precision, scale)
    return {"bool": pa.bool_(), "bytea": pa.binary(), "date": pa.date32()}[name]


def arrow_schema(columns: Iterable[PgColumnType]) -> pa.Schema:
    """The Arrow schema of a table's converted batches, in column order."""
    return pa.schema([pa.field(col.column, arrow_type(col), nullable=col.nullable) for col in columns])


def csv_direct_type(col: PgColumnType) -> pa.DataType | None:
    """The type Arrow's CSV reader may parse this column's PostgreSQL text into directly.

    For these types the CSV converter and :func:`to_arrow`'s ``pc.cast`` share Arrow's value
    parsers, so every value the CSV reader accepts converts to exactly what :func:`to_arrow`
    gives (booleans need ``true_values=["t"]``, ``false_values=["f"]``). A value it refuses
    (timestamp ``infinity``, numeric ``NaN``, a BC date) must go through :func:`to_arrow` as
    text, which converts it or raises the documented :class:`PgValueError`. None: always text.
    """
    if col.is_array or replicated_as_text(col) or col.base_name == "bytea":
        return None
    return arrow_type(col)
