"""pgcdc's table layout: which bucket each row of a keyed table lives in, and how buckets are sized.

Sail reads every file of a MERGE's target (it skips files by partition values only, not by
min/max statistics), so a MERGE costs what the table costs unless the table is partitioned
and the MERGE names the partitions it touches (docs/contracts.md, "Table layout"). pgcdc
therefore partitions each keyed table by :data:`BUCKET_COLUMN`, a pure function of the row's
key, computed here in Python (numpy over Arrow buffers) both when a snapshot writes the table
and when a drain builds a MERGE batch, so the two can never disagree:

* **range** (a single integer key): ``bucket = floor(key / width)``. Neighbouring keys share a
  bucket, so the newest keys (a sequence's recent values, usually the hot ones) sit in one or
  two buckets and new keys open new buckets instead of growing old ones.
* **hash** (any other key): a stable 64-bit hash of the key's typed values, modulo ``count``
  (:func:`_typed_hashes`: integers, dates and timestamps by value, text and binary by their bytes,
  floats by their bits, numerics as integers where integral, arrays element by element; no
  library's text rendering is involved). Uniformly spread, so changes to random keys touch
  ``count`` buckets at most, but never a bucket more than their own. Layouts recorded before
  this hash (no ``hash`` entry in their record) keep the one they were written with
  (:data:`TEXT_CAST_HASH`), so their rows stay where they are.

A row's bucket depends on its values of the layout's key columns only, whatever the table's
replica identity is now; a row whose bucket cannot be computed (a layout column dropped, or of a
type the layout cannot bucket any more) is written with a NULL bucket, and every bucket predicate
includes the NULL partition (docs/contracts.md, "Table layout").

``width`` and ``count`` come from the table's size when it is snapshotted (PostgreSQL's
estimate, :func:`choose_layout`), aiming at :data:`DEFAULT_TARGET_ROWS` rows and
:data:`TARGET_BYTES` bytes per bucket; a table's entry in the configuration overrides them.
Tables without a key (keyless, REPLICA IDENTITY FULL without a primary key) are not bucketed.
The chosen layout is recorded in the snapshot marker (``resources/delta/markers.py``), so a
drain reads it rather than guessing; a table without one (written by an earlier pgcdc, or
snapshotted unbucketed) is merged unbucketed, as before.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from resources.config import BucketOverride, DEFAULT_TARGET_ROWS

BUCKET_COLUMN = "_pgcdc_bucket"
"""The partition column of a bucketed table (BIGINT): a function of the row's key only."""

TARGET_BYTES = 128 * 1024 * 1024
"""Heap bytes per bucket :func:`choose_layout` aims at: wide rows get fewer rows per bucket."""

PAGE_BYTES = 8192
UNANALYZED_ROWS_PER_PAGE = 80
"""Rows per heap page assumed for a table PostgreSQL has not counted yet (pg_class.reltuples = -1)."""

RANGE, HASH = "range", "hash"


TEXT_CAST_HASH, TYPED_HASH = 1, 2
"""The hash functions of hash layouts. :data:`TEXT_CAST_HASH`: integers by value, anything else by
pyarrow's cast to text (what layouts recorded without a ``hash`` entry were written with; it cannot
hash arrays). :data:`TYPED_HASH`: :func:`_typed_hashes`, independent of any text rendering; every
new hash layout uses it. Both hash integers and text alike."""


@dataclass(frozen=True, slots=True)
class TableLayout:
    """How a table is bucketed: by ``key`` (column names, in hashing order), ``kind`` range or hash,
    with ``size`` the range width (keys per bucket) or the hash bucket count; ``hash`` names the
    hash function of a hash layout (:data:`TYPED_HASH` for every new one)."""

    kind: str
    key: tuple[str, ...]
    size: int
    hash: int = TYPED_HASH

    def to_json(self) -> dict[str, Any]:
        record = {"bucket_column": BUCKET_COLUMN, "kind": self.kind, "key": list(self.key), "size": self.size}
        return record | {"hash": self.hash} if self.kind == HASH else record

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> TableLayout:
        kind, key, size = value["kind"], tuple(value["key"]), int(value["size"])
        hash_function = int(value.get("hash", TEXT_CAST_HASH))
        if (
            value.get("bucket_column") != BUCKET_COLUMN
            or kind not in (RANGE, HASH)
            or size < 1
            or not key
            or hash_function not in (TEXT_CAST_HASH, TYPED_HASH)
        ):
            raise ValueError(f"not a pgcdc table layout this version knows: {json.dumps(dict(value))}")
        if kind == RANGE and len(key) != 1:
            raise ValueError(f"a range layout has one key column, not {list(key)}")
        return cls(kind, key, size, hash_function if kind == HASH else TYPED_HASH)

    def can_bucket(self, key_types: Sequence[pa.DataType]) -> bool:
        """Whether rows whose layout key columns have ``key_types`` (in ``key`` order) get a bucket:
        a range layout needs an integer, a hash layout a type its hash function takes."""
        if self.kind == RANGE:
            return is_range_key(key_types)
        hashable = _typed_hashable if self.hash == TYPED_HASH else _text_cast_hashable
        return all(hashable(kind) for kind in key_types)

    def describe(self) -> str:
        if self.kind == RANGE:
            return f"range buckets of {self.size:,} keys of {self.key[0]}"
        return f"{self.size} hash bucket(s) of ({', '.join(self.key)})"


