"""Transaction assembly from pgoutput bytes (protocol 2 layouts): ordering, spilling, aborts.

The live tests (tests/test_incremental.py) cover what PostgreSQL sends; this one pins an
interleaving PostgreSQL 16+ will not produce on demand (a streamed transaction aborted
after some of it was sent), built byte for byte as proto.c writes it.
"""

from __future__ import annotations

import struct
from pathlib import Path

from resources.cdc.transactions import TransactionAssembler

OID = 16384


def text_tuple(*values: bytes | None) -> bytes:
    out = struct.pack(">H", len(values))
    for value in values:
        out += b"u" if value is None else b"t" + struct.pack(">i", len(value)) + value
    return out


def relation(xid: int) -> bytes:
    columns = b"".join(
        struct.pack(">B", 1 if name == b"id" else 0) + name + b"\0" + struct.pack(">Ii", 23, -1)
        for name in (b"id", b"body")
    )
    return b"R" + struct.pack(">II", xid, OID) + b"public\0t\0d" + struct.pack(">H", 2) + columns


def insert(value: bytes, xid: int | None = None) -> bytes:
    head = b"I" + (struct.pack(">I", xid) if xid is not None else b"")
    return head + struct.pack(">I", OID) + b"N" + text_tuple(value, b"body " + value)


def test_streamed_transactions_interleave_spill_and_abort(tmp_path: Path) -> None:
    """Two streamed transactions around a regular one; one aborts whole, one loses a subtransaction."""
    messages = [
        b"S" + struct.pack(">IB", 700, 1),
        relation(700),
        insert(b"1", 700),
        insert(b"2", 701),
        b"E",
        b"S" + struct.pack(">IB", 800, 1),
        insert(b"100", 800),
        b"E",
        b"B" + struct.pack(">QqI", 6, 0, 900),
        relation(0)[:1] + relation(0)[5:],
        insert(b"50"),
        b"C" + struct.pack(">BQQq", 0, 6, 7, 0),
        b"S" + struct.pack(">IB", 700, 0),
        insert(b"3", 702),
        insert(b"4", 700),
        b"E",
        b"A" + struct.pack(">II", 700, 702),
        b"A" + struct.pack(">II", 800, 800),
        b"S" + struct.pack(">IB", 700, 0),
        b"U"
        + struct.pack(">II", 700, OID)
        + b"K"
        + struct.pack(">H", 2)
        + b"t\0\0\0\x014n"
        + b"N"
        + text_tuple(b"40", None),
        b"E",
        b"c" + struct.pack(">IBQQq", 700, 0, 14, 15, 0),
    ]
    released = []
    with TransactionAssembler(2, tmp_path, spill_bytes=64) as assembler:
        for lsn, message in enumerate(messages):
            done = assembler.feed(memoryview(message), lsn)
            if done is not None:
                released.append((done.xid, int(done.end_lsn), done.streamed, list(done.changes())))
                done.discard()
        assert assembler.open_streamed == 0
        assert list(assembler.spill_directory.iterdir()) == []
    assert not assembler.spill_directory.exists()
    assert [(xid, end, streamed) for xid, end, streamed, _ in released] == [(900, 7, False), (700, 15, True)]
    assert [change[0] for change in released[0][3]] == ["R", "I"]
    streamed = released[1][3]
    # 3 was in aborted subtransaction 702; transaction 800 left nothing.
    assert [change[0] for change in streamed] == ["R", "I", "I", "I", "U"]
    values = [change[2][change[3] :] for change in streamed[1:]]
    assert values == [
        text_tuple(b"1", b"body 1"),
        text_tuple(b"2", b"body 2"),
        text_tuple(b"4", b"body 4"),
        text_tuple(b"40", None),
    ]
    update = streamed[-1]
    assert update[2][update[4] : update[3] - 1] == struct.pack(">H", 2) + b"t\0\0\0\x014n"  # the old key image
