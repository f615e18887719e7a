"""PostgreSQL text output to typed Arrow columns: exact values, including the awkward ones."""

from __future__ import annotations

import datetime as dt
import math
from decimal import Decimal
from typing import TYPE_CHECKING

import pyarrow as pa
import pytest

from resources.pgtypes import (
    arrow_schema,
    arrow_type,
    column_type_from_catalog,
    numeric_precision_scale,
    parse_array_literal,
    pg_type_catalog_query,
    PgColumnType,
    PgValueError,
    SESSION_SETTINGS,
    spark_ddl_type,
    TIMESTAMP_NEGATIVE_INFINITY,
    TIMESTAMP_POSITIVE_INFINITY,
    to_arrow,
)

if TYPE_CHECKING:
    from tests.support.postgres import PgDatabase


def numeric_typmod(precision: int, scale: int) -> int:
    return ((precision << 16) | (scale & 0x7FF)) + 4


def column(
    base_name: str, typmod: int = -1, *, element: str | None = None, kind: str = "b", as_text: bool = False
) -> PgColumnType:
    return PgColumnType(
        column="c",
        type_oid=0,
        type_name=f"{element}[]" if element else base_name,
        base_name=f"_{element}" if element else base_name,
        kind=kind,
        typmod=typmod,
        element_name=element,
        element_kind="b" if element else None,
        element_typmod=typmod if element else -1,
        as_text=as_text,
    )


def convert(values: list[str | None], col: PgColumnType) -> pa.Array:
    result = to_arrow(pa.array(values, pa.string()), col)
    assert result.type == arrow_type(col)
    return result


@pytest.mark.parametrize(
    ("col", "arrow", "ddl"),
    [
        (column("int2"), pa.int16(), "smallint"),
        (column("int4"), pa.int32(), "int"),
        (column("int8"), pa.int64(), "bigint"),
        (column("numeric", numeric_typmod(10, 2)), pa.decimal128(10, 2), "decimal(10,2)"),
        (column("numeric", numeric_typmod(38, 0)), pa.decimal128(38, 0), "decimal(38,0)"),
        (column("numeric", numeric_typmod(39, 2)), pa.string(), "string"),
        (column("numeric", numeric_typmod(2, -3)), pa.decimal128(5, 0), "decimal(5,0)"),
        (column("numeric", numeric_typmod(3, 5)), pa.decimal128(5, 5), "decimal(5,5)"),
        (column("numeric"), pa.string(), "string"),
        (column("float4"), pa.float32(), "float"),
        (column("float8"), pa.float64(), "double"),
        (column("bool"), pa.bool_(), "boolean"),
        (column("citext"), pa.string(), "string"),
        (column("bytea"), pa.binary(), "binary"),
        (column("uuid"), pa.string(), "string"),
        (column("jsonb"), pa.string(), "string"),
        (column("date"), pa.date32(), "date"),
        (column("timestamp"), pa.timestamp("us"), "timestamp_ntz"),
        (column("timestamptz"), pa.timestamp("us", tz="UTC"), "timestamp"),
        (column("interval"), pa.string(), "string"),
        (column("money"), pa.string(), "string"),
        (column("inet"), pa.string(), "string"),
        (column("mood", kind="e"), pa.string(), "string"),
        (column("int4range", kind="r"), pa.string(), "string"),
        (column("int4", element="int4"), pa.list_(pa.int32()), "array<int>"),
        (
            column("numeric", numeric_typmod(5, 1), element="numeric"),
            pa.list_(pa.decimal128(5, 1)),
            "array<decimal(5,1)>",
        ),
        (column("int4", element="int4", as_text=True), pa.string(), "string"),
        (column("date", as_text=True), pa.string(), "string"),
    ],
)
def test_type_mapping(col: PgColumnType, arrow: pa.DataType, ddl: str) -> None:
    assert arrow_type(col) == arrow
    assert spark_ddl_type(col) == ddl


