"""Row changes located column-wise: a transaction's run of I/U/D payloads (RowBatch) and the per-table rows gathered from them for one write."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeAlias

import numpy as np
import pyarrow as pa

from resources.errors import ProtocolError
from resources.pgoutput.tags import DELETE, INSERT, KEY, NEW, OLD, UPDATE
from resources.pgoutput.tuples import SLICE_BYTES, take_rows, tuple_columns_at, tuple_end


class RowBatch:
    """A run of row changes of one transaction, located column-wise (no Python object per change).

    ``data`` holds the messages' payloads back to back (plus zero padding); ``base[i]`` is where
    message ``i`` starts in it. ``ops`` holds the tag bytes (``I``/``U``/``D``), ``oids`` the
    relations, ``new`` / ``old`` the absolute offsets in ``data`` of the new and old TupleData
    (-1: absent), ``sizes`` the payload lengths.
    """

    __slots__ = ("data", "base", "sizes", "ops", "oids", "new", "old")

    def __init__(self, payloads: list[bytes], streamed: bool, dropped: set[int] | frozenset[int] = frozenset()) -> None:
        n = len(payloads)
        offset = 5 if streamed else 1
        payloads.append(_PADDING)
        try:
            data = b"".join(payloads)
        finally:
            payloads.pop()
        buf = np.frombuffer(data, np.uint8)
        sizes = np.fromiter(map(len, payloads), np.int64, n)
        base = np.zeros(n, np.int64)
        np.cumsum(sizes[:-1], out=base[1:])
        if n and int(sizes.min()) < offset + 7:
            raise ProtocolError("a row change message is truncated", "restart replication")
        if dropped and n:
            xids = _be32(buf, base + 1)
            keep = ~np.isin(xids, np.fromiter(dropped, np.int64, len(dropped)))
            if not keep.all():
                payloads = [payloads[i] for i in np.flatnonzero(keep)]
                self.__init__(payloads, streamed)  # type: ignore[misc]
                return
        ops = buf[base]
        oids = _be32(buf, base + offset)
        at = base + offset + 4
        kind = buf[at]
        is_insert, is_update = ops == INSERT, ops == UPDATE
        is_delete = ops == DELETE
        with_old = (kind == KEY) | (kind == OLD)
        plain = kind == NEW
        valid = (is_insert & plain) | (is_update & (plain | with_old)) | (is_delete & with_old)
        if not valid.all():
            i = int(np.flatnonzero(~valid)[0])
            raise ProtocolError(
                f"unexpected row change layout ({chr(ops[i])!r} with tuple kind {chr(kind[i])!r})",
                "restart replication",
            )
        new = np.where(plain, at + 1, -1)
        old = np.where(with_old, at + 1, -1)
        moved = np.flatnonzero(is_update & with_old)
        if len(moved):
            ends = np.empty(len(moved), np.int64)
            for j, i in enumerate(moved.tolist()):
                ends[j] = tuple_end(data, int(old[i]))
            if (buf[ends] != NEW).any():
                raise ProtocolError("an update's new tuple is missing", "restart replication")
            new[moved] = ends + 1
        self.data = data
        self.base = base
        self.sizes = sizes
        self.ops = ops
        self.oids = oids
        self.new = new
        self.old = old

    def __len__(self) -> int:
        return len(self.ops)

    def relation_oids(self) -> list[int]:
        """The distinct relations of the batch, ascending: a batch of one table (the usual case) is
        told by one comparison, where ``np.unique`` hashes (about 0.1 ms a batch of 1,000 changes)."""
        oids = self.oids
        if not len(oids):
            return []
        first = int(oids[0])
        if (oids == first).all():
            return [first]
        return [int(oid) for oid in np.unique(oids)]

    def changes(self) -> Iterator[Change]:
        """The batch as Change 5-tuples (offsets relative to each payload)."""
        data = self.data
        for b, size, op, oid, new, old in zip(
            self.base.tolist(), self.sizes.tolist(), self.ops.tolist(), self.oids.tolist(),
            self.new.tolist(), self.old.tolist(),
        ):  # fmt: skip
            yield (chr(op), oid, data[b : b + size], new - b if new >= 0 else -1, old - b if old >= 0 else -1)


_PADDING = bytes(16)


def _be32(buf: np.ndarray, at: np.ndarray) -> np.ndarray:
    return (
        (buf[at].astype(np.int64) << 24) | (buf[at + 1].astype(np.int64) << 16) | (buf[at + 2].astype(np.int64) << 8)
        | buf[at + 3]
    )  # fmt: skip


class PendingRows:
    """Pending row changes of one table, gathered for a write: one buffer and column arrays."""

    __slots__ = ("data", "ops", "new", "old", "lsns", "seqs", "_parsed")

    def __init__(
        self, data: bytes, ops: np.ndarray, new: np.ndarray, old: np.ndarray, lsns: np.ndarray, seqs: np.ndarray
    ) -> None:
        self.data, self.ops, self.new, self.old, self.lsns, self.seqs = data, ops, new, old, lsns, seqs
        self._parsed: tuple[int, np.ndarray, tuple[list[pa.Array], list[np.ndarray]]] | None = None

    def __len__(self) -> int:
        return len(self.ops)

    def image_columns(self, ncols: int, images: np.ndarray) -> tuple[list[pa.Array], list[np.ndarray]]:
        """The row images ``images`` (``i``: change i's new image, ``len(self) + i``: its old one; absent
        ones NULL) column-wise, as :func:`tuple_columns_at` gives them. Every present image is parsed
        once, at the first call, for all the writes of these rows (a changelog's and the table's: the
        parse is most of a drain's own work), then rows are taken (:func:`take_rows`). They are parsed
        in the order the keyed fold asks for them (each change's old image, then its new one, absent
        ones left out), which then needs no take."""
        if self._parsed is None or self._parsed[0] != ncols:
            n = len(self)
            positions = np.stack([self.old, self.new], axis=1).ravel()
            numbers = np.stack([np.arange(n) + n, np.arange(n)], axis=1).ravel()
            present = positions >= 0
            rank = np.full(2 * n, -1, np.int64)
            rank[numbers[present]] = np.arange(int(present.sum()))
            self._parsed = (ncols, rank, tuple_columns_at(self.data, positions[present], ncols))
        _, rank, (columns, masks) = self._parsed
        wanted = rank[images]
        if len(wanted) == len(rank) - int((rank < 0).sum()) and (wanted == np.arange(len(wanted))).all():
            return list(columns), [mask.copy() for mask in masks]
        return take_rows(columns, masks, wanted)


def gather(pending: list[tuple[RowBatch, np.ndarray, int, int]]) -> list[PendingRows]:
    """Pending slices (batch, row indexes, commit end LSN, first position) -> PendingRows, in order;
    more than one only when their buffers together would pass :data:`SLICE_BYTES`."""
    groups: list[PendingRows] = []
    first = 0
    while first < len(pending):
        offsets: dict[int, int] = {}
        buffers: list[bytes] = []
        total = 0
        stop = first
        while stop < len(pending):
            batch = pending[stop][0]
            if id(batch) not in offsets:
                if buffers and total + len(batch.data) > SLICE_BYTES:
                    break
                offsets[id(batch)] = total
                buffers.append(batch.data)
                total += len(batch.data)
            stop += 1
        parts = pending[first:stop]
        shifts = [offsets[id(batch)] for batch, _, _, _ in parts]
        new = np.concatenate([_shifted(batch.new[index], shift) for (batch, index, _, _), shift in zip(parts, shifts)])
        old = np.concatenate([_shifted(batch.old[index], shift) for (batch, index, _, _), shift in zip(parts, shifts)])
        ops = np.concatenate([batch.ops[index] for batch, index, _, _ in parts])
        lsns = np.concatenate([np.full(len(index), end, np.int64) for _, index, end, _ in parts])
        seqs = np.concatenate([index + seq for _, index, _, seq in parts])
        groups.append(PendingRows(b"".join(buffers), ops, new, old, lsns, seqs))
        first = stop
    return groups


def _shifted(positions: np.ndarray, shift: int) -> np.ndarray:
    return np.where(positions >= 0, positions + shift, -1) if shift else positions


Change: TypeAlias = tuple[str, Any, bytes | None, int, int]
