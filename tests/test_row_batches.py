"""Pending row changes read column-wise (resources/cdc/row_batches.py), without a server: every order
of row images a write asks for equals parsing those images one by one."""

from __future__ import annotations

import numpy as np

from resources.cdc.row_batches import gather, RowBatch
from resources.pgoutput.tuples import tuple_columns
from tests.support.pgoutput_messages import delete, insert, UNCHANGED, update

OID = 16384


def _images(payloads: list[bytes], batch: RowBatch, images: list[int]) -> tuple[list[list], list[list[bool]]]:
    """Images parsed one payload at a time (``i``: change i's new image, ``n + i``: its old one)."""
    n = len(payloads)
    starts = [int(batch.new[i] if i < n else batch.old[i - n]) for i in images]
    relative = [start - int(batch.base[i % n]) if start >= 0 else -1 for start, i in zip(starts, images)]
    columns, masks = tuple_columns([payloads[i % n] for i in images], relative, 2)
    return [column.to_pylist() for column in columns], [mask.tolist() for mask in masks]


def test_image_columns_in_every_order_a_write_asks_for() -> None:
    payloads = [
        insert(OID, b"1", b"one"),
        update(OID, (b"2", b"two"), key=(b"1", None)),
        update(OID, (b"2", UNCHANGED)),
        delete(OID, key=(b"2", None)),
        insert(OID, b"3", b"a value longer than twelve bytes"),
        update(OID, (b"4", b"x"), old=(b"3", b"a value longer than twelve bytes")),
    ]
    batch = RowBatch(list(payloads), streamed=False)
    (rows,) = gather([(batch, np.arange(len(payloads)), 100, 0)])
    n = len(payloads)
    interleaved = [image for i in range(n) for image in (n + i, i) if (batch.old, batch.new)[image < n][i % n] >= 0]
    # interleaved: the keyed fold's order, parsed as asked; the others are taken from it (n: an absent image)
    orders = [interleaved, list(range(n)), list(range(n, 2 * n)), [n + 3, 0, n], interleaved[::-1]]
    for images in orders:
        columns, masks = rows.image_columns(2, np.array(images, np.int64))
        expected = _images(payloads, batch, images)
        assert ([column.to_pylist() for column in columns], [mask.tolist() for mask in masks]) == expected, images


def test_relation_oids_are_the_distinct_relations_ascending() -> None:
    one = RowBatch([insert(OID, b"1", b"a"), insert(OID, b"2", b"b")], streamed=False)
    mixed = RowBatch([insert(OID + 5, b"1", b"a"), insert(OID, b"2", b"b"), insert(OID + 5, b"3", b"c")], False)
    assert (one.relation_oids(), mixed.relation_oids()) == ([OID], [OID, OID + 5])
