"""PostgreSQL's text output to typed Arrow arrays: column-at-a-time ``pyarrow.compute`` casts for the
common scalars, Python per value only for rare shapes (arrays, bytea, infinite or BC timestamps)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc

from resources.pgtypes.mapping import (
    arrow_type,
    FLOAT_TYPES,
    INTEGER_TYPES,
    PgColumnType,
    PgValueError,
    replicated_as_text,
    TIMESTAMP_NEGATIVE_INFINITY,
    TIMESTAMP_POSITIVE_INFINITY,
)


def to_arrow(values: pa.Array, col: PgColumnType) -> pa.Array:
    """Convert PostgreSQL text output (NULL as null) into the column's Arrow type.

    ``values`` may be string, large_string or binary holding UTF-8 text.
    """
    text = _as_string(values)
    if col.is_array and not col.as_text:
        return _array_to_arrow(text, col)
    if replicated_as_text(col):
        return text
    name = col.base_name
    target = arrow_type(col)
    if name in INTEGER_TYPES or name in FLOAT_TYPES:
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
            "can represent; replicate the column as text to keep it",
            col.source_name,
        ) from None


def _bool_to_arrow(text: pa.Array, col: PgColumnType) -> pa.Array:
    known = pc.or_kleene(pc.equal(text, "t"), pc.equal(text, "f"))
    if not pc.all(
        pc.or_kleene(known, pc.is_null(text)), min_count=0
    ).as_py():  # an empty input (every bool[] empty or NULL) is fine
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
                f"column {col.column!r} (bytea) holds {value[:40]!r}: expected hex output (bytea_output=hex)"
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
            "range Delta/Spark dates support; replicate the column as text to keep it",
            col.source_name,
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
    (year, month, day, hour, minute, second, fraction, sign, offset_h, offset_m, offset_s, bc) = match.groups()
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
            "microsecond range of Delta timestamps; replicate the column as text to keep it",
            col.source_name,
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
    micros = pc.replace_with_mask(plain.cast(pa.int64()), special_with_values, pa.array(special_micros, pa.int64()))
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


def parse_array_literal(literal: str, delimiter: str = ",", col: PgColumnType | None = None) -> list[str | None]:
    """Elements of a one-dimensional PostgreSQL array's text output, NULL as None.

    Quoted elements are unescaped (backslash escapes the next character); an unquoted
    ``NULL`` is SQL NULL while a quoted ``"NULL"`` is the string.
    """
    where = f"column {col.column!r} ({col.type_name})" if col is not None else "array"
    if literal.startswith("[") or literal.startswith("{{"):
        raise PgValueError(
            f"{where} holds {literal[:60]!r}: multi-dimensional arrays and non-default bounds "
            "have no Delta array shape; replicate the column as text to keep them",
            None if col is None else col.source_name,
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