def test_numeric_typmod_decodes_negative_scale() -> None:
    assert numeric_precision_scale(numeric_typmod(10, 2)) == (10, 2)
    assert numeric_precision_scale(numeric_typmod(2, -3)) == (2, -3)
    assert numeric_precision_scale(-1) is None


def test_integers_and_null() -> None:
    assert convert(["-32768", "32767", None], column("int2")).to_pylist() == [-32768, 32767, None]
    assert convert(["-9223372036854775808", "9223372036854775807"], column("int8")).to_pylist() == [-(2**63), 2**63 - 1]


def test_floats_keep_nan_and_infinities() -> None:
    values = convert(
        ["1.5", "NaN", "Infinity", "-Infinity", "1e+308", "-0", "4.9406564584124654e-324", None], column("float8")
    ).to_pylist()
    assert values[0] == 1.5 and math.isnan(values[1])
    assert values[2:5] == [math.inf, -math.inf, 1e308]
    assert math.copysign(1, values[5]) == -1 and values[6] == 5e-324 and values[7] is None
    single = convert(["3.4028235e+38", "0.1"], column("float4"))
    assert single.to_pylist() == [pa.scalar(3.4028235e38, pa.float32()).as_py(), pa.scalar(0.1, pa.float32()).as_py()]


def test_numerics_exact_to_38_digits() -> None:
    col = column("numeric", numeric_typmod(38, 10))
    values = ["1234567890123456789012345678.0123456789", "-0.0000000001", "0.0000000000", None]
    assert convert(values, col).to_pylist() == [Decimal(values[0]), Decimal("-1E-10"), Decimal("0E-10"), None]
    assert convert(["12000"], column("numeric", numeric_typmod(2, -3))).to_pylist() == [Decimal("12000")]


def test_unconstrained_numeric_keeps_exact_text() -> None:
    values = ["NaN", "Infinity", "3.141592653589793238462643383279502884197169399375105820974944", None]
    assert convert(values, column("numeric")).to_pylist() == values


def test_numeric_nan_in_decimal_column_fails_naming_column() -> None:
    with pytest.raises(PgValueError, match=r"column 'c' \(numeric\).*'NaN'.*as text"):
        convert(["1.00", "NaN"], column("numeric", numeric_typmod(10, 2)))


def test_booleans() -> None:
    assert convert(["t", "f", None], column("bool")).to_pylist() == [True, False, None]
    with pytest.raises(PgValueError, match="'yes'"):
        convert(["t", "yes"], column("bool"))


def test_bytea_hex_decoded() -> None:
    assert convert(["\\x", "\\x00ff5c22", None], column("bytea")).to_pylist() == [b"", b'\x00\xff\\"', None]


def test_dates_in_range_and_refused_outside() -> None:
    assert convert(["2024-02-29", "0001-01-01", "9999-12-31", None], column("date")).to_pylist() == [
        dt.date(2024, 2, 29),
        dt.date(1, 1, 1),
        dt.date(9999, 12, 31),
        None,
    ]
    for refused in ("infinity", "-infinity", "0044-03-15 BC", "10000-01-01"):
        with pytest.raises(PgValueError, match=rf"column 'c' \(date\) holds '{refused}'"):
            convert(["2024-01-01", refused], column("date"))


def micros(values: pa.Array) -> list[int | None]:
    return values.cast(pa.int64()).to_pylist()


def test_timestamps_with_fractional_seconds() -> None:
    values = convert(
        ["2024-01-15 12:34:56.789", "2024-01-15 12:34:56", "1999-12-31 23:59:59.999999", None], column("timestamp")
    )
    assert values.to_pylist() == [
        dt.datetime(2024, 1, 15, 12, 34, 56, 789000),
        dt.datetime(2024, 1, 15, 12, 34, 56),
        dt.datetime(1999, 12, 31, 23, 59, 59, 999999),
        None,
    ]


