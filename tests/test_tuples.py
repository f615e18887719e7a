"""The column-wise TupleData parser (pgoutput/tuples.py) against the decoder's per-row parser, without a server.

The drain never decodes row changes one by one: ``tuple_columns`` parses all row images of
a table's batch column by column. It must give exactly what the decoder's ``_tuple`` gives
for the same bytes, for every column kind and around the 12-byte inline limit of Arrow's
binary_view.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

from resources.errors import PgcdcError, ProtocolError
from resources.pgoutput import tuples
from resources.pgoutput.decoder import _tuple
from resources.pgoutput.messages import UNCHANGED_TOAST
from resources.pgoutput.tuples import take_rows, tuple_columns, tuple_end
from tests.support.pgoutput_messages import insert, tuple_data, UNCHANGED

HEAD = 6  # 'I', Int32 relation oid, 'N': where the TupleData of an Insert starts


def parse(rows: list[tuple]) -> tuple[list[list], list[list[bool]]]:
    payloads = [insert(16384, *row) for row in rows]
    columns, masks = tuple_columns(payloads, [HEAD] * len(payloads), len(rows[0]))
    return [column.to_pylist() for column in columns], [mask.tolist() for mask in masks]


def decoded(rows: list[tuple]) -> tuple[list[list], list[list[bool]]]:
    """What the decoder makes of the same bytes, laid out like tuple_columns' answer."""
    images = [_tuple(insert(16384, *row), HEAD)[0].values for row in rows]
    ncols = len(rows[0])
    values = [[None if image[c] is UNCHANGED_TOAST else image[c] for image in images] for c in range(ncols)]
    masks = [[image[c] is UNCHANGED_TOAST for image in images] for c in range(ncols)]
    return values, masks


def test_every_kind_and_the_inline_boundary() -> None:
    rows = [
        (b"", None, UNCHANGED, b"x" * 12, b"y" * 13, "é€😀".encode()),
        (b"1", b"two", None, UNCHANGED, b"z" * 100, b""),
    ]
    assert parse(rows) == decoded(rows)
    assert parse(rows)[0][3] == [b"x" * 12, None]
    assert parse(rows)[1][2] == [True, False]


def test_absent_row_image_is_all_null() -> None:
    payload = insert(16384, b"1", b"2")
    columns, masks = tuple_columns([payload, payload], [HEAD, -1], 2)
    assert [column.to_pylist() for column in columns] == [[b"1", None], [b"2", None]]
    assert [mask.tolist() for mask in masks] == [[False, False], [False, False]]


def test_small_slices_give_the_same_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [(str(i).encode() * (i % 20), None if i % 3 else UNCHANGED) for i in range(50)]
    whole = parse(rows)
    monkeypatch.setattr(tuples, "SLICE_BYTES", 64)
    assert parse(rows) == whole


def test_a_row_with_the_wrong_column_count_is_refused() -> None:
    payloads = [insert(16384, b"1", b"2"), insert(16384, b"1")]
    with pytest.raises(PgcdcError, match="has 1 columns where its Relation message has 2"):
        tuple_columns(payloads, [HEAD, HEAD], 2)


def test_a_value_running_past_its_message_is_refused() -> None:
    payload = insert(16384, b"abcdef")[:-2]
    with pytest.raises(PgcdcError, match="runs past the end of its message"):
        tuple_columns([payload], [HEAD], 1)


def test_tuple_end_matches_the_decoder_and_refuses_unknown_kinds() -> None:
    payload = insert(16384, b"a", None, UNCHANGED, b"bcd") + b"trailing"
    assert tuple_end(payload, HEAD) == _tuple(payload, HEAD)[1] == len(payload) - len(b"trailing")
    with pytest.raises(ProtocolError, match="unknown TupleData column kind"):
        tuple_end(b"\x00\x01x", 0)


VALUES = st.one_of(st.none(), st.just(UNCHANGED), st.binary(max_size=40))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6).flatmap(lambda ncols: st.lists(st.tuples(*[VALUES] * ncols), min_size=1, max_size=30)))
def test_random_rows_round_trip(rows: list[tuple]) -> None:
    assert parse(rows) == decoded(rows)
    assert all(tuple_end(tuple_data(*row), 0) == len(tuple_data(*row)) for row in rows)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 4).flatmap(lambda ncols: st.lists(st.tuples(*[VALUES] * ncols), min_size=0, max_size=12)),
    st.lists(st.integers(-1, 11), max_size=20),
)
def test_taken_rows_equal_the_rows_parsed_where_they_are(rows: list[tuple], picks: list[int]) -> None:
    """take_rows of parsed columns equals parsing the picked images themselves (-1: absent, all NULL)."""
    ncols = len(rows[0]) if rows else 2
    picks = [pick if pick < len(rows) else -1 for pick in picks]
    payloads = [insert(16384, *row) for row in rows]
    parsed = tuple_columns(payloads, [HEAD] * len(payloads), ncols)
    absent = insert(16384, *[None] * ncols)  # a payload whose image is not read
    columns, masks = tuple_columns(
        [payloads[p] if p >= 0 else absent for p in picks], [HEAD if p >= 0 else -1 for p in picks], ncols
    )
    taken, taken_masks = take_rows(*parsed, np.array(picks, np.int64))
    assert [column.to_pylist() for column in taken] == [column.to_pylist() for column in columns]
    assert [mask.tolist() for mask in taken_masks] == [mask.tolist() for mask in masks]


def test_views_of_short_values_are_arrows_own_and_a_value_may_end_the_buffer() -> None:
    """Every length around the inline limit, each value last in its buffer (nothing after it to read):
    a short value's view is byte for byte the one Arrow builds (zeros past the value), a long one's
    prefix is its first four bytes."""
    for size in range(20):
        value = bytes(range(1, size + 1))
        payload = insert(16384, b"k", value)
        columns, _ = tuple_columns([payload], [HEAD], 2)
        assert columns[1].to_pylist() == [value]
        views = np.frombuffer(columns[1].buffers()[1], np.uint8)[:16]
        expected = np.frombuffer(pa.array([value], pa.binary_view()).buffers()[1], np.uint8)[:16]
        if size <= 12:
            assert views.tolist() == expected.tolist()
        else:
            assert views[:8].tolist() == expected[:8].tolist()
