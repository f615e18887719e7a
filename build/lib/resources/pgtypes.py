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
  replicate that column as text (``PgColumnType.as_text``). Unconstrained ``numeric`` and
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
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

SESSION_SETTINGS: dict[str, str] = {
    "TimeZone": "UTC",
    "DateStyle": "ISO, MDY",
    "IntervalStyle": "postgres",
    "extra_float_digits": "3",
    "bytea_output": "hex",
}
"""Settings every source session must apply before producing text values for this module."""

SPARK_DECIMAL_MAX_PRECISION = 38
TIMESTAMP_POSITIVE_INFINITY = 2**63 - 1
"""Microseconds since the Unix epoch that stand for PostgreSQL's timestamp 'infinity'."""
TIMESTAMP_NEGATIVE_INFINITY = -(2**63)
"""Microseconds since the Unix epoch that stand for PostgreSQL's timestamp '-infinity'."""

_STRING_TYPES = frozenset(
    {"text", "varchar", "bpchar", "name", "citext", "char", "uuid", "json", "jsonb", "xml"}
)
_INTEGER_TYPES: dict[str, pa.DataType] = {"int2": pa.int16(), "int4": pa.int32(), "int8": pa.int64()}
_FLOAT_TYPES: dict[str, pa.DataType] = {"float4": pa.float32(), "float8": pa.float64()}
_TIMESTAMP_TYPES: dict[str, pa.DataType] = {
    "timestamp": pa.timestamp("us"),
    "timestamptz": pa.timestamp("us", tz="UTC"),
}
#: Spark SQL names of the scalar Arrow types arrow_type() produces.
_SPARK_SCALAR_NAMES: dict[pa.DataType, str] = {
    pa.string(): "string",
    pa.int16(): "smallint",
    pa.int32(): "int",
    pa.int64(): "bigint",
    pa.float32(): "float",
    pa.float64(): "double",
    pa.timestamp("us"): "timestamp_ntz",
    pa.timestamp("us", tz="UTC"): "timestamp",
    pa.bool_(): "boolean",
    pa.binary(): "binary",
    pa.date32(): "date",
}
_NUMERIC_TYPMOD_HEADER = 4


class PgValueError(ValueError):
    """A PostgreSQL value that the column's Delta type cannot hold without losing it."""


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
    typed mapping refuses (numeric NaN, infinite dates, multi-dimensional arrays)."""

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
        )


def pg_type_catalog_query() -> str:
    """SQL describing types for ``PgColumnType``, given ``%(type_oids)s`` and ``%(typmods)s``.

    Both the snapshot (pg_attribute) and CDC (pgoutput Relation messages) paths know each
    column's type oid and typmod, so one query serves both. Domains are resolved
    recursively, taking the domain's own typmod (``CREATE DOMAIN d AS numeric(10,2)``),
    and so are domains used as array elements. Rows come back in input order with the
    1-based ``ord``; pass each to :func:`column_type_from_catalog`.
    """
    return """
WITH RECURSIVE
wanted AS (
    SELECT w.ord, w.type_oid, w.typmod
    FROM ROWS FROM (pg_catalog.unnest(%(type_oids)s::pg_catalog.oid[]),
                    pg_catalog.unnest(%(typmods)s::pg_catalog.int4[]))
         WITH ORDINALITY AS w(type_oid, typmod, ord)
),
base_chain AS (
    SELECT w.ord, w.type_oid AS oid, w.typmod, 0 AS depth FROM wanted w
    UNION ALL
    SELECT c.ord, t.typbasetype, CASE WHEN c.typmod OPERATOR(pg_catalog.<>) -1 THEN c.typmod ELSE t.typtypmod END,
           c.depth OPERATOR(pg_catalog.+) 1
    FROM base_chain c JOIN pg_catalog.pg_type t ON t.oid OPERATOR(pg_catalog.=) c.oid
    WHERE t.typtype OPERATOR(pg_catalog.=) 'd'
),
base AS (
    SELECT DISTINCT ON (ord) ord, oid, typmod FROM base_chain ORDER BY ord, depth DESC
),
element_chain AS (
    SELECT b.ord, t.typelem AS oid, b.typmod, 0 AS depth
    FROM base b JOIN pg_catalog.pg_type t ON t.oid OPERATOR(pg_catalog.=) b.oid
    WHERE t.typcategory OPERATOR(pg_catalog.=) 'A' AND t.typelem OPERATOR(pg_catalog.<>) 0::pg_catalog.oid
    UNION ALL
    SELECT c.ord, t.typbasetype, CASE WHEN c.typmod OPERATOR(pg_catalog.<>) -1 THEN c.typmod ELSE t.typtypmod END,
           c.depth OPERATOR(pg_catalog.+) 1
    FROM element_chain c JOIN pg_catalog.pg_type t ON t.oid OPERATOR(pg_catalog.=) c.oid
    WHERE t.typtype OPERATOR(pg_catalog.=) 'd'
),
element AS (
    SELECT DISTINCT ON (ord) ord, oid, typmod FROM element_chain ORDER BY ord, depth DESC
)
SELECT w.ord, w.type_oid, w.typmod,
       pg_catalog.format_type(w.type_oid, w.typmod) AS type_name,
       bt.typname AS base_name, bt.typtype AS kind, b.typmod AS base_typmod,
       et.typname AS element_name, et.typtype AS element_kind, e.typmod AS element_typmod