def test_timestamptz_offsets_normalised_to_utc() -> None:
    values = convert(
        ["2024-01-15 12:34:56.5+00", "2024-01-15 12:34:56+05:30", "2024-01-15 12:34:56-08"], column("timestamptz")
    )
    utc = dt.timezone.utc
    assert values.to_pylist() == [
        dt.datetime(2024, 1, 15, 12, 34, 56, 500000, tzinfo=utc),
        dt.datetime(2024, 1, 15, 7, 4, 56, tzinfo=utc),
        dt.datetime(2024, 1, 15, 20, 34, 56, tzinfo=utc),
    ]


def test_timestamp_infinity_bc_and_far_future_are_exact() -> None:
    values = [
        "infinity",
        "2024-01-15 00:00:00.000001",
        "-infinity",
        "0044-03-15 12:00:00 BC",
        "0001-12-31 00:00:00 BC",
        "12345-06-07 08:09:10.5",
        None,
    ]
    # 44 BC is astronomical year -43; 1 BC is year 0 (a leap year); checked with PostgreSQL's
    # extract(epoch ...) for the same literals.
    expected = [
        TIMESTAMP_POSITIVE_INFINITY,
        1705276800000001,
        TIMESTAMP_NEGATIVE_INFINITY,
        -63517780800000000,
        -62135683200000000,
        327416976550500000,
        None,
    ]
    assert micros(convert(values, column("timestamp"))) == expected
    with_offsets = ["infinity", "0044-03-15 12:00:00+00 BC", "12345-06-07 08:09:10.5+02", "-infinity"]
    assert micros(convert(with_offsets, column("timestamptz"))) == [
        TIMESTAMP_POSITIVE_INFINITY,
        -63517780800000000,
        327416969350500000,
        TIMESTAMP_NEGATIVE_INFINITY,
    ]


def test_timestamp_beyond_int64_microseconds_refused() -> None:
    with pytest.raises(PgValueError, match="294276-12-31"):
        convert(["294276-12-31 23:59:59.999999"], column("timestamp"))


def test_time_interval_money_keep_text() -> None:
    for name, value in [
        ("time", "13:45:00.5"),
        ("timetz", "13:45:00+02"),
        ("interval", "1 year 2 mons -3 days"),
        ("money", "$1,234.56"),
    ]:
        assert convert([value, None], column(name)).to_pylist() == [value, None]


def test_array_literal_quoting_escapes_and_nulls() -> None:
    literal = r'{plain,"with,comma","with \"quote\"","back\\slash",NULL,"NULL","",NULL}'
    assert parse_array_literal(literal) == [
        "plain",
        "with,comma",
        'with "quote"',
        "back\\slash",
        None,
        "NULL",
        "",
        None,
    ]
    assert parse_array_literal("{}") == []
    assert parse_array_literal("{1,NULL,3}") == ["1", None, "3"]


def test_arrays_convert_elements_with_scalar_rules() -> None:
    ints = convert(["{1,NULL,-3}", "{}", None, "{42}"], column("int4", element="int4"))
    assert ints.to_pylist() == [[1, None, -3], [], None, [42]]
    texts = convert(['{"a,b","c\\"d",NULL}'], column("text", element="text"))
    assert texts.to_pylist() == [["a,b", 'c"d', None]]
    stamps = convert(['{"2024-01-01 00:00:00+00",infinity,NULL}'], column("timestamptz", element="timestamptz"))
    assert stamps.type == pa.list_(pa.timestamp("us", tz="UTC"))
    assert micros(stamps.flatten()) == [1704067200000000, TIMESTAMP_POSITIVE_INFINITY, None]
    blobs = convert(['{"\\\\x0102",NULL}'], column("bytea", element="bytea"))
    assert blobs.to_pylist() == [[b"\x01\x02", None]]
    # Every element array empty or NULL: the element conversion sees no value at all.
    bools = convert(["{}", None], column("bool", element="bool"))
    assert bools.to_pylist() == [[], None]


