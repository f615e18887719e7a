"""The bucket function and the bucket sizing (resources/delta/layout.py), pure Python.

Bucket values are stored in Delta and recomputed by every later drain, possibly by a newer
pgcdc: the pinned values below make a change to the function a failing test, not a silent
re-bucketing that would let a MERGE miss rows written under the old function.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pyarrow as pa
import pytest

from resources.delta.layout import (
    bucket_values,
    BucketOverride,
    choose_layout,
    HASH,
    LayoutError,
    RANGE,
    row_buckets,
    TableLayout,
    TableSize,
    TEXT_CAST_HASH,
    TYPED_HASH,
)

#: A bucket count of 2**62 shows (almost) the whole 64-bit hash, so a pinned value below pins the hash.
WIDE = TableLayout(HASH, ("k",), 1 << 62)

#: One array per Arrow type a key column can map to (docs/type-mapping.md), with the hash of each value.
PINNED_HASHES: dict[str, tuple[pa.Array, list[int | None]]] = {
    "int2": (pa.array([1, -1, 0], pa.int16()), [2770960580306348394, 3323409836838439917, 563888032053572990]),
    "bool": (pa.array([True, False, None]), [2770960580306348394, 563888032053572990, None]),
    "float8": (pa.array([1.5, -0.0, float("nan")]), [3755652956343903825, 4316602814459793740, 65842886521940996]),
    "numeric(10,3)": (
        pa.array([Decimal("12.50"), Decimal("7.00"), Decimal("-0.001")], pa.decimal128(10, 3)),
        [1749718557397900421, 3814280522175847482, 3119792864049157524],
    ),
    "text": (pa.array(["a", "ü", ""]), [3401661538641115406, 1606376167466908901, 0]),
    "bytea": (pa.array([b"\x00\xff", b"", b"a"]), [3994892993917608428, 0, 3401661538641115406]),
    "date": (
        pa.array([dt.date(2024, 2, 29), dt.date(1, 1, 1), dt.date(9999, 12, 31)]),
        [3893224813947743261, 854712364791941966, 2531433425427162217],
    ),
    "timestamp": (pa.array([dt.datetime(2024, 2, 29, 12, 0, 0, 5)], pa.timestamp("us")), [3434959477481468527]),
    "int4[]": (
        pa.array([[1, 2], [], None, [None, 3]], pa.list_(pa.int32())),
        [3885826527689141256, 0, None, 342070044650985715],
    ),
    "text[]": (pa.array([["a", "b"], ["ab"]], pa.list_(pa.string())), [4054653020707897291, 779332380866558157]),
}


@pytest.mark.parametrize("type_name", PINNED_HASHES)
def test_the_typed_hash_is_pinned_for_every_key_type(type_name: str) -> None:
    values, hashes = PINNED_HASHES[type_name]
    assert bucket_values(WIDE, [values]).to_pylist() == hashes


def test_the_typed_hash_follows_the_value_not_its_type() -> None:
    """Equal values in the types Delta widens between, or that PostgreSQL stores alike, hash alike."""

    def hashes(array: pa.Array) -> list[int | None]:
        return bucket_values(WIDE, [array]).to_pylist()

    assert hashes(pa.array([1.5, 0.0], pa.float32())) == hashes(pa.array([1.5, -0.0], pa.float64()))
    assert hashes(pa.array([Decimal("12"), Decimal("-3")], pa.decimal128(20, 0))) == hashes(
        pa.array([12, -3], pa.int64())
    )
    assert hashes(pa.array([Decimal("1.50")], pa.decimal128(6, 2))) == hashes(
        pa.array([Decimal("1.5000")], pa.decimal128(12, 4))
    )
    huge = pa.array(
        [Decimal("99999999999999999999"), Decimal("5")], pa.decimal128(21, 1)
    )  # beyond int64, then integral
    assert hashes(huge)[1:] == hashes(pa.array([5], pa.int64())) and hashes(huge)[0] == 647731516526726446
    moment = dt.datetime(2024, 2, 29, 12, 0, 0, 5)
    assert hashes(pa.array([moment], pa.timestamp("us", "UTC"))) == hashes(pa.array([moment], pa.timestamp("us")))
    assert hashes(pa.array([[1, 2]], pa.list_(pa.int64()))) == hashes(pa.array([[1, 2]], pa.list_(pa.int16())))
    assert hashes(pa.array([[1, 2]], pa.list_(pa.int64()))) != hashes(pa.array([[2, 1]], pa.list_(pa.int64())))
    lists = pa.array([[1], [2, 3], [4, None]], pa.list_(pa.int32()))
    assert hashes(lists.slice(1)) == hashes(lists)[1:]


def test_layouts_recorded_before_the_typed_hash_keep_theirs() -> None:
    """A record without a ``hash`` entry was written with the text-cast hash, which differs from
    the typed one only for types other than integers, text and binary."""
    old = TableLayout.from_json({"bucket_column": "_pgcdc_bucket", "kind": "hash", "key": ["k"], "size": 1 << 62})
    assert old.hash == TEXT_CAST_HASH and old.to_json()["hash"] == TEXT_CAST_HASH
    assert bucket_values(old, [pa.array(["a", "ü"])]) == bucket_values(WIDE, [pa.array(["a", "ü"])])
    assert bucket_values(old, [pa.array([True])]) != bucket_values(WIDE, [pa.array([True])])
    assert not old.can_bucket([pa.list_(pa.int32())]) and WIDE.can_bucket([pa.list_(pa.int32())])
    assert TableLayout.from_json(WIDE.to_json()) == WIDE and WIDE.hash == TYPED_HASH


def test_rows_whose_layout_columns_are_gone_or_retyped_get_no_bucket() -> None:
    ranges = TableLayout(RANGE, ("id",), 10)
    assert row_buckets(ranges, {"id": pa.array([15, 3], pa.int64())}, 2).to_pylist() == [1, 0]
    assert row_buckets(ranges, {"other": pa.array([15, 3])}, 2).to_pylist() == [None, None]
    assert row_buckets(ranges, {"id": pa.array(["15", "3"])}, 2).to_pylist() == [None, None]


def test_bucket_values_are_pinned() -> None:
    composite = TableLayout(HASH, ("a", "b"), 1000)
    keys = [pa.array(["x", "", "héllo"]), pa.array([1, -2, 3**30], pa.int64())]
    assert bucket_values(composite, keys).to_pylist() == [293, 320, 701]
    assert bucket_values(TableLayout(HASH, ("a",), 1000), [pa.array([b"\x00\xff", b""], pa.binary())]).to_pylist() == [
        332,
        0,
    ]
    ranges = TableLayout(RANGE, ("id",), 10)
    assert bucket_values(ranges, [pa.array([-11, -1, 0, 9, 10, 25], pa.int32())]).to_pylist() == [-2, -1, 0, 0, 1, 2]


def test_bucket_values_do_not_depend_on_slicing_width_or_nulls() -> None:
    layout = TableLayout(HASH, ("k",), 7)
    text = pa.array(["a", "bb", None, "dddd", "e"])
    assert bucket_values(layout, [text.slice(1)]).to_pylist() == bucket_values(layout, [text]).to_pylist()[1:]
    assert bucket_values(layout, [text]).to_pylist()[2] is None
    # int4 widened to int8 in Delta: same buckets
    assert bucket_values(layout, [pa.array([5, -7], pa.int32())]) == bucket_values(
        layout, [pa.array([5, -7], pa.int64())]
    )


def test_range_width_follows_the_key_density() -> None:
    dense = choose_layout(["id"], [pa.int64()], TableSize(10_000_000, 100_000, (1, 10_000_000)), target_rows=1_000_000)
    assert dense == TableLayout(RANGE, ("id",), 1_000_000)
    sparse = choose_layout(["id"], [pa.int64()], TableSize(1_000_000, 10_000, (0, 99_999_999)), target_rows=1_000_000)
    assert sparse == TableLayout(RANGE, ("id",), 100_000_000)
    # 2 KB rows: 128 MB of heap is 65,536 rows, fewer than the row target
    wide = choose_layout(["id"], [pa.int64()], TableSize(1_000_000, 250_000, (1, 1_000_000)))
    assert wide is not None and wide.size == 65_536


def test_hash_count_follows_the_row_count_and_an_empty_or_keyless_table() -> None:
    assert choose_layout(["code"], [pa.string()], TableSize(2_500_000, 25_000)) == TableLayout(HASH, ("code",), 3)
    assert choose_layout(["a", "b"], [pa.int32(), pa.int32()], TableSize(0, 0)) == TableLayout(HASH, ("a", "b"), 1)
    assert choose_layout(["id"], [pa.int32()], TableSize(-1, 0)) == TableLayout(RANGE, ("id",), 1_000_000)
    assert choose_layout([], [], TableSize(5_000_000, 50_000)) is None


def test_overrides_win_and_a_width_needs_one_integer_key() -> None:
    size = TableSize(10_000_000, 100_000, (1, 10_000_000))
    assert choose_layout(["id"], [pa.int64()], size, BucketOverride(width=500)) == TableLayout(RANGE, ("id",), 500)
    assert choose_layout(["id"], [pa.int64()], size, BucketOverride(count=4)) == TableLayout(HASH, ("id",), 4)
    assert choose_layout(["id"], [pa.int64()], size, BucketOverride()) is None
    with pytest.raises(LayoutError, match="single integer key"):
        choose_layout(["code"], [pa.string()], size, BucketOverride(width=10))


def test_layout_round_trips_through_the_marker_json_and_refuses_unknown_ones() -> None:
    layout = TableLayout(HASH, ("a", "b"), 12)
    assert TableLayout.from_json(layout.to_json()) == layout
    with pytest.raises(ValueError, match="not a pgcdc table layout"):
        TableLayout.from_json({**layout.to_json(), "kind": "zorder"})