FROM wanted w
JOIN base b ON b.ord OPERATOR(pg_catalog.=) w.ord
JOIN pg_catalog.pg_type bt ON bt.oid OPERATOR(pg_catalog.=) b.oid
LEFT JOIN element e ON e.ord OPERATOR(pg_catalog.=) w.ord
LEFT JOIN pg_catalog.pg_type et ON et.oid OPERATOR(pg_catalog.=) e.oid
ORDER BY w.ord
"""


def pg_type_catalog_params(types: Iterable[tuple[int, int]]) -> dict[str, str]:
    """The parameters of :func:`pg_type_catalog_query` for (type oid, typmod) pairs, as array text.

    Text rather than Python lists: a client-side-binding cursor (the snapshot's walsender
    session) renders a list with an unqualified cast such as ``'{...}'::int4[]``, which a
    type planted on the session's search path could capture.
    """
    pairs = list(types)
    return {
        "type_oids": "{" + ",".join(str(oid) for oid, _ in pairs) + "}",
        "typmods": "{" + ",".join(str(typmod) for _, typmod in pairs) + "}",
    }


def column_type_from_catalog(
    column: str, row: Sequence[object], *, nullable: bool = True, as_text: bool = False
) -> PgColumnType:
    """Build a ``PgColumnType`` from one row of :func:`pg_type_catalog_query`."""
    (_, type_oid, _, type_name, base_name, kind, base_typmod,
     element_name, element_kind, element_typmod) = row
    return PgColumnType(
        column=column,
        type_oid=int(type_oid),  # type: ignore[call-overload]
        type_name=str(type_name),
        base_name=str(base_name),
        kind=str(kind),
        typmod=int(base_typmod),  # type: ignore[call-overload]
        element_name=None if element_name is None else str(element_name),
        element_kind=None if element_kind is None else str(element_kind),
        element_typmod=-1 if element_typmod is None else int(element_typmod),  # type: ignore[call-overload]
        nullable=nullable,
        as_text=as_text,
    )


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


def _is_text(col: PgColumnType) -> bool:
    if col.as_text or col.kind != "b":
        return True
    if col.base_name == "numeric":
        return _decimal_shape(col) is None
    return not (
        col.base_name in _INTEGER_TYPES
        or col.base_name in _FLOAT_TYPES
        or col.base_name in _TIMESTAMP_TYPES
        or col.base_name in ("bool", "bytea", "date")
    )


def arrow_type(col: PgColumnType) -> pa.DataType:
    """The Arrow type :func:`to_arrow` produces for this column."""
    if col.is_array and not col.as_text:
        return pa.list_(arrow_type(col.element_type()))
    if _is_text(col):
        return pa.string()
    name = col.base_name
    if name in _INTEGER_TYPES:
        return _INTEGER_TYPES[name]
    if name in _FLOAT_TYPES:
        return _FLOAT_TYPES[name]
    if name in _TIMESTAMP_TYPES:
        return _TIMESTAMP_TYPES[name]
    if name == "numeric":
        precision, scale = _decimal_shape(col)  # type: ignore[misc]
        return pa.decimal128(precision, scale)
    return {"bool": pa.bool_(), "bytea": pa.binary(), "date": pa.date32()}[name]


def spark_ddl_type(col: PgColumnType) -> str:
    """The Spark SQL / Delta type of the column: derived from :func:`arrow_type`, so the two never disagree."""
    return _spark_ddl(arrow_type(col))


def _spark_ddl(arrow: pa.DataType) -> str:
    if pa.types.is_list(arrow):
        return f"array<{_spark_ddl(arrow.value_type)}>"
    if pa.types.is_decimal(arrow):
        return f"decimal({arrow.precision},{arrow.scale})"
    return _SPARK_SCALAR_NAMES[arrow]


def arrow_schema(columns: Iterable[PgColumnType]) -> pa.Schema:
    """The Arrow schema of a table's converted batches, in column order."""
    return pa.schema(
        [pa.field(col.column, arrow_type(col), nullable=col.nullable) for col in columns]
    )


