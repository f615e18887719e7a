"""pgoutput messages built byte for byte as proto.c writes them (protocol 1 layouts, no xid).

For tests that feed the transaction assembler, the decoder or the tuple parser without a
server. Values are text-format bytes; ``None`` is NULL and :data:`UNCHANGED` an unchanged
TOASTed value ('u').
"""

from __future__ import annotations

import struct

UNCHANGED = object()
"""A column value sent as 'u' (unchanged TOAST)."""


def tuple_data(*values: bytes | None | object, binary: frozenset[int] = frozenset()) -> bytes:
    """A TupleData: Int16 count, then per column 'n', 'u', or 't'/'b' + Int32 length + bytes."""
    out = struct.pack(">H", len(values))
    for index, value in enumerate(values):
        if value is None:
            out += b"n"
        elif value is UNCHANGED:
            out += b"u"
        else:
            assert isinstance(value, bytes)
            out += (b"b" if index in binary else b"t") + struct.pack(">i", len(value)) + value
    return out


def relation(
    oid: int, name: str, columns: list[tuple[str, int, bool]], *, schema: str = "public", replident: bytes = b"d"
) -> bytes:
    """A Relation message; ``columns`` are (name, type oid, part of the key)."""
    body = b"".join(
        struct.pack(">B", 1 if key else 0) + column.encode() + b"\0" + struct.pack(">Ii", type_oid, -1)
        for column, type_oid, key in columns
    )
    return (
        b"R"
        + struct.pack(">I", oid)
        + schema.encode()
        + b"\0"
        + name.encode()
        + b"\0"
        + replident
        + struct.pack(">H", len(columns))
        + body
    )


def begin(final_lsn: int, xid: int) -> bytes:
    return b"B" + struct.pack(">QqI", final_lsn, 0, xid)


def commit(commit_lsn: int, end_lsn: int) -> bytes:
    return b"C" + struct.pack(">BQQq", 0, commit_lsn, end_lsn, 0)


def insert(oid: int, *values: bytes | None | object) -> bytes:
    return b"I" + struct.pack(">I", oid) + b"N" + tuple_data(*values)


def update(oid: int, new: tuple, *, key: tuple | None = None, old: tuple | None = None) -> bytes:
    """An Update; ``key`` (the 'K' image, sent when the key changed) or ``old`` (the 'O' image, FULL)."""
    head = b""
    if key is not None:
        head = b"K" + tuple_data(*key)
    elif old is not None:
        head = b"O" + tuple_data(*old)
    return b"U" + struct.pack(">I", oid) + head + b"N" + tuple_data(*new)


def delete(oid: int, *, key: tuple | None = None, old: tuple | None = None) -> bytes:
    image = b"K" + tuple_data(*key) if key is not None else b"O" + tuple_data(*(old or ()))
    return b"D" + struct.pack(">I", oid) + image


def truncate(*oids: int) -> bytes:
    return b"T" + struct.pack(">IB", len(oids), 0) + b"".join(struct.pack(">I", oid) for oid in oids)