@dataclass(frozen=True, slots=True)
class TableSize:
    """PostgreSQL's estimate of a table (summed over its leaf partitions) and, for a single integer
    key, that key's smallest and largest value (None for an empty table or another key)."""

    rows: float
    pages: int
    key_range: tuple[int, int] | None = None

    def estimated_rows(self) -> float:
        return self.rows if self.rows > 0 or self.pages == 0 else self.pages * UNANALYZED_ROWS_PER_PAGE


class LayoutError(ValueError):
    """A configured layout that does not fit the table (a range width for a key that is not one integer column)."""


def is_range_key(key_types: Sequence[pa.DataType]) -> bool:
    return len(key_types) == 1 and pa.types.is_integer(key_types[0])


def choose_layout(
    key: Sequence[str],
    key_types: Sequence[pa.DataType],
    size: TableSize,
    override: BucketOverride | None = None,
    target_rows: int = DEFAULT_TARGET_ROWS,
) -> TableLayout | None:
    """The layout of a table with replica identity ``key`` (empty: none usable) of ``size``.

    Range buckets for a single integer key, ``width`` keys wide so that a bucket holds about
    ``target_rows`` rows (fewer for wide rows, see :data:`TARGET_BYTES`) at the key density
    the table has now; hash buckets otherwise, as many as the table needs at that target. An
    ``override`` wins; an override with neither width nor count leaves the table unbucketed.
    """
    if not key:
        return None
    if not all(_typed_hashable(kind) for kind in key_types):
        return None  # not reached for any type pgcdc maps (docs/type-mapping.md); kept unbucketed, never wrong
    if override is not None:
        if override.width is not None:
            if not is_range_key(key_types):
                raise LayoutError(f"a bucket width needs a single integer key, and the key is ({', '.join(key)})")
            return TableLayout(RANGE, tuple(key), override.width)
        if override.count is not None:
            return TableLayout(HASH, tuple(key), override.count)
        return None
    rows = size.estimated_rows()
    per_bucket = max(1, target_rows)
    if rows > 0 and size.pages > 0:
        row_bytes = size.pages * PAGE_BYTES / rows
        per_bucket = max(1, min(per_bucket, int(TARGET_BYTES / max(1.0, row_bytes))))
    if is_range_key(key_types):
        if size.key_range is None or rows <= 0:
            return TableLayout(RANGE, tuple(key), per_bucket)
        low, high = size.key_range
        density = rows / max(1, high - low + 1)  # rows per key value
        return TableLayout(RANGE, tuple(key), max(1, math.ceil(per_bucket / max(density, 1e-12))))
    return TableLayout(HASH, tuple(key), max(1, math.ceil(rows / per_bucket)))


def bucket_values(layout: TableLayout, keys: Sequence[pa.Array | pa.ChunkedArray]) -> pa.Array:
    """Each row's bucket (int64) from its key columns (``keys``, in ``layout.key`` order); null
    where a key value is null (a change's absent old key)."""
    arrays = [key.combine_chunks() if isinstance(key, pa.ChunkedArray) else key for key in keys]
    length = len(arrays[0]) if arrays else 0
    valid = np.ones(length, dtype=bool)
    for array in arrays:
        if array.null_count:
            valid &= ~np.asarray(array.is_null(), dtype=bool)
    if layout.kind == RANGE:
        values = np.asarray(arrays[0].fill_null(0).cast(pa.int64()), dtype=np.int64)
        buckets = np.floor_divide(values, layout.size)
    else:
        value_hashes = _typed_hashes if layout.hash == TYPED_HASH else _text_cast_hashes
        hashes = np.zeros(length, dtype=np.uint64)
        with np.errstate(over="ignore"):
            for array in arrays:
                hashes = _mix(hashes * np.uint64(0x100000001B3) + value_hashes(array))
        buckets = (hashes % np.uint64(layout.size)).astype(np.int64)
    return pa.array(buckets, pa.int64(), mask=~valid if not valid.all() else None)


