"""The bucket function and the bucket sizing (resources/delta/layout.py), pure Python.

Bucket values are stored in Delta and recomputed by every later drain, possibly by a newer
pgcdc: the pinned values below make a change to the function a failing test, not a silent
re-bucketing that would let a MERGE miss rows written under the old function.
"""

from __future__ import annotations

import pyarrow as pa
import pytest

from resources.delta.layout import (
    bucket_values, BucketOverride, choose_layout, HASH, LayoutError, RANGE, TableLayout, TableSize,
)


def test_bucket_values_are_pinned() -> None:
    composite = TableLayout(HASH, ("a", "b"), 1000)
    keys = [pa.array(["x", "", "héllo"]), pa.array([1, -2, 3**30], pa.int64())]
    assert bucket_values(composite, keys).to_pylist() == [293, 320, 701]
    assert bucket_values(TableLayout(HASH, ("a",), 1000), [pa.array([b"\x00\xff", b""], pa.binary())]).to_pylist() == [332, 0]
    ranges = TableLayout(RANGE, ("id",), 10)
    assert bucket_values(ranges, [pa.array([-11, -1, 0, 9, 10, 25], pa.int32())]).to_pylist() == [-2, -1, 0, 0, 1, 2]


def test_bucket_values_do_not_depend_on_slicing_width_or_nulls() -> None:
    layout = TableLayout(HASH, ("k",), 7)
    text = pa.array(["a", "bb", None, "dddd", "e"])
    assert bucket_values(layout, [text.slice(1)]).to_pylist() == bucket_values(layout, [text]).to_pylist()[1:]
    assert bucket_values(layout, [text]).to_pylist()[2] is None
    # int4 widened to int8 in Delta: same buckets
    assert bucket_values(layout, [pa.array([5, -7], pa.int32())]) == bucket_values(layout, [pa.array([5, -7], pa.int64())])


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
