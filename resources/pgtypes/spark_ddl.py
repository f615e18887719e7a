"""The Spark SQL / Delta type of a column, derived from its Arrow type so the two never disagree."""

from __future__ import annotations

import pyarrow as pa

from resources.pgtypes.mapping import arrow_type, PgColumnType

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


def spark_ddl_type(col: PgColumnType) -> str:
    """The Spark SQL / Delta type of the column: derived from :func:`arrow_type`, so the two never disagree."""
    return _spark_ddl(arrow_type(col))


def _spark_ddl(arrow: pa.DataType) -> str:
    if pa.types.is_list(arrow):
        return f"array<{_spark_ddl(arrow.value_type)}>"
    if pa.types.is_decimal(arrow):
        return f"decimal({arrow.precision},{arrow.scale})"
    return _SPARK_SCALAR_NAMES[arrow]
