"""Decoder for the pgoutput logical replication protocol, versions 1 to 4.

Follows PostgreSQL's "Logical Replication Message Formats"
(protocol-logicalrep-message-formats) and ``src/backend/replication/logical/proto.c``.

One ``PgOutputDecoder`` decodes the payloads of one replication session in order:
it is stateful because, between Stream Start and Stream Stop (protocol 2+), the
messages Relation, Type, Insert, Update, Delete, Truncate and Message carry an
extra Int32 xid right after the type byte.

Every message carries ``wal_start``: the start LSN of the XLogData frame (or the
``lsn`` column of ``pg_logical_slot_*_binary_changes``) it arrived in. The
decoder stores the object it is given, so passing an ``LSN`` costs nothing.

Column values stay ``bytes`` (text or binary form as sent); NULL is ``None`` and
an unchanged TOASTed value is the ``UNCHANGED_TOAST`` sentinel.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from datetime import datetime

from resources.errors import ProtocolError
from resources.lsn import LSN
from resources.pgoutput.messages import (
    Begin,
    BeginPrepare,
    ColumnValue,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    MAX_PROTO_VERSION,
    Message,
    MIN_PROTO_VERSION,
    Origin,
    pg_timestamp,
    PgOutputMessage,
    Prepare,
    Relation,
    RelationColumn,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    Type,
    UNCHANGED_TOAST,
    Update,
)
from resources.pgoutput.relations import RelationCache, TypeCache
from resources.pgoutput.tags import (
    BEGIN,
    BEGIN_PREPARE,
    BINARY,
    COMMIT,
    COMMIT_PREPARED,
    DELETE,
    INSERT,
    KEY,
    MESSAGE,
    MESSAGE_NAMES,
    NEW,
    NULL,
    OLD,
    ORIGIN,
    PREPARE,
    RELATION,
    ROLLBACK_PREPARED,
    SINCE_VERSION,
    STREAM_ABORT,
    STREAM_COMMIT,
    STREAM_PREPARE,
    STREAM_START,
    STREAM_STOP,
    TEXT,
    TRUNCATE,
    TYPE,
    UNCHANGED,
    UPDATE,
)

__all__ = [
    "PgOutputDecoder",
]


# --------------------------------------------------------------------------- decoder

_U8 = struct.Struct(">B")
_I16 = struct.Struct(">H")
_I32 = struct.Struct(">I")
_S32 = struct.Struct(">i")
_I64 = struct.Struct(">Q")
_Q_Q = struct.Struct(">QQ")
_BEGIN = struct.Struct(">QqI")  # final_lsn, commit_time, xid
_COMMIT = struct.Struct(">BQQq")  # flags, commit_lsn, end_lsn, commit_time
_STREAM_START = struct.Struct(">IB")
_STREAM_COMMIT = struct.Struct(">IBQQq")
_STREAM_ABORT = struct.Struct(">II")
_STREAM_ABORT_V4 = struct.Struct(">IIQq")
_BEGIN_PREPARE = struct.Struct(">QQqI")  # prepare_lsn, end_lsn, prepare_time, xid
_PREPARE = struct.Struct(">BQQqI")  # flags, prepare_lsn, end_lsn, prepare_time, xid
_ROLLBACK_PREPARED = struct.Struct(">BQQqqI")
_MESSAGE_HEAD = struct.Struct(">BQ")  # flags, lsn
_RELATION_COLUMN_TAIL = struct.Struct(">Ii")  # type oid, type modifier
_TRUNCATE_HEAD = struct.Struct(">IB")
_REL_KIND = struct.Struct(">IB")  # relation oid, tuple kind byte

_u8 = _U8.unpack_from
_u16 = _I16.unpack_from
_u32 = _I32.unpack_from
_s32 = _S32.unpack_from


class _Malformed(Exception):
    """Internal: the message bytes do not follow the layout; the argument says how."""


class _Truncated(_Malformed):
    """Internal: a read ran past the end of the message."""


class PgOutputDecoder:
    """Stateful decoder of pgoutput payloads for one replication session.

    ``decode(data, wal_start)`` returns one message per payload. Relation and
    Type messages update ``relations`` and ``types``; an Insert, Update, Delete
    or Truncate naming a relation no Relation message described raises
    ``ProtocolError``.
    """

    __slots__ = ("proto_version", "relations", "types", "_in_stream", "_stream_xid", "_dispatch")

    def __init__(self, proto_version: int) -> None:
        if not MIN_PROTO_VERSION <= proto_version <= MAX_PROTO_VERSION:
            raise ValueError(f"pgoutput protocol version {proto_version} is not supported (1 to 4)")
        self.proto_version = proto_version
        self.relations = RelationCache()
        self.types = TypeCache()
        self._in_stream = False
        self._stream_xid: int | None = None
        self._dispatch: dict[int, Callable[[bytes, LSN], tuple[PgOutputMessage, int]]] = {
            BEGIN: self._begin,
            MESSAGE: self._message,
            COMMIT: self._commit,
            ORIGIN: self._origin,
            RELATION: self._relation,
            TYPE: self._type,
            INSERT: self._insert,
            UPDATE: self._update,
            DELETE: self._delete,
            TRUNCATE: self._truncate,
        }
        if proto_version >= 2:
            self._dispatch.update(
                {
                    STREAM_START: self._stream_start,
                    STREAM_STOP: self._stream_stop,
                    STREAM_COMMIT: self._stream_commit,
                    STREAM_ABORT: self._stream_abort,
                }
            )
        if proto_version >= 3:
            self._dispatch.update(
                {
                    BEGIN_PREPARE: self._begin_prepare,
                    PREPARE: self._prepare,
                    COMMIT_PREPARED: self._commit_prepared,
                    ROLLBACK_PREPARED: self._rollback_prepared,
                    STREAM_PREPARE: self._stream_prepare,
                }
            )

    # -- state

    @property
    def in_stream(self) -> bool:
        """True between Stream Start and Stream Stop."""
        return self._in_stream

    @property
    def stream_xid(self) -> int | None:
        """The xid of the open stream block, or None."""
        return self._stream_xid

    # -- entry point

    def decode(self, data: bytes | bytearray | memoryview, wal_start: LSN | int) -> PgOutputMessage:
        """Decode one pgoutput message; ``wal_start`` is the LSN of the frame that carried it."""
        if type(data) is not bytes:
            data = bytes(data)
        if type(wal_start) is not LSN:
            wal_start = LSN(wal_start)
        if not data:
            raise ProtocolError(
                f"empty pgoutput message at {wal_start}", "check that the slot uses the pgoutput plugin"
            )
        kind = data[0]
        handler = self._dispatch.get(kind)
        if handler is None:
            raise self._unknown(kind, wal_start)
        try:
            message, end = handler(data, wal_start)
        except UnicodeDecodeError as exc:
            raise self._error(kind, wal_start, f"has a name that is not UTF-8 ({exc.reason})") from None
        except (struct.error, IndexError, ValueError, _Truncated):
            raise self._error(kind, wal_start, f"is truncated ({len(data)} bytes)") from None
        except _Malformed as exc:
            raise self._error(kind, wal_start, str(exc)) from None
        if end != len(data):
            if end > len(data):
                raise self._error(kind, wal_start, f"is truncated ({len(data)} bytes)")
            raise self._error(kind, wal_start, f"has {len(data) - end} trailing bytes")
        return message

    # -- errors

    def _unknown(self, kind: int, wal_start: LSN) -> ProtocolError:
        name = MESSAGE_NAMES.get(kind)
        if name is not None:
            return ProtocolError(
                f"pgoutput {name} message (type byte {chr(kind)!r}) at {wal_start} is not part of protocol version "
                f"{self.proto_version} (needs {SINCE_VERSION.get(kind, 1)})",
                "decode with the proto_version the replication was started with",
            )
        return ProtocolError(
            f"unknown pgoutput message type byte {chr(kind)!r} (0x{kind:02x}) at {wal_start}",
            "check that the slot uses the pgoutput plugin and that pgcdc supports the server's protocol version",
        )

    @staticmethod
    def _error(kind: int, wal_start: LSN, problem: str) -> ProtocolError:
        name = MESSAGE_NAMES.get(kind, "unknown")
        return ProtocolError(
            f"pgoutput {name} message (type byte {chr(kind)!r}) at {wal_start} {problem}",
            "the replication stream is corrupt or from an unsupported pgoutput version; restart replication",
        )

    def _stream_state_error(self, kind: int, wal_start: LSN, problem: str) -> ProtocolError:
        name = MESSAGE_NAMES[kind]
        return ProtocolError(
            f"pgoutput {name} message (type byte {chr(kind)!r}) at {wal_start} {problem}",
            "decode every message of the session in order with one decoder",
        )

    # -- helpers

    def _xid(self, data: bytes) -> tuple[int | None, int]:
        """The streamed-transaction xid after the type byte (inside a stream block), and the next offset."""
        if self._in_stream:
            return _u32(data, 1)[0], 5
        return None, 1

    def _check_relation(self, kind: int, oid: int, wal_start: LSN) -> None:
        if oid not in self.relations:
            raise ProtocolError(
                f"pgoutput {MESSAGE_NAMES[kind]} message at {wal_start} names relation oid {oid}, "
                "which no Relation message described",
                "decode the session from its start (the server sends Relation before the first change of each table)",
            )

    # -- transaction messages

    def _begin(self, data: bytes, wal_start: LSN) -> tuple[Begin, int]:
        final_lsn, commit_time, xid = _BEGIN.unpack_from(data, 1)
        return Begin(wal_start, LSN(final_lsn), pg_timestamp(commit_time), xid), 21

    def _commit(self, data: bytes, wal_start: LSN) -> tuple[Commit, int]:
        flags, commit_lsn, end_lsn, commit_time = _COMMIT.unpack_from(data, 1)
        return Commit(wal_start, flags, LSN(commit_lsn), LSN(end_lsn), pg_timestamp(commit_time)), 26

    def _origin(self, data: bytes, wal_start: LSN) -> tuple[Origin, int]:
        (commit_lsn,) = _I64.unpack_from(data, 1)
        name, pos = _string(data, 9)
        return Origin(wal_start, LSN(commit_lsn), name), pos

    def _message(self, data: bytes, wal_start: LSN) -> tuple[Message, int]:
        xid, pos = self._xid(data)
        flags, lsn = _MESSAGE_HEAD.unpack_from(data, pos)
        prefix, pos = _string(data, pos + 9)
        (size,) = _u32(data, pos)
        pos += 4
        content = data[pos : pos + size]
        pos += size
        return Message(wal_start, xid, bool(flags & 1), LSN(lsn), prefix, content), pos

    # -- schema messages

    def _relation(self, data: bytes, wal_start: LSN) -> tuple[Relation, int]:
        xid, pos = self._xid(data)
        (oid,) = _u32(data, pos)
        namespace, pos = _string(data, pos + 4)
        name, pos = _string(data, pos)
        replica_identity = chr(data[pos])
        (ncols,) = _u16(data, pos + 1)
        pos += 3
        columns = []
        for _ in range(ncols):
            flags = data[pos]
            column_name, pos = _string(data, pos + 1)
            type_oid, type_modifier = _RELATION_COLUMN_TAIL.unpack_from(data, pos)
            pos += 8
            columns.append(RelationColumn(flags, column_name, type_oid, type_modifier))
        relation = Relation(wal_start, xid, oid, namespace or "pg_catalog", name, replica_identity, tuple(columns))
        self.relations.update(relation)
        return relation, pos

    def _type(self, data: bytes, wal_start: LSN) -> tuple[Type, int]:
        xid, pos = self._xid(data)
        (oid,) = _u32(data, pos)
        namespace, pos = _string(data, pos + 4)
        name, pos = _string(data, pos)
        type_ = Type(wal_start, xid, oid, namespace or "pg_catalog", name)
        self.types.update(type_)
        return type_, pos

    # -- data messages

    def _insert(self, data: bytes, wal_start: LSN) -> tuple[Insert, int]:
        if self._in_stream:
            xid, oid, kind = _STREAM_REL_KIND(data, 1)
            pos = 10
        else:
            xid = None
            oid, kind = _REL_KIND.unpack_from(data, 1)
            pos = 6
        if kind != NEW:
            raise self._error(INSERT, wal_start, f"has tuple kind {chr(kind)!r} where 'N' was expected")
        if oid not in self.relations._by_oid:
            self._check_relation(INSERT, oid, wal_start)
        new, pos = _tuple(data, pos)
        return Insert(wal_start, xid, oid, new), pos

    def _update(self, data: bytes, wal_start: LSN) -> tuple[Update, int]:
        xid, pos = self._xid(data)
        oid, kind = _REL_KIND.unpack_from(data, pos)
        pos += 5
        self._check_relation(UPDATE, oid, wal_start)
        key = old = None
        if kind == KEY:
            key, pos = _tuple(data, pos)
            kind = data[pos]
            pos += 1
        elif kind == OLD:
            old, pos = _tuple(data, pos)
            kind = data[pos]
            pos += 1
        if kind != NEW:
            raise self._error(UPDATE, wal_start, f"has tuple kind {chr(kind)!r} where 'N' was expected")
        new, pos = _tuple(data, pos)
        return Update(wal_start, xid, oid, key, old, new), pos

    def _delete(self, data: bytes, wal_start: LSN) -> tuple[Delete, int]:
        xid, pos = self._xid(data)
        oid, kind = _REL_KIND.unpack_from(data, pos)
        pos += 5
        self._check_relation(DELETE, oid, wal_start)
        if kind == KEY:
            key, pos = _tuple(data, pos)
            return Delete(wal_start, xid, oid, key, None), pos
        if kind == OLD:
            old, pos = _tuple(data, pos)
            return Delete(wal_start, xid, oid, None, old), pos
        raise self._error(DELETE, wal_start, f"has tuple kind {chr(kind)!r} where 'K' or 'O' was expected")

    def _truncate(self, data: bytes, wal_start: LSN) -> tuple[Truncate, int]:
        xid, pos = self._xid(data)
        count, flags = _TRUNCATE_HEAD.unpack_from(data, pos)
        pos += 5
        end = pos + 4 * count
        if end > len(data):
            raise _Truncated
        oids = struct.unpack_from(f">{count}I", data, pos)
        for oid in oids:
            self._check_relation(TRUNCATE, oid, wal_start)
        return Truncate(wal_start, xid, oids, bool(flags & 1), bool(flags & 2)), end

    # -- streaming (protocol 2+)

    def _stream_start(self, data: bytes, wal_start: LSN) -> tuple[StreamStart, int]:
        if self._in_stream:
            raise self._stream_state_error(
                STREAM_START, wal_start, f"arrived inside the stream of xid {self._stream_xid}"
            )
        xid, first = _STREAM_START.unpack_from(data, 1)
        if len(data) == 6:  # state changes only for a well-formed message
            self._in_stream = True
            self._stream_xid = xid
        return StreamStart(wal_start, xid, first == 1), 6

    def _stream_stop(self, data: bytes, wal_start: LSN) -> tuple[StreamStop, int]:
        if not self._in_stream:
            raise self._stream_state_error(STREAM_STOP, wal_start, "arrived outside a stream block")
        if len(data) == 1:
            self._in_stream = False
            self._stream_xid = None
        return StreamStop(wal_start), 1

    def _stream_commit(self, data: bytes, wal_start: LSN) -> tuple[StreamCommit, int]:
        xid, flags, commit_lsn, end_lsn, commit_time = _STREAM_COMMIT.unpack_from(data, 1)
        message = StreamCommit(wal_start, xid, flags, LSN(commit_lsn), LSN(end_lsn), pg_timestamp(commit_time))
        return message, 1 + _STREAM_COMMIT.size

    def _stream_abort(self, data: bytes, wal_start: LSN) -> tuple[StreamAbort, int]:
        # abort_lsn and abort_time exist since protocol 4, and only when streaming = parallel:
        # the length tells which layout the server sent.
        if self.proto_version >= 4 and len(data) > 1 + _STREAM_ABORT.size:
            xid, subxid, abort_lsn, abort_time = _STREAM_ABORT_V4.unpack_from(data, 1)
            return StreamAbort(wal_start, xid, subxid, LSN(abort_lsn), pg_timestamp(abort_time)), 25
        xid, subxid = _STREAM_ABORT.unpack_from(data, 1)
        return StreamAbort(wal_start, xid, subxid), 9

    # -- two-phase commit (protocol 3+)

    def _begin_prepare(self, data: bytes, wal_start: LSN) -> tuple[BeginPrepare, int]:
        prepare_lsn, end_lsn, prepare_time, xid = _BEGIN_PREPARE.unpack_from(data, 1)
        gid, pos = _string(data, 29)
        return BeginPrepare(wal_start, LSN(prepare_lsn), LSN(end_lsn), pg_timestamp(prepare_time), xid, gid), pos

    def _prepare_common(self, data: bytes) -> tuple[int, LSN, LSN, datetime, int, str, int]:
        flags, lsn, end_lsn, time, xid = _PREPARE.unpack_from(data, 1)
        gid, pos = _string(data, 30)
        return flags, LSN(lsn), LSN(end_lsn), pg_timestamp(time), xid, gid, pos

    def _prepare(self, data: bytes, wal_start: LSN) -> tuple[Prepare, int]:
        flags, lsn, end_lsn, time, xid, gid, pos = self._prepare_common(data)
        return Prepare(wal_start, flags, lsn, end_lsn, time, xid, gid), pos

    def _commit_prepared(self, data: bytes, wal_start: LSN) -> tuple[CommitPrepared, int]:
        flags, lsn, end_lsn, time, xid, gid, pos = self._prepare_common(data)
        return CommitPrepared(wal_start, flags, lsn, end_lsn, time, xid, gid), pos

    def _stream_prepare(self, data: bytes, wal_start: LSN) -> tuple[StreamPrepare, int]:
        flags, lsn, end_lsn, time, xid, gid, pos = self._prepare_common(data)
        return StreamPrepare(wal_start, flags, lsn, end_lsn, time, xid, gid), pos

    def _rollback_prepared(self, data: bytes, wal_start: LSN) -> tuple[RollbackPrepared, int]:
        flags, prepare_end, rollback_end, prepare_time, rollback_time, xid = _ROLLBACK_PREPARED.unpack_from(data, 1)
        gid, pos = _string(data, 38)
        message = RollbackPrepared(
            wal_start,
            flags,
            LSN(prepare_end),
            LSN(rollback_end),
            pg_timestamp(prepare_time),
            pg_timestamp(rollback_time),
            xid,
            gid,
        )
        return message, pos


_STREAM_REL_KIND = struct.Struct(">IIB").unpack_from


def _string(data: bytes, pos: int) -> tuple[str, int]:
    """A NUL-terminated string at ``pos`` and the offset after its terminator."""
    end = data.index(0, pos)  # ValueError when unterminated: reported as truncated
    return data[pos:end].decode(), end + 1


def _tuple(data: bytes, pos: int) -> tuple[TupleData, int]:
    """TupleData at ``pos``: Int16 column count, then per column a kind byte and, for 't'/'b', Int32 length + bytes."""
    (ncols,) = _u16(data, pos)
    pos += 2
    values: list[ColumnValue] = []
    append = values.append
    binary = False
    for _ in range(ncols):
        kind = data[pos]
        if kind == TEXT:
            (size,) = _s32(data, pos + 1)
            pos += 5
            end = pos + size
            append(data[pos:end])
            pos = end
        elif kind == NULL:
            append(None)
            pos += 1
        elif kind == UNCHANGED:
            append(UNCHANGED_TOAST)
            pos += 1
        elif kind == BINARY:
            (size,) = _s32(data, pos + 1)
            pos += 5
            end = pos + size
            append(data[pos:end])
            pos = end
            binary = True
        else:
            raise _Malformed(f"has unknown column kind {chr(kind)!r} at offset {pos}")
    if pos > len(data):
        raise _Truncated
    return TupleData(tuple(values), binary), pos
