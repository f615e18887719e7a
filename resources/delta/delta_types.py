"""Delta's names of Arrow types and the type changes Delta follows in place, without an engine.

The change applier compares a table's columns with the ones a Relation message announces through
these names; they are the names Spark gives the same types (``from_arrow_type(...).simpleString()``),
computed here so that the applier loads no engine client.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.types as types

_SAFE_WIDENINGS = {("smallint", "int"), ("smallint", "bigint"), ("int", "bigint"), ("float", "double")}

_SIMPLE: tuple[tuple[object, str], ...] = (
    (types.is_boolean, "boolean"),
    (types.is_int8, "tinyint"),
    (types.is_int16, "smallint"),
    (types.is_int32, "int"),
    (types.is_int64, "bigint"),
    (types.is_float32, "float"),
    (types.is_float64, "double"),
    (types.is_string, "string"),
    (types.is_large_string, "string"),
    (types.is_binary, "binary"),
    (types.is_fixed_size_binary, "binary"),
    (types.is_large_binary, "binary"),
    (types.is_date32, "date"),
    (types.is_timestamp, "timestamp"),
    (types.is_duration, "interval day to second"),
    (types.is_null, "void"),
)


def delta_type_name(arrow: pa.DataType) -> str:
    """The Delta (Spark SQL) name of ``arrow``: ``bigint``, ``decimal(10,2)``, ``array<string>``."""
    for test, name in _SIMPLE:
        if test(arrow):  # type: ignore[operator]
            return name
    if types.is_decimal(arrow):
        return f"decimal({arrow.precision},{arrow.scale})"
    if types.is_time64(arrow):
        return "time(6)"
    if types.is_list(arrow) or types.is_large_list(arrow) or types.is_fixed_size_list(arrow):
        return f"array<{delta_type_name(arrow.value_type)}>"
    if types.is_map(arrow):
        return f"map<{delta_type_name(arrow.key_type)},{delta_type_name(arrow.item_type)}>"
    if types.is_struct(arrow):
        return "struct<" + ",".join(f"{field.name}:{delta_type_name(field.type)}" for field in arrow) + ">"
    if types.is_dictionary(arrow):
        return delta_type_name(arrow.value_type)
    raise TypeError(f"no Delta type for Arrow type {arrow}")


def is_safe_widening(old: pa.DataType, new: pa.DataType) -> bool:
    """Whether Delta can keep ``old``'s values under ``new``: a wider integer or float, or a decimal of
    the same scale and at least the precision."""
    if (delta_type_name(old), delta_type_name(new)) in _SAFE_WIDENINGS:
        return True
    return types.is_decimal(old) and types.is_decimal(new) and new.scale == old.scale and new.precision >= old.precision


STATISTICS_COLUMNS_PROPERTY = "delta.dataSkippingStatsColumns"

_WITH_STATISTICS = (
    types.is_integer,
    types.is_decimal,
    types.is_date,
    types.is_timestamp,
    types.is_string,
    types.is_large_string,
)
"""The types Delta keeps statistics on that pgcdc lets it: Delta on Spark refuses the property naming any other
(a boolean, a binary, an array), and floats are left out (below)."""


def statistics_columns(schema: pa.Schema, key: Sequence[str] | None) -> dict[str, str]:
    """The table property naming the columns whose min/max statistics writers record for each data file:
    a bucketed table's ``key`` (the only columns a MERGE locates rows by; the bucket, a partition column,
    needs none), else every column; of those, the ones of :data:`_WITH_STATISTICS` types.

    Statistics on every column cost each write and every log read of the table (docs/engine-notes.md, "A
    small table's MERGE on Delta on Spark"). Floats never get them: Sail 0.7.2 reads a file's float column as
    one constant when the log says its minimum equals its maximum, and no minimum or maximum holds NaN, so a
    file of ``NaN, 8.0, NaN`` reads as ``8.0, 8.0, 8.0``, and every rewrite of it stores that
    (docs/engine-notes.md, "NaN and a file's statistics on Sail"); a float key only loses its key-list
    pruning. Delta on Spark, delta-rs and Sail honour the property in every file they write, names
    backquoted; columns added later are outside the list. A table created by an older pgcdc keeps
    statistics on its first 32 columns."""
    names = key if key is not None else schema.names
    kept = [
        name
        for name in names
        if name in schema.names and any(check(schema.field(name).type) for check in _WITH_STATISTICS)
    ]
    if not kept:
        return {"delta.dataSkippingNumIndexedCols": "0"}
    return {STATISTICS_COLUMNS_PROPERTY: ",".join("`" + name.replace("`", "``") + "`" for name in kept)}