def csv_direct_type(col: PgColumnType) -> pa.DataType | None:
    """The type Arrow's CSV reader may parse this column's PostgreSQL text into directly.

    For these types the CSV converter and :func:`to_arrow`'s ``pc.cast`` share Arrow's value
    parsers, so every value the CSV reader accepts converts to exactly what :func:`to_arrow`
    gives (booleans need ``true_values=["t"]``, ``false_values=["f"]``). A value it refuses
    (timestamp ``infinity``, numeric ``NaN``, a BC date) must go through :func:`to_arrow` as
    text, which converts it or raises the documented :class:`PgValueError`. None: always text.
    """
    if col.is_array or _is_text(col) or col.base_name == "bytea":
        return None
    return arrow_type(col)


def to_arrow(values: pa.Array, col: PgColumnType) -> pa.Array:
    """Convert PostgreSQL text output (NULL as null) into the column's Arrow type.

    ``values`` may be string, large_string or binary holding UTF-8 text.
    """
    text = _as_string(values)
    if col.is_array and not col.as_text:
        return _array_to_arrow(text, col)
    if _is_text(col):
        return text
    name = col.base_name
    target = arrow_type(col)
    if name in _INTEGER_TYPES or name in _FLOAT_TYPES:
        return pc.cast(text, target)
    if name == "numeric":
        return _numeric_to_arrow(text, col, target)
    if name == "bool":
        return _bool_to_arrow(text, col)
    if name == "bytea":
        return _bytea_to_arrow(text, col)
    if name == "date":
        return _date_to_arrow(text, col)
    return _timestamp_to_arrow(text, col, target)


def _as_string(values: pa.Array) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if pa.types.is_string(values.type):
        return values
    return pc.cast(values, pa.string())


def _first_failure(text: pa.Array, accepts: Callable[[str], bool]) -> str:
    """The first non-null value ``accepts`` rejects, to name it in an error."""
    for value in text.to_pylist():
        if value is not None and not accepts(value):
            return value
    raise AssertionError("a vectorised conversion failed but every value parses")


def _numeric_to_arrow(text: pa.Array, col: PgColumnType, target: pa.DataType) -> pa.Array:
    try:
        return pc.cast(text, target)
    except pa.ArrowInvalid:
        bad = _first_failure(text, lambda v: v not in ("NaN", "Infinity", "-Infinity"))
        raise PgValueError(
            f"column {col.column!r} ({col.type_name}) holds {bad!r}, which no Spark decimal "
            "can represent; replicate the column as text (as_text) to keep it"
        ) from None


def _bool_to_arrow(text: pa.Array, col: PgColumnType) -> pa.Array:
    known = pc.or_kleene(pc.equal(text, "t"), pc.equal(text, "f"))
    if not pc.all(pc.or_kleene(known, pc.is_null(text)), min_count=0).as_py():  # an empty input (every bool[] empty or NULL) is fine
        bad = _first_failure(text, lambda v: v in ("t", "f"))
        raise PgValueError(f"column {col.column!r} (boolean) holds {bad!r}, not t or f")
    return pc.equal(text, "t")


def _bytea_to_arrow(text: pa.Array, col: PgColumnType) -> pa.Array:
    decoded: list[bytes | None] = []
    for value in text.to_pylist():
        if value is None:
            decoded.append(None)
        elif value.startswith("\\x"):
            decoded.append(bytes.fromhex(value[2:]))
        else:
            raise PgValueError(
                f"column {col.column!r} (bytea) holds {value[:40]!r}: expected hex output "
                "(bytea_output=hex)"
            )
    return pa.array(decoded, pa.binary())


def _date_to_arrow(text: pa.Array, col: PgColumnType) -> pa.Array:
    """ISO dates of years 0001..9999 cast directly; Arrow refuses every other form."""
    try:
        return pc.cast(text, pa.date32())
    except pa.ArrowInvalid:
        bad = _first_failure(text, lambda v: _PLAIN_DATE.match(v) is not None)
        raise PgValueError(
            f"column {col.column!r} (date) holds {bad!r}, outside the 0001-01-01..9999-12-31 "
            "range Delta/Spark dates support; replicate the column as text (as_text) to keep it"
        ) from None


_PLAIN_DATE = re.compile(r"^\d{4}-\d\d-\d\d$")
_TIMESTAMP_TEXT = re.compile(
    r"^(\d{4,})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?"
    r"(?:([+-])(\d\d)(?::(\d\d))?(?::(\d\d))?)?( BC)?$"
)
_MICROS_PER_DAY = 86_400_000_000