def row_buckets(layout: TableLayout, columns: Mapping[str, pa.Array | pa.ChunkedArray], length: int) -> pa.Array:
    """Each row's bucket from its values (``columns`` by name): :func:`bucket_values` where the
    layout's key columns are all there and of a type it buckets, else NULL for every row (a layout
    column dropped or retyped since the snapshot). Such rows live in the NULL partition, which every
    bucket predicate includes, so a row is always found where it is."""
    keys = [columns.get(name) for name in layout.key]
    if any(key is None for key in keys) or not layout.can_bucket([key.type for key in keys]):  # type: ignore[union-attr]
        return pa.nulls(length, pa.int64())
    return bucket_values(layout, keys)


def _integer_hashes(values: np.ndarray) -> np.ndarray:
    return _mix(values.astype(np.int64).astype(np.uint64) ^ np.uint64(0x2545F4914F6CDD1D))


def _text_cast_hashes(array: pa.Array) -> np.ndarray:
    """:data:`TEXT_CAST_HASH`: integers by value, anything else by pyarrow's cast to text (binary values: their bytes)."""
    if pa.types.is_integer(array.type):
        return _integer_hashes(np.asarray(array.fill_null(0).cast(pa.int64()), dtype=np.int64))
    return _text_hashes(array)


def _text_cast_hashable(kind: pa.DataType) -> bool:
    return not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_struct(kind))


_FLOAT_TAG = np.uint64(0x3C6EF372FE94F82B)
_DECIMAL_TEXT_TAG = np.uint64(0xA54FF53A5F1D36F1)
_NULL_ELEMENT = np.uint64(0x510E527FADE682D1)


def _typed_hashable(kind: pa.DataType) -> bool:
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _typed_hashable(kind.value_type)
    return (
        pa.types.is_integer(kind)
        or pa.types.is_boolean(kind)
        or pa.types.is_floating(kind)
        or pa.types.is_decimal(kind)
        or pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_fixed_size_binary(kind)
        or pa.types.is_date32(kind)
        or pa.types.is_timestamp(kind)
    )


def _typed_hashes(array: pa.Array) -> np.ndarray:
    """:data:`TYPED_HASH`: a stable 64-bit hash of each typed value, defined by the value alone
    (never by a library's text rendering), and equal across the widenings Delta follows:

    * integers, booleans (0/1), dates (days) and timestamps (microseconds, with or without zone) by value;
    * numerics: integral values within int64 as that integer (so ``numeric(p,0)`` hashes like an
      integer column), others by their normalized decimal text (``1.50`` and ``1.5`` alike);
    * floats by the bits of their float64 value (``-0.0`` as ``0.0``, every NaN alike);
    * text by its UTF-8 bytes, binary by its bytes;
    * arrays by their elements' hashes in order (NULL elements by a fixed value) and their length.

    NULL values hash to anything: :func:`bucket_values` masks them.
    """
    kind = array.type
    if pa.types.is_integer(kind) or pa.types.is_boolean(kind):
        return _integer_hashes(np.asarray(array.cast(pa.int64()).fill_null(0), dtype=np.int64))
    if pa.types.is_date32(kind):
        return _integer_hashes(np.asarray(array.cast(pa.int32()).cast(pa.int64()).fill_null(0), dtype=np.int64))
    if pa.types.is_timestamp(kind):
        micros = array.cast(pa.timestamp("us", kind.tz)).cast(pa.int64()).fill_null(0)
        return _integer_hashes(np.asarray(micros, dtype=np.int64))
    if pa.types.is_floating(kind):
        values = np.asarray(array.cast(pa.float64()).fill_null(0.0), dtype=np.float64).copy()
        values[values == 0.0] = 0.0
        values[np.isnan(values)] = np.nan
        return _mix(values.view(np.uint64) ^ _FLOAT_TAG)
    if pa.types.is_decimal(kind):
        return _decimal_hashes(array)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _list_hashes(array)
    return _text_hashes(array)


