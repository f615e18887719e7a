"""Delta's type names computed without an engine agree with Spark's own for every type pgcdc writes (no server)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pyspark.sql.pandas.types import from_arrow_type

from resources.delta.delta_types import delta_type_name, is_safe_widening

SCALARS = [
    pa.bool_(),
    pa.int8(),
    pa.int16(),
    pa.int32(),
    pa.int64(),
    pa.float32(),
    pa.float64(),
    pa.string(),
    pa.large_string(),
    pa.binary(),
    pa.large_binary(),
    pa.binary(16),
    pa.date32(),
    pa.time64("us"),
    pa.timestamp("us"),
    pa.timestamp("us", tz="UTC"),
    pa.duration("us"),
    pa.null(),
    pa.decimal128(10, 2),
    pa.decimal128(38, 0),
    pa.decimal128(1, 1),
]
NESTED = [
    *(pa.list_(kind) for kind in SCALARS),
    pa.large_list(pa.int64()),
    pa.list_(pa.list_(pa.decimal128(12, 3))),
    pa.map_(pa.string(), pa.int64()),
    pa.struct([("a", pa.int32()), ("b b", pa.list_(pa.string()))]),
    pa.dictionary(pa.int32(), pa.string()),
]


@pytest.mark.parametrize("kind", SCALARS + NESTED, ids=str)
def test_delta_type_name_is_sparks_name(kind: pa.DataType) -> None:
    assert delta_type_name(kind) == from_arrow_type(kind).simpleString()


def test_safe_widenings_are_wider_integers_floats_and_decimals_of_the_same_scale() -> None:
    assert is_safe_widening(pa.int16(), pa.int64())
    assert is_safe_widening(pa.int32(), pa.int64())
    assert is_safe_widening(pa.float32(), pa.float64())
    assert is_safe_widening(pa.decimal128(10, 2), pa.decimal128(12, 2))
    assert not is_safe_widening(pa.int64(), pa.int32())
    assert not is_safe_widening(pa.decimal128(10, 2), pa.decimal128(12, 3))
    assert not is_safe_widening(pa.decimal128(12, 2), pa.decimal128(10, 2))
    assert not is_safe_widening(pa.int32(), pa.float64())
    assert not is_safe_widening(pa.string(), pa.binary())