def _days_from_civil(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 in the proleptic Gregorian calendar, for any year.

    Python's ``datetime`` stops at years 1..9999; PostgreSQL does not.
    """
    year -= month <= 2
    era = year // 400
    year_of_era = year - era * 400
    day_of_year = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    day_of_era = year_of_era * 365 + year_of_era // 4 - year_of_era // 100 + day_of_year
    return era * 146_097 + day_of_era - 719_468


def _timestamp_micros(value: str, col: PgColumnType) -> int:
    """Microseconds since the epoch for the forms Arrow's ISO parser refuses."""
    if value == "infinity":
        return TIMESTAMP_POSITIVE_INFINITY
    if value == "-infinity":
        return TIMESTAMP_NEGATIVE_INFINITY
    match = _TIMESTAMP_TEXT.match(value)
    if match is None:
        raise PgValueError(f"column {col.column!r} ({col.type_name}) holds {value!r}: not a timestamp")
    (year, month, day, hour, minute, second, fraction,
     sign, offset_h, offset_m, offset_s, bc) = match.groups()
    astronomical_year = 1 - int(year) if bc else int(year)
    micros = _days_from_civil(astronomical_year, int(month), int(day)) * _MICROS_PER_DAY
    micros += ((int(hour) * 60 + int(minute)) * 60 + int(second)) * 1_000_000
    micros += int((fraction or "0").ljust(6, "0"))
    if sign is not None:
        offset = (int(offset_h) * 60 + int(offset_m or 0)) * 60 + int(offset_s or 0)
        micros -= (1 if sign == "+" else -1) * offset * 1_000_000
    if not TIMESTAMP_NEGATIVE_INFINITY < micros < TIMESTAMP_POSITIVE_INFINITY:
        raise PgValueError(
            f"column {col.column!r} ({col.type_name}) holds {value!r}, beyond the int64 "
            "microsecond range of Delta timestamps"
        )
    return micros


def _timestamp_to_arrow(text: pa.Array, col: PgColumnType, target: pa.DataType) -> pa.Array:
    """Cast in C; only when that fails, parse the rows it cannot (infinity, BC, year > 9999)."""
    try:
        return pc.cast(text, target)
    except pa.ArrowInvalid:
        pass
    pattern = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d{1,6})?([+-]\d\d(:\d\d)?)?$"
    special = pc.invert(pc.fill_null(pc.match_substring_regex(text, pattern), True))
    plain = pc.cast(pc.if_else(special, pa.scalar(None, pa.string()), text), target)
    special_micros = [
        _timestamp_micros(value, col)
        for value, is_special in zip(text.to_pylist(), special.to_pylist())
        if is_special and value is not None
    ]
    special_with_values = pc.and_(special, pc.is_valid(text))
    micros = pc.replace_with_mask(
        plain.cast(pa.int64()), special_with_values, pa.array(special_micros, pa.int64())
    )
    return micros.cast(target)


def _array_to_arrow(text: pa.Array, col: PgColumnType) -> pa.Array:
    """Split array literals into one flat text column, convert that, then re-nest it."""
    element = col.element_type()
    delimiter = ";" if element.base_name == "box" else ","
    offsets = [0]
    flat: list[str | None] = []
    for value in text.to_pylist():
        if value is not None:
            flat.extend(parse_array_literal(value, delimiter, col))
        offsets.append(len(flat))
    elements = to_arrow(pa.array(flat, pa.string()), element)
    return pa.ListArray.from_arrays(
        pa.array(offsets, pa.int32()),
        elements,
        type=pa.list_(elements.type),
        mask=pc.is_null(text),
    )


def parse_array_literal(
    literal: str, delimiter: str = ",", col: PgColumnType | None = None
) -> list[str | None]:
    """Elements of a one-dimensional PostgreSQL array's text output, NULL as None.

    Quoted elements are unescaped (backslash escapes the next character); an unquoted
    ``NULL`` is SQL NULL while a quoted ``"NULL"`` is the string.
    """
    where = f"column {col.column!r} ({col.type_name})" if col is not None else "array"
    if literal.startswith("[") or literal.startswith("{{"):
        raise PgValueError(
            f"{where} holds {literal[:60]!r}: multi-dimensional arrays and non-default bounds "
            "have no Delta array shape; replicate the column as text (as_text) to keep them"
        )
    if not (literal.startswith("{") and literal.endswith("}")):
        raise PgValueError(f"{where} holds {literal[:60]!r}: not an array literal")
    inner = literal[1:-1]
    if not inner:
        return []
    if '"' not in inner:
        return [None if part == "NULL" else part for part in inner.split(delimiter)]
    elements: list[str | None] = []
    position = 0
    length = len(inner)
    while position <= length:
        if position < length and inner[position] == '"':
            chars: list[str] = []
            position += 1
            while inner[position] != '"':
                if inner[position] == "\\":
                    position += 1
                chars.append(inner[position])
                position += 1
            elements.append("".join(chars))
            position += 1
        else:
            end = inner.find(delimiter, position)
            end = length if end < 0 else end
            part = inner[position:end]
            elements.append(None if part == "NULL" else part)
            position = end
        position += 1
    return elements