def _decimal_hashes(array: pa.Array) -> np.ndarray:
    """Integral values within int64 as that integer (vectorized), others by their normalized text
    (per value, only for those: a fractional or huge numeric key)."""
    whole = pc.floor(array)
    integral = np.asarray(pc.fill_null(pc.equal(array, whole), True), dtype=bool)
    try:
        as_integer = np.asarray(pc.cast(pc.if_else(integral, whole, 0), pa.int64()).fill_null(0), dtype=np.int64)
    except pa.ArrowInvalid:  # an integral value beyond int64: those go by their text too
        as_integer = np.zeros(len(array), dtype=np.int64)
        for i, value in enumerate(whole.to_pylist()):
            if value is not None and integral[i] and -(2**63) <= value < 2**63:
                as_integer[i] = int(value)
            else:
                integral[i] = False
    texts = [""] * len(array)
    for i in np.flatnonzero(~integral).tolist():
        value = array[i].as_py()
        texts[i] = "" if value is None else format(value.normalize(), "f")
    text_hashes = _text_hashes(pa.array(texts, pa.string())) ^ _DECIMAL_TEXT_TAG
    return np.where(integral, _integer_hashes(as_integer), text_hashes)


def _list_hashes(array: pa.Array) -> np.ndarray:
    """A polynomial over the element hashes of each list (prefix sums, as :func:`_text_hashes`)."""
    lists = array.cast(pa.large_list(array.type.value_type))
    offsets = np.asarray(lists.offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    if lists.null_count:
        lengths = np.where(np.asarray(lists.is_null(), dtype=bool), 0, lengths)
    elements = lists.values.slice(offsets[0], offsets[-1] - offsets[0])
    element_hashes = _typed_hashes(elements)
    if elements.null_count:
        element_hashes = np.where(np.asarray(elements.is_null(), dtype=bool), _NULL_ELEMENT, element_hashes)
    return _mix(
        _polynomial_sums(element_hashes, offsets[:-1] - offsets[0], lengths)
        ^ (lengths.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    )


def _text_hashes(array: pa.Array) -> np.ndarray:
    """A stable 64-bit hash of each value's text form (binary values: their bytes).

    A polynomial over the bytes, computed with prefix sums (numpy wraps uint64 arithmetic
    modulo 2**64), so it costs a few vector passes whatever the row count.
    """
    if (
        pa.types.is_binary(array.type)
        or pa.types.is_large_binary(array.type)
        or pa.types.is_fixed_size_binary(array.type)
    ):
        text = array.cast(pa.large_binary())
    else:
        text = pc.cast(array, pa.large_string()).cast(pa.large_binary())
    text = text.fill_null(b"")
    text = pa.concat_arrays([text]) if text.offset else text  # buffers from the array's first value
    offsets = np.frombuffer(text.buffers()[1], dtype=np.int64)[: len(text) + 1]
    data = text.buffers()[2]
    raw = np.frombuffer(data, dtype=np.uint8)[offsets[0] : offsets[-1]] if data is not None else np.zeros(0, np.uint8)
    lengths = np.diff(offsets)
    with np.errstate(over="ignore"):
        per_value = _polynomial_sums(raw.astype(np.uint64) + np.uint64(1), offsets[:-1] - offsets[0], lengths)
        return _mix(per_value ^ (lengths.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)))


def _polynomial_sums(items: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """For each run ``items[start : start + length]``: the sum of ``item * P**(position + 1)``
    modulo 2**64 (P = 0x100000001B3), from one prefix sum over all items."""
    with np.errstate(over="ignore"):
        longest = int(lengths.max()) if len(lengths) else 0
        powers = np.cumprod(np.full(longest + 1, 0x100000001B3, dtype=np.uint64))
        position = np.arange(len(items), dtype=np.int64) - np.repeat(starts, lengths)
        terms = items * powers[position] if len(items) else np.zeros(0, np.uint64)
        sums = np.concatenate([np.zeros(1, np.uint64), np.cumsum(terms, dtype=np.uint64)])
        return sums[starts + lengths] - sums[starts]


def _mix(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: spreads every input bit over the output."""
    with np.errstate(over="ignore"):
        values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return values ^ (values >> np.uint64(31))


def with_buckets(layout: TableLayout, batch: pa.RecordBatch | pa.Table) -> pa.RecordBatch | pa.Table:
    """``batch`` with :data:`BUCKET_COLUMN` appended, computed from its key columns (:func:`row_buckets`)."""
    columns = {name: batch.column(name) for name in layout.key if name in batch.schema.names}
    return batch.append_column(pa.field(BUCKET_COLUMN, pa.int64()), row_buckets(layout, columns, batch.num_rows))