def test_multidimensional_arrays_refused() -> None:
    for value in ("{{1,2},{3,4}}", "[0:1]={1,2}"):
        with pytest.raises(PgValueError, match="multi-dimensional"):
            convert([value], column("int4", element="int4"))
    as_text = column("int4", element="int4", as_text=True)
    assert convert(["{{1,2},{3,4}}"], as_text).to_pylist() == ["{{1,2},{3,4}}"]


def test_large_string_and_binary_inputs_accepted() -> None:
    col = column("int4")
    assert to_arrow(pa.array(["7"], pa.large_string()), col).to_pylist() == [7]
    assert to_arrow(pa.array([b"8"], pa.binary()), col).to_pylist() == [8]


def test_arrow_schema_keeps_order_and_nullability() -> None:
    key = PgColumnType(column="id", type_oid=20, type_name="bigint", base_name="int8", nullable=False)
    name = PgColumnType(column="name", type_oid=25, type_name="text", base_name="text")
    assert arrow_schema([key, name]) == pa.schema(
        [pa.field("id", pa.int64(), nullable=False), pa.field("name", pa.string())]
    )


def test_session_settings_fix_the_text_forms() -> None:
    assert SESSION_SETTINGS == {
        "TimeZone": "UTC",
        "DateStyle": "ISO, MDY",
        "IntervalStyle": "postgres",
        "extra_float_digits": "3",
        "bytea_output": "hex",
    }


def test_catalog_query_resolves_domains_arrays_and_enums(pg: PgDatabase) -> None:
    """The catalog SQL against a real server, then the values it describes round-tripped."""
    pg.execute("CREATE DOMAIN price AS numeric(12,3)")
    pg.execute("CREATE DOMAIN cheap_price AS price CHECK (VALUE < 10)")
    pg.execute("CREATE TYPE mood AS ENUM ('sad', 'happy')")
    pg.execute("CREATE TABLE t (a cheap_price, b price[], c mood, d timestamptz[], e numeric(10,2), f text)")
    attributes = pg.execute(
        "SELECT attname, atttypid, atttypmod FROM pg_attribute WHERE attrelid = 't'::regclass AND attnum > 0 "
        "ORDER BY attnum"
    )
    rows = pg.execute(
        pg_type_catalog_query(), {"type_oids": [a[1] for a in attributes], "typmods": [a[2] for a in attributes]}
    )
    cols = {name: column_type_from_catalog(name, row) for (name, _, _), row in zip(attributes, rows)}
    assert [spark_ddl_type(cols[n]) for n in "abcdef"] == [
        "decimal(12,3)",
        "array<decimal(12,3)>",
        "string",
        "array<timestamp>",
        "decimal(10,2)",
        "string",
    ]
    assert cols["a"].type_name == "cheap_price" and cols["e"].type_name == "numeric(10,2)"
    assert cols["c"].kind == "e"

    with pg.connect() as conn:
        for setting, value in SESSION_SETTINGS.items():
            conn.execute(f"SET {setting} = '{value}'")
        conn.execute(
            "INSERT INTO t VALUES (9.5, '{1.25,NULL}', 'happy', '{\"2024-01-01 01:00:00+01\",infinity}', -3.10, 'x')"
        )
        text_row = conn.execute("SELECT a::text, b::text, c::text, d::text, e::text, f FROM t").fetchone()
    converted = {n: to_arrow(pa.array([value], pa.string()), cols[n]) for n, value in zip("abcdef", text_row)}
    assert converted["a"].to_pylist() == [Decimal("9.500")]
    assert converted["b"].to_pylist() == [[Decimal("1.250"), None]]
    assert converted["c"].to_pylist() == ["happy"]
    assert micros(converted["d"].flatten()) == [1704067200000000, TIMESTAMP_POSITIVE_INFINITY]
    assert converted["e"].to_pylist() == [Decimal("-3.10")]
    assert converted["f"].to_pylist() == ["x"]
