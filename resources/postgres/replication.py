"""Logical replication over the streaming replication protocol (pgoutput).

Three layers, each small:

* :class:`ReplicationConnection` - a psycopg connection in ``replication=database``
  walsender mode: IDENTIFY_SYSTEM, CREATE/DROP_REPLICATION_SLOT, the snapshot
  transaction for ``SNAPSHOT 'use'``, and plain SQL (``pg_replication_slots``).
* :class:`PgOutputOptions` - the pgoutput option list of START_REPLICATION,
  validated against the server version.
* :class:`ReplicationStream` - the COPY BOTH loop through ``psycopg.pq``:
  XLogData and keepalive frames in, standby status updates out, and
  :meth:`ReplicationStream.drain`, which reads up to an end LSN and stops at a
  transaction boundary.

The stream never moves the slot by itself: the flush/apply position it reports
is the slot's own ``confirmed_flush_lsn`` until the caller declares a position
durable with :meth:`ReplicationStream.confirm`.

Frames are handed out undecoded (the pgoutput decoder is a separate module);
the stream only peeks at the first payload byte and a few fixed fields to know
where transactions begin and end.
"""

from __future__ import annotations

import re
import select
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal, NamedTuple

import psycopg
from psycopg import pq

from resources.postgres.connections import connect
from resources.errors import ConfigurationError, ConnectionFailure, PgcdcError, ProtocolError, SlotError, explain_server_error
from resources.lsn import LSN

__all__ = [
    "CreatedSlot",
    "Keepalive",
    "PgOutputOptions",
    "ReplicationConnection",
    "ReplicationStream",
    "SlotState",
    "SystemIdentity",
    "XLogData",
    "highest_proto_version",
    "pg_epoch_micros",
]

SnapshotAction = Literal["export", "use", "nothing"]
StreamingMode = Literal["off", "on", "parallel"]

_SLOT_NAME = re.compile(r"^[a-z0-9_]{1,63}$")

#: Seconds between 1970-01-01 and 2000-01-01, PostgreSQL's timestamp epoch.
_PG_EPOCH_OFFSET = 946_684_800


def pg_epoch_micros(unix_time: float | None = None) -> int:
    """Microseconds since 2000-01-01 UTC, the clock of the replication protocol."""
    return int(((time.time() if unix_time is None else unix_time) - _PG_EPOCH_OFFSET) * 1_000_000)


# --------------------------------------------------------------------------- quoting


def quote_ident(name: str) -> str:
    """A double-quoted SQL identifier, embedded double quotes doubled."""
    if "\x00" in name:
        raise ConfigurationError(f"identifier {name!r} contains a NUL byte", "remove it from the name")
    return '"' + name.replace('"', '""') + '"'


def quote_literal(value: str) -> str:
    """A single-quoted string constant as the replication grammar reads it ('' doubles a quote).

    The replication command scanner has no backslash escapes, and plain SQL has
    standard_conforming_strings on, so doubling single quotes is all it takes.
    """
    if "\x00" in value:
        raise ConfigurationError(f"string {value!r} contains a NUL byte", "remove it from the value")
    return "'" + value.replace("'", "''") + "'"


def validate_slot_name(name: str) -> str:
    """Slot names are 1-63 characters of [a-z0-9_], as PostgreSQL requires."""
    if not isinstance(name, str) or not _SLOT_NAME.match(name):
        raise SlotError(
            f"invalid replication slot name {name!r}",
            "use 1 to 63 characters from lower-case letters, digits and underscores",
        )
    return name


# --------------------------------------------------------------------------- errors


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _from_psycopg(exc: psycopg.Error, *, slot: str | None = None, conn: psycopg.Connection | None = None) -> PgcdcError:
    if (conn is not None and conn.closed) or (isinstance(exc, psycopg.OperationalError) and exc.sqlstate is None):
        return ConnectionFailure(_one_line(str(exc)) or "connection lost", "check that PostgreSQL is running and reachable, then retry")
    return explain_server_error(exc.sqlstate, exc.diag.message_primary or str(exc), slot=slot)


def _from_result(res: pq.abc.PGresult, *, slot: str | None = None) -> PgcdcError:
    sqlstate = res.error_field(pq.DiagnosticField.SQLSTATE)
    primary = res.error_field(pq.DiagnosticField.MESSAGE_PRIMARY)
    message = (primary or res.error_message or b"").decode("utf-8", "replace")
    return explain_server_error(sqlstate.decode("ascii") if sqlstate else None, message, slot=slot)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class SystemIdentity:
    """The answer to IDENTIFY_SYSTEM."""

    systemid: str
    timeline: int
    xlogpos: LSN
    dbname: str | None


@dataclass(frozen=True)
class CreatedSlot:
    """The answer to CREATE_REPLICATION_SLOT."""

    slot_name: str
    consistent_point: LSN
    snapshot_name: str | None
    output_plugin: str | None


@dataclass(frozen=True)
class SlotState:
    """One row of pg_replication_slots."""

    slot_name: str
    plugin: str | None
    slot_type: str
    database: str | None
    temporary: bool
    active: bool
    active_pid: int | None
    restart_lsn: LSN | None
    confirmed_flush_lsn: LSN | None
    wal_status: str | None
    two_phase: bool | None
    #: PostgreSQL 17+: why the slot was invalidated (None when valid or on older servers).
    invalidation_reason: str | None = None


def _lsn_or_none(text: str | None) -> LSN | None:
    return None if text is None else LSN.parse(text)


# --------------------------------------------------------------------------- connection


class ReplicationConnection:
    """A ``replication=database`` connection: replication commands and plain SQL.

    Connects on construction (through :func:`resources.postgres.connections.connect`, so with an
    empty search_path); use it as a context manager to close it.
    ``session_settings`` become ``-c name=value`` startup options, so the
    walsender's output functions honour them (e.g. ``{"TimeZone": "UTC"}``).
    """

    def __init__(
        self,
        dsn: str,
        *,
        application_name: str = "pgcdc",
        session_settings: Mapping[str, str] | None = None,
    ) -> None:
        self._replication_started = False
        self._conn = connect(
            dsn, application_name=application_name, session_settings=session_settings, replication=True
        )

    # -- lifecycle

    def __enter__(self) -> ReplicationConnection:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._conn.close()

    @property
    def closed(self) -> bool:
        return self._conn.closed

    @property
    def connection(self) -> psycopg.Connection:
        """The underlying psycopg connection."""
        return self._conn

    @property
    def pgconn(self) -> pq.abc.PGconn:
        return self._conn.pgconn

    @property
    def server_version_num(self) -> int:
        """The server's version as an integer, e.g. 150010 or 180001."""
        return self._conn.info.server_version

    @property
    def in_transaction(self) -> bool:
        return self._conn.info.transaction_status != pq.TransactionStatus.IDLE

    # -- commands

    def execute(self, sql: str, *, slot: str | None = None) -> list[tuple]:
        """Run one command with the simple query protocol (the walsender refuses the extended one)."""
        try:
            cursor = self._conn.execute(sql.encode())
            return cursor.fetchall() if cursor.description else []
        except psycopg.Error as exc:
            raise _from_psycopg(exc, slot=slot, conn=self._conn) from None

    def identify_system(self) -> SystemIdentity:
        """IDENTIFY_SYSTEM: system id, timeline, current WAL flush position, database."""
        (systemid, timeline, xlogpos, dbname), = self.execute("IDENTIFY_SYSTEM")
        return SystemIdentity(str(systemid), int(timeline), LSN.parse(xlogpos), dbname)

    def create_slot(
        self,
        name: str,
        *,
        temporary: bool = False,
        plugin: str = "pgoutput",
        snapshot: SnapshotAction = "nothing",
        two_phase: bool = False,
    ) -> CreatedSlot:
        """CREATE_REPLICATION_SLOT ... LOGICAL; ``snapshot='use'`` needs begin_snapshot_transaction() first.

        With ``snapshot='export'`` the snapshot stays importable until this
        connection runs its next command or closes.
        """
        validate_slot_name(name)
        if snapshot not in ("export", "use", "nothing"):
            raise ConfigurationError(f"unknown snapshot action {snapshot!r}", "use 'export', 'use' or 'nothing'")
        if snapshot == "use" and not self.in_transaction:
            raise ConfigurationError(
                "SNAPSHOT 'use' needs an open REPEATABLE READ transaction",
                "call begin_snapshot_transaction() right before create_slot()",
            )
        if not re.match(r"^[A-Za-z0-9_]+$", plugin):
            raise ConfigurationError(f"invalid output plugin name {plugin!r}", "use pgoutput")
        version = self.server_version_num
        if version < 140000:
            raise ConfigurationError(f"PostgreSQL {version // 10000} is too old", "use PostgreSQL 14 or newer")
        words = [f"CREATE_REPLICATION_SLOT {quote_ident(name)}"]
        if temporary:
            words.append("TEMPORARY")
        words.append(f"LOGICAL {plugin}")
        if version >= 150000:
            opts = [f"SNAPSHOT {quote_literal(snapshot)}"]
            if two_phase:
                opts.append("TWO_PHASE")
            words.append("(" + ", ".join(opts) + ")")
        else:
            words.append({"export": "EXPORT_SNAPSHOT", "use": "USE_SNAPSHOT", "nothing": "NOEXPORT_SNAPSHOT"}[snapshot])
            if two_phase:
                words.append("TWO_PHASE")
        (slot_name, consistent_point, snapshot_name, output_plugin), = self.execute(" ".join(words), slot=name)
        return CreatedSlot(slot_name, LSN.parse(consistent_point), snapshot_name or None, output_plugin)

    def drop_slot(self, name: str, wait: bool = True) -> None:
        """DROP_REPLICATION_SLOT; with ``wait`` it waits for an active slot to be released."""
        validate_slot_name(name)
        self.execute(f"DROP_REPLICATION_SLOT {quote_ident(name)}{' WAIT' if wait else ''}", slot=name)

    def begin_snapshot_transaction(self) -> None:
        """BEGIN READ ONLY ISOLATION LEVEL REPEATABLE READ (then create_slot(snapshot='use'))."""
        self.execute("BEGIN READ ONLY ISOLATION LEVEL REPEATABLE READ")

    def commit(self) -> None:
        self.execute("COMMIT")

    def rollback(self) -> None:
        self.execute("ROLLBACK")

    def read_slot(self, name: str) -> SlotState | None:
        """The slot's row in pg_replication_slots, or None when there is no such slot."""
        return slot_state(self.execute(slot_state_query(name, self.server_version_num)))


def slot_state_query(name: str, server_version_num: int) -> str:
    """The SELECT of slot ``name``'s row in pg_replication_slots, with the slot name inlined.

    Inlined (no parameters) because a walsender speaks only the simple query protocol; the
    name is validated and quoted. Read the rows with :func:`slot_state`.
    """
    validate_slot_name(name)
    two_phase = "two_phase" if server_version_num >= 140000 else "NULL::pg_catalog.bool"
    reason = "invalidation_reason" if server_version_num >= 170000 else "NULL::pg_catalog.text"
    return (
        "SELECT slot_name::pg_catalog.text, plugin::pg_catalog.text, slot_type, database::pg_catalog.text,"
        " temporary, active, active_pid, restart_lsn::pg_catalog.text, confirmed_flush_lsn::pg_catalog.text,"
        f" wal_status, {two_phase}, {reason} FROM pg_catalog.pg_replication_slots"
        f" WHERE slot_name OPERATOR(pg_catalog.=) {quote_literal(name)}::pg_catalog.name"
    )


def slot_state(rows: Sequence[tuple]) -> SlotState | None:
    """The :class:`SlotState` in the rows of :func:`slot_state_query`; None when there are none."""
    if not rows:
        return None
    (slot_name, plugin, slot_type, database, temporary, active, pid, restart, confirmed, wal_status, tp, why), = rows
    return SlotState(
        slot_name, plugin, slot_type, database, temporary, active, pid,
        _lsn_or_none(restart), _lsn_or_none(confirmed), wal_status, tp, why,
    )  # fmt: skip


# --------------------------------------------------------------------------- pgoutput options


def highest_proto_version(server_version_num: int) -> int:
    """The newest pgoutput protocol a server speaks: 14 -> 2, 15 -> 3, 16+ -> 4."""
    if server_version_num >= 160000:
        return 4
    if server_version_num >= 150000:
        return 3
    if server_version_num >= 140000:
        return 2
    return 1


@dataclass(frozen=True)
class PgOutputOptions:
    """pgoutput's START_REPLICATION options; only non-default ones are sent."""

    publication_names: Sequence[str] = field(default_factory=list)
    proto_version: int | None = None  # None: the highest the server supports
    binary: bool = False
    messages: bool = False
    streaming: StreamingMode = "off"
    two_phase: bool = False
    origin: Literal["any", "none"] | None = None

    def resolve_proto_version(self, server_version_num: int) -> int:
        """The protocol version to request, validated against the server."""
        highest = highest_proto_version(server_version_num)
        major = server_version_num // 10000
        proto = highest if self.proto_version is None else self.proto_version
        if not isinstance(proto, int) or not 1 <= proto <= 4:
            raise ConfigurationError(f"invalid pgoutput proto_version {proto!r}", "use 1, 2, 3 or 4")
        if proto > highest:
            raise ConfigurationError(
                f"pgoutput protocol version {proto} is not supported by PostgreSQL {major} (highest: {highest})",
                f"use proto_version={highest} or leave it unset",
            )
        return proto

    def validate(self, server_version_num: int) -> int:
        """Check the combination against the server; returns the protocol version to use."""
        proto = self.resolve_proto_version(server_version_num)
        major = server_version_num // 10000
        names = [self.publication_names] if isinstance(self.publication_names, str) else list(self.publication_names)
        if not names or any(not isinstance(n, str) or not n for n in names):
            raise ConfigurationError("publication_names is empty", "name at least one publication")
        if self.streaming not in ("off", "on", "parallel"):
            raise ConfigurationError(f"invalid streaming mode {self.streaming!r}", "use 'off', 'on' or 'parallel'")
        if self.streaming == "on" and proto < 2:
            raise ConfigurationError("streaming='on' needs pgoutput protocol 2 or newer", "use proto_version >= 2")
        if self.streaming == "parallel" and proto < 4:
            raise ConfigurationError(
                f"streaming='parallel' needs pgoutput protocol 4 (PostgreSQL 16+), not {proto} on PostgreSQL {major}",
                "use streaming='on' or a newer server",
            )
        if self.two_phase and proto < 3:
            raise ConfigurationError(
                f"two_phase needs pgoutput protocol 3 (PostgreSQL 15+), not {proto} on PostgreSQL {major}",
                "turn two_phase off or use a newer server",
            )
        if (self.binary or self.messages) and server_version_num < 140000:
            raise ConfigurationError("binary and messages need PostgreSQL 14+", "turn them off")
        if self.origin is not None:
            if self.origin not in ("any", "none"):
                raise ConfigurationError(f"invalid origin {self.origin!r}", "use 'any' or 'none'")
            if server_version_num < 160000:
                raise ConfigurationError(f"origin needs PostgreSQL 16+, not {major}", "leave origin unset")
        return proto

    def publication_names_value(self) -> str:
        """The publication_names option value: identifiers, double-quoted, comma-separated."""
        names = [self.publication_names] if isinstance(self.publication_names, str) else self.publication_names
        return ",".join(quote_ident(n) for n in names)

    def render(self, server_version_num: int) -> str:
        """The parenthesised option list of START_REPLICATION, e.g. ``(proto_version '3', ...)``."""
        proto = self.validate(server_version_num)
        opts = [f"proto_version {quote_literal(str(proto))}"]
        opts.append(f"publication_names {quote_literal(self.publication_names_value())}")
        if self.binary:
            opts.append("binary 'true'")
        if self.messages:
            opts.append("messages 'true'")
        if self.streaming != "off":
            opts.append(f"streaming {quote_literal(self.streaming)}")
        if self.two_phase:
            opts.append("two_phase 'true'")
        if self.origin is not None:
            opts.append(f"origin {quote_literal(self.origin)}")
        return "(" + ", ".join(opts) + ")"


# --------------------------------------------------------------------------- frames

# CopyData payloads of the streaming replication protocol (big-endian):
#   XLogData          'w' Int64 wal_start, Int64 wal_end, Int64 send_time, Byte[n] payload (at offset 25)
#   Primary keepalive 'k' Int64 wal_end, Int64 send_time, Byte1 reply_requested
#   Standby status    'r' Int64 write, Int64 flush, Int64 apply, Int64 client_time, Byte1 reply_requested
_XLOG_HEADER = struct.Struct(">QQq")
_KEEPALIVE = struct.Struct(">QqB")
_STATUS = struct.Struct(">cQQQqB")
_U64 = struct.Struct(">Q")
_unpack_xlog = _XLOG_HEADER.unpack_from
_unpack_keepalive = _KEEPALIVE.unpack_from
_unpack_u64 = _U64.unpack_from
_PAYLOAD = 25  # offset of the pgoutput message inside an XLogData frame

# pgoutput message layouts the drain peeks at (offsets inside the payload; src/backend/
# replication/logical/proto.c). Only these fixed fields are read, nothing is decoded:
#   'B' Begin            Int64 final_lsn @1 (start of the commit record), Int64 commit_time, Int32 xid -> opens
#   'C' Commit           Int8 flags, Int64 commit_lsn @2, Int64 end_lsn @10, Int64 commit_time      -> closes
#   'b' Begin Prepare    Int64 prepare_lsn @1, Int64 end_lsn, Int64 prepare_time, Int32 xid, gid    -> opens
#   'P' Prepare          Int8 flags, Int64 prepare_lsn @2, Int64 end_lsn @10, ...                   -> closes
#   'K' Commit Prepared  Int8 flags, Int64 commit_lsn @2, Int64 end_lsn @10, ...                    standalone
#   'r' Rollback Prep.   Int8 flags, Int64 prepare_end_lsn @2, Int64 rollback_end_lsn @10, ...      standalone
#   'S' Stream Start     Int32 xid, Int8 first_segment                     -> opens a block (LSN: frame wal_start)
#   'E' Stream Stop      (empty)                                           -> closes it (LSN: frame wal_start)
#   'c' Stream Commit    Int32 xid, Int8 flags, Int64 commit_lsn @6, Int64 end_lsn @14, ...         standalone
#   'p' Stream Prepare   Int8 flags, Int64 prepare_lsn @2, Int64 end_lsn @10, ...                   standalone
#   'A' Stream Abort     Int32 xid, Int32 subxid [, Int64 abort_lsn, Int64 abort_time]  standalone (frame wal_start)
# Everything else ('R', 'Y', 'O', 'I', 'U', 'D', 'T', 'M') sits inside a transaction or block,
# except non-transactional 'M' messages, which are positioned by the frame's wal_start.
_BEGIN, _COMMIT, _BEGIN_PREPARE, _PREPARE = b"B"[0], b"C"[0], b"b"[0], b"P"[0]
_STREAM_START, _STREAM_STOP = b"S"[0], b"E"[0]
_INSERT, _UPDATE, _DELETE = b"I"[0], b"U"[0], b"D"[0]
_XLOGDATA, _KEEPALIVE_TAG = b"w"[0], b"k"[0]
#: Standalone messages: tag -> (offset of the record's start LSN or None, offset of its end LSN or None).
#: None means "use the frame's wal_start" (the walsender sets it to the change's position).
_STANDALONE: dict[int, tuple[int | None, int | None]] = {
    b"K"[0]: (2, 10),
    b"r"[0]: (None, 10),
    b"c"[0]: (6, 14),
    b"p"[0]: (2, 10),
    b"A"[0]: (None, None),
}


class XLogData(NamedTuple):
    """One XLogData frame: a single pgoutput message and where it sits in the WAL.

    ``payload`` is a memoryview over libpq's buffer; copy it (``bytes()``) to keep it.
    """

    wal_start: LSN
    wal_end: LSN
    send_time: int  # microseconds since 2000-01-01 UTC
    payload: memoryview


class Keepalive(NamedTuple):
    """A primary keepalive: the walsender has processed the WAL up to ``wal_end``."""

    wal_end: LSN
    send_time: int
    reply_requested: bool


_new_lsn = int.__new__  # LSN(x) without the Python-level range check, for values off the wire
_new_tuple = tuple.__new__


def _resumed(stream: ReplicationStream, received: int) -> float:
    """Back in the drain after handing out an item; returns the time, the drain's new last activity.

    The consumer may have spent long on that item (a Delta write), so a status update is sent
    here if one is due, and the time away counts as activity rather than server silence.
    """
    now = time.monotonic()
    if now >= stream._next_status:
        if received > stream._received:
            stream._received = received
        stream.send_status()
    return now


class ReplicationStream:
    """START_REPLICATION ... LOGICAL over COPY BOTH, read without blocking the process.

    Flush/apply positions sent to the server only ever come from :meth:`confirm`
    (or the slot's own ``confirmed_flush_lsn``), and never go backwards. The
    ``write`` position reported is what has been received, which keeps the
    walsender from pinging a client that is up to date.

    The walsender drops a client it has not heard from for ``wal_sender_timeout``, also
    while that client is busy elsewhere (say, waiting for a Delta write) and not reading.
    Status updates go out every ``status_interval`` seconds, lowered at :meth:`start` to a
    quarter of the server's ``wal_sender_timeout``: the drain checks the clock whenever its
    consumer hands control back, and a consumer that holds on to control for long calls
    :meth:`keepalive` meanwhile. Everything that touches the connection runs on one thread.
    """

    def __init__(
        self,
        conn: ReplicationConnection,
        *,
        status_interval: float = 10.0,
        idle_probe: float = 0.2,
        idle_timeout: float = 120.0,
    ) -> None:
        self._conn = conn
        self._pgconn = conn.pgconn
        self.status_interval = status_interval
        self.idle_probe = idle_probe
        self.idle_timeout = idle_timeout
        self._streaming = False
        self._slot: str | None = None
        self._poller: select.poll | None = None
        self._saved_nonblocking = 0
        # positions, as plain ints on the hot path
        self._received = 0  # highest wal_end seen in XLogData or keepalives
        self._server_wal_end = 0  # wal_end of the latest keepalive
        self._confirmed = 0  # highest LSN the caller declared durable
        self._reported_flush = 0  # highest flush LSN sent to the server
        self._next_status = 0.0
        # protocol state kept across drains
        self._in_txn = False
        self._in_block = False
        self._pending: XLogData | None = None  # a frame peeked at by drain but not handed out
        self._pending_start = 0
        # progress counters
        self.frames = 0
        self.bytes = 0
        self.keepalives = 0
        self.status_updates = 0
        self.discarded = 0  # frames thrown away by stop()

    # -- progress

    @property
    def streaming(self) -> bool:
        return self._streaming

    @property
    def last_received_lsn(self) -> LSN:
        """The highest WAL position received (XLogData or keepalive)."""
        return LSN(self._received)

    @property
    def server_wal_end(self) -> LSN:
        """The walsender's position from its latest keepalive."""
        return LSN(self._server_wal_end)

    @property
    def confirmed_lsn(self) -> LSN:
        """The highest position passed to :meth:`confirm` (or the slot's when streaming started)."""
        return LSN(self._confirmed)

    @property
    def reported_flush_lsn(self) -> LSN:
        """The flush position last sent to the server."""
        return LSN(self._reported_flush)

    @property
    def in_transaction(self) -> bool:
        """A transaction (or streamed block) was begun and not yet closed."""
        return self._in_txn or self._in_block

    # -- lifecycle

    def __enter__(self) -> ReplicationStream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._streaming and not self._conn.closed:
            if exc_type is None:
                self.stop()
            else:
                try:
                    self.stop()
                except PgcdcError:
                    pass

    def start(self, slot: str, start_lsn: LSN = LSN(0), options: PgOutputOptions | None = None) -> None:
        """START_REPLICATION SLOT "slot" LOGICAL start_lsn (options); raises on anything but COPY BOTH.

        The server starts at ``start_lsn`` or the slot's confirmed_flush_lsn, whichever is greater.
        """
        if self._streaming:
            raise ProtocolError("the replication stream is already started", "call stop() first")
        if options is None:
            raise ConfigurationError("START_REPLICATION needs pgoutput options", "pass PgOutputOptions(publication_names=[...])")
        validate_slot_name(slot)
        rendered = options.render(self._conn.server_version_num)
        state = self._conn.read_slot(slot)
        if state is None:
            raise SlotError(f'replication slot "{slot}" does not exist', "create the slot first or check the slot name")
        if state.slot_type != "logical":
            raise SlotError(f'replication slot "{slot}" is not a logical slot', "use a logical slot created for pgoutput")
        if self._conn.in_transaction:
            raise ProtocolError("START_REPLICATION inside a transaction", "commit() the snapshot transaction first")
        if self._conn._replication_started:
            # The walsender does not reset its end-of-streaming flags for a second logical
            # START_REPLICATION: it would end the new stream at once (seen on 15 and 18).
            raise ProtocolError(
                "this connection already ran START_REPLICATION once",
                "open a new ReplicationConnection for each replication stream",
            )
        timeout_ms = self._conn.execute(
            "SELECT setting FROM pg_catalog.pg_settings WHERE name OPERATOR(pg_catalog.=) 'wal_sender_timeout'"
        )[0][0]
        if int(timeout_ms) > 0:
            self.status_interval = min(self.status_interval, int(timeout_ms) / 4000.0)
        floor = int(state.confirmed_flush_lsn or 0)
        self._confirmed = max(self._confirmed, floor)
        self._reported_flush = floor
        self._received = max(floor, int(start_lsn))
        self._in_txn = self._in_block = False
        self._pending = None

        pgconn = self._pgconn
        command = f"START_REPLICATION SLOT {quote_ident(slot)} LOGICAL {LSN(start_lsn)} {rendered}"
        self._saved_nonblocking = pgconn.nonblocking
        pgconn.nonblocking = 1
        try:
            pgconn.send_query(command.encode())
            self._flush(deadline=time.monotonic() + self.idle_timeout)
            res = self._get_result(deadline=time.monotonic() + self.idle_timeout)
        except psycopg.OperationalError as exc:
            raise self._lost(exc) from None
        if res is None or res.status != pq.ExecStatus.COPY_BOTH:
            error = _from_result(res, slot=slot) if res is not None else ProtocolError(
                "START_REPLICATION returned no result", "check the server log"
            )
            self._finish_results()
            pgconn.nonblocking = self._saved_nonblocking
            raise error
        self._streaming = True
        self._conn._replication_started = True
        self._slot = slot
        self._poller = select.poll()
        self._poller.register(pgconn.socket, select.POLLIN)
        # Report where we stand (and any confirm() made before start) right away.
        self.send_status()

    def confirm(self, lsn: LSN) -> None:
        """Declare everything up to ``lsn`` durable: it is reported as flushed from now on.

        Lower values than an earlier confirmation are ignored (the slot never moves back).
        The position is sent with the next status update, at the latest by :meth:`stop`.
        """
        value = int(lsn)
        if value > self._confirmed:
            self._confirmed = value

    def send_status(self, reply_requested: bool = False) -> None:
        """Send a standby status update now: write = received, flush = apply = confirmed."""
        flush = max(self._confirmed, self._reported_flush)
        write = max(self._received, flush)
        message = _STATUS.pack(b"r", write, flush, flush, pg_epoch_micros(), 1 if reply_requested else 0)
        pgconn = self._pgconn
        try:
            while pgconn.put_copy_data(message) == 0:
                self._wait_writable(time.monotonic() + self.idle_timeout)
            self._flush(time.monotonic() + self.idle_timeout)
        except psycopg.OperationalError as exc:
            raise self._lost(exc) from None
        self._reported_flush = flush
        self.status_updates += 1
        self._next_status = time.monotonic() + self.status_interval

    def keepalive(self) -> None:
        """Send a status update if one is due (the same confirmed position, nothing newer).

        For a consumer that keeps the stream without reading it for a while, e.g. while it waits
        for Delta: call it at least every ``status_interval`` seconds, from the thread that
        drains (libpq connections are not to be used by two threads at once).
        """
        if self._streaming and time.monotonic() >= self._next_status:
            self.send_status()

    def stop(self, timeout: float = 60.0) -> None:
        """End the stream (CopyDone), discard what is still in flight, and leave the connection usable."""
        if not self._streaming:
            return
        pgconn = self._pgconn
        deadline = time.monotonic() + timeout
        try:
            self.send_status()
            while pgconn.put_copy_end() == 0:
                self._wait_writable(deadline)
            self._flush(deadline)
            while True:
                nbytes, _ = pgconn.get_copy_data(1)
                if nbytes > 0:
                    self.discarded += 1
                    continue
                if nbytes == 0:
                    self._wait_readable(deadline)
                    pgconn.consume_input()
                    continue
                break  # -1: the server answered with CopyDone
            error = self._finish_results(deadline)
        except psycopg.OperationalError as exc:
            self._streaming = False
            raise self._lost(exc) from None
        finally:
            self._streaming = False
            self._poller = None
            self._pending = None
            if not pgconn.status == pq.ConnStatus.BAD:
                pgconn.nonblocking = self._saved_nonblocking
        if error is not None:
            raise error

    # -- reading

    def read(self, timeout: float | None = None) -> XLogData | Keepalive | None:
        """The next frame (XLogData or Keepalive), or None after ``timeout`` seconds of silence.

        A convenience for tools and tests; :meth:`drain` is the fast path.
        """
        self._require_streaming()
        if self._pending is not None:
            frame, self._pending = self._pending, None
            self._track(frame)
            return frame
        deadline = None if timeout is None else time.monotonic() + timeout
        pgconn = self._pgconn
        while True:
            try:
                nbytes, buf = pgconn.get_copy_data(1)
            except psycopg.OperationalError as exc:
                raise self._lost(exc) from None
            if nbytes > 0:
                kind = buf[0]
                if kind == _XLOGDATA:
                    start, end, sent = _unpack_xlog(buf, 1)
                    self.frames += 1
                    self.bytes += nbytes
                    if end > self._received:
                        self._received = end
                    lsn = _new_lsn(LSN, start)
                    frame = _new_tuple(XLogData, (lsn, lsn if end == start else _new_lsn(LSN, end), sent, buf[_PAYLOAD:]))
                    self._track(frame)
                    return frame
                if kind == _KEEPALIVE_TAG:
                    return self._keepalive(buf)
                raise ProtocolError(f"unexpected replication message type {chr(kind)!r}", "check the server version")
            if nbytes == -1:
                self._end_of_copy()
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return None
            if now >= self._next_status:
                self.send_status()
            wait_until = self._next_status if deadline is None else min(deadline, self._next_status)
            self._wait_readable(wait_until, raise_on_timeout=False)
            self._consume()

    def drain(self, end_lsn: LSN, *, stop: bool = True) -> Iterator[XLogData]:
        """Yield XLogData frames up to ``end_lsn``, ending on a transaction boundary.

        Ends (a) after a Commit/Prepare/Stream Stop or standalone message whose end is at or
        past ``end_lsn``, (b) before a Begin (not yielded) whose commit starts at or past it,
        or (c) on a keepalive at or past it while no transaction is open. With ``stop`` the
        stream is stopped when the drain ends (also on error or when the caller breaks out),
        sending the confirmed position; otherwise the caller calls :meth:`stop` (soon: the
        walsender times out a client that does not read).
        """
        self._require_streaming()
        try:
            yield from self._drain(int(end_lsn))
        finally:
            if stop and self._streaming and not self._conn.closed:
                self.stop()

    def drain_batches(self, end_lsn: LSN, *, stop: bool = True, max_batch_bytes: int = 1 << 20) -> Iterator[XLogData | list[bytes]]:
        """:meth:`drain` for bulk consumers: row changes come in lists of payload bytes.

        Same frames, order and end as :meth:`drain`, except that consecutive Insert/Update/Delete
        messages inside a transaction or streamed block are handed out as one ``list`` of their
        payloads (copied, so they can be kept), without a frame object or LSN per message;
        every other message is yielded as an :class:`XLogData` frame, as by :meth:`drain`. A list
        holds about ``max_batch_bytes`` at most, so a large transaction never piles up here.
        """
        self._require_streaming()
        try:
            yield from self._drain(int(end_lsn), max_batch_bytes)
        finally:
            if stop and self._streaming and not self._conn.closed:
                self.stop()

    def _drain(self, end: int, max_batch_bytes: int = 0) -> Iterator[XLogData | list[bytes]]:
        """The drain loop; with ``max_batch_bytes`` > 0, row changes are batched (:meth:`drain_batches`)."""
        pending = self._pending
        if pending is not None:
            # A frame an earlier drain stopped in front of; _pending_start is where its record starts.
            if self._pending_start >= end:
                return
            self._pending = None
            record_end = self._track(pending)
            yield pending
            if record_end >= end:
                return
        pgconn = self._pgconn
        get = pgconn.get_copy_data
        standalone = _STANDALONE
        in_txn = self._in_txn
        in_block = self._in_block
        frames = 0
        nbytes_total = 0
        received = self._received
        last_activity = time.monotonic()
        probed_at = 0.0
        batching = max_batch_bytes > 0
        batch: list[bytes] = []
        add = batch.append
        batch_bytes = 0
        try:
            while True:
                nbytes, buf = get(1)
                if nbytes > 0:
                    if buf[0] == _XLOGDATA:
                        frames += 1
                        nbytes_total += nbytes
                        if batching:
                            tag = buf[_PAYLOAD]
                            if (tag == _INSERT or tag == _UPDATE or tag == _DELETE) and (in_txn or in_block):
                                # Row changes never end a drain and lie below their commit's LSN, which
                                # `received` takes when the commit arrives: no header unpacking here.
                                add(bytes(buf[_PAYLOAD:]))
                                batch_bytes += nbytes
                                if batch_bytes >= max_batch_bytes:
                                    yield batch
                                    last_activity = _resumed(self, received)
                                    batch = []
                                    add = batch.append
                                    batch_bytes = 0
                                if not frames & 0x3FF:
                                    self.frames += frames
                                    self.bytes += nbytes_total
                                    frames = nbytes_total = 0
                                    now = time.monotonic()
                                    last_activity = now
                                    if now >= self._next_status:
                                        self._received = received
                                        self.send_status()
                                continue
                            if batch:
                                yield batch
                                last_activity = _resumed(self, received)
                                batch = []
                                add = batch.append
                                batch_bytes = 0
                        start, wal_end, sent = _unpack_xlog(buf, 1)
                        if wal_end > received:
                            received = wal_end
                        lsn = _new_lsn(LSN, start)
                        frame = _new_tuple(
                            XLogData, (lsn, lsn if wal_end == start else _new_lsn(LSN, wal_end), sent, buf[_PAYLOAD:])
                        )
                        tag = buf[_PAYLOAD]
                        if in_txn:
                            if tag == _COMMIT or tag == _PREPARE:
                                in_txn = False
                                self._in_txn = False
                                yield frame
                                last_activity = _resumed(self, received)
                                if _unpack_u64(buf, _PAYLOAD + 10)[0] >= end:
                                    return
                            else:
                                yield frame
                                last_activity = _resumed(self, received)
                        elif in_block:
                            if tag == _STREAM_STOP:
                                in_block = False
                                self._in_block = False
                                yield frame
                                last_activity = _resumed(self, received)
                                if start >= end:
                                    return
                            else:
                                yield frame
                                last_activity = _resumed(self, received)
                        elif tag == _BEGIN or tag == _BEGIN_PREPARE:
                            begin_at = _unpack_u64(buf, _PAYLOAD + 1)[0]
                            if begin_at >= end:
                                self._pending, self._pending_start = frame, begin_at
                                return
                            in_txn = True
                            self._in_txn = True
                            yield frame
                            last_activity = _resumed(self, received)
                        elif tag == _STREAM_START:
                            if start >= end:
                                self._pending, self._pending_start = frame, start
                                return
                            in_block = True
                            self._in_block = True
                            yield frame
                            last_activity = _resumed(self, received)
                        else:
                            offsets = standalone.get(tag)
                            if offsets is None:  # e.g. a non-transactional logical message
                                if start >= end:
                                    self._pending, self._pending_start = frame, start
                                    return
                                yield frame
                                last_activity = _resumed(self, received)
                                continue
                            begin_at, end_at = offsets
                            record_end = start if end_at is None else _unpack_u64(buf, _PAYLOAD + end_at)[0]
                            if begin_at is not None:
                                past_end = _unpack_u64(buf, _PAYLOAD + begin_at)[0] >= end
                            elif end_at is not None:
                                # Only the record's end is known ('r'): records never straddle the
                                # flush position, so it started before `end` unless it ends past it.
                                past_end = record_end > end
                            else:
                                past_end = start >= end
                            if past_end:
                                # Any position inside the record serves as its start for the next drain.
                                self._pending, self._pending_start = frame, record_end - 1
                                return
                            yield frame
                            last_activity = _resumed(self, received)
                            if record_end >= end:
                                return
                        if not frames & 0x3FF:
                            self.frames += frames
                            self.bytes += nbytes_total
                            frames = nbytes_total = 0
                            self._received = received
                            now = time.monotonic()
                            last_activity = now
                            if now >= self._next_status:
                                self.send_status()
                        continue
                    if buf[0] == _KEEPALIVE_TAG:
                        self._received = max(received, self._received)
                        keepalive = self._keepalive(buf)
                        received = self._received
                        last_activity = time.monotonic()
                        if keepalive.wal_end >= end and not in_txn and not in_block:
                            return
                        continue
                    raise ProtocolError(
                        f"unexpected replication message type {chr(buf[0])!r}", "check the server version"
                    )
                if nbytes == -1:
                    self._end_of_copy()
                # Nothing buffered: account, maybe report or probe, then wait for the socket.
                self.frames += frames
                self.bytes += nbytes_total
                frames = nbytes_total = 0
                self._received = received
                now = time.monotonic()
                if now >= self._next_status:
                    self.send_status()
                quiet_since = max(last_activity, probed_at)
                if now - quiet_since >= self.idle_probe:
                    # Ask the walsender where it is: it answers with a keepalive carrying wal_end.
                    self.send_status(reply_requested=True)
                    probed_at = now
                    quiet_since = now
                if now - last_activity >= self.idle_timeout:
                    raise ConnectionFailure(
                        f"no message from the server for {self.idle_timeout:.0f} s",
                        "check the server and the network, then retry",
                    )
                wait_until = min(self._next_status, quiet_since + self.idle_probe, last_activity + self.idle_timeout)
                if self._wait_readable(wait_until, raise_on_timeout=False):
                    last_activity = time.monotonic()
                self._consume()
        except psycopg.OperationalError as exc:
            raise self._lost(exc) from None
        finally:
            self.frames += frames
            self.bytes += nbytes_total
            if received > self._received:
                self._received = received

    # -- internals

    def _track(self, frame: XLogData) -> int:
        """Follow transaction state for a frame handed out on the slow path; returns its end LSN."""
        payload = frame.payload
        tag = payload[0]
        start = int(frame.wal_start)
        if tag == _BEGIN or tag == _BEGIN_PREPARE:
            self._in_txn = True
        elif tag == _COMMIT or tag == _PREPARE:
            self._in_txn = False
            return _unpack_u64(payload, 10)[0]
        elif tag == _STREAM_START:
            self._in_block = True
        elif tag == _STREAM_STOP:
            self._in_block = False
        elif not self.in_transaction and tag in _STANDALONE:
            end_at = _STANDALONE[tag][1]
            return start if end_at is None else _unpack_u64(payload, end_at)[0]
        return -1 if self.in_transaction else start

    def _keepalive(self, buf: memoryview) -> Keepalive:
        wal_end, sent, reply = _unpack_keepalive(buf, 1)
        self.keepalives += 1
        self._server_wal_end = wal_end
        if wal_end > self._received:
            self._received = wal_end
        if reply:
            self.send_status()
        return _new_tuple(Keepalive, (_new_lsn(LSN, wal_end), sent, bool(reply)))

    def _require_streaming(self) -> None:
        if not self._streaming:
            raise ProtocolError("the replication stream is not started", "call start() first")

    def _lost(self, exc: BaseException) -> PgcdcError:
        self._streaming = False
        message = _one_line(str(exc)) or "connection lost"
        return ConnectionFailure(f"replication connection lost: {message}", "check the server, then retry")

    def _consume(self) -> None:
        try:
            self._pgconn.consume_input()
        except psycopg.OperationalError as exc:
            raise self._lost(exc) from None

    def _end_of_copy(self) -> None:
        """The server ended COPY BOTH on its own: an error, or a shutdown."""
        self._streaming = False
        error = self._finish_results(time.monotonic() + 10.0)
        if self._pgconn.status == pq.ConnStatus.BAD:
            raise error or ConnectionFailure("replication connection lost", "check the server, then retry")
        self._pgconn.nonblocking = self._saved_nonblocking
        raise error or ConnectionFailure("the server ended the replication stream", "retry once the server is back")

    def _finish_results(self, deadline: float | None = None) -> PgcdcError | None:
        """Read results until None; return the first error among them."""
        error: PgcdcError | None = None
        deadline = deadline or time.monotonic() + self.idle_timeout
        while True:
            try:
                res = self._get_result(deadline)
            except psycopg.OperationalError as exc:
                return error or self._lost(exc)
            if res is None:
                return error
            if res.status == pq.ExecStatus.FATAL_ERROR and error is None:
                error = _from_result(res, slot=self._slot)
            elif res.status in (pq.ExecStatus.COPY_BOTH, pq.ExecStatus.COPY_OUT):
                return error or ProtocolError("unexpected COPY state after the stream ended", "reconnect")
            if self._pgconn.status == pq.ConnStatus.BAD:
                return error or ConnectionFailure("replication connection lost", "check the server, then retry")

    def _get_result(self, deadline: float) -> pq.abc.PGresult | None:
        pgconn = self._pgconn
        while True:
            pgconn.consume_input()
            if not pgconn.is_busy():
                return pgconn.get_result()
            self._wait_readable(deadline)

    def _flush(self, deadline: float) -> None:
        while self._pgconn.flush() == 1:
            self._wait_writable(deadline)

    def _wait_readable(self, deadline: float, raise_on_timeout: bool = True) -> bool:
        timeout = max(0.0, deadline - time.monotonic())
        if self._poller is not None:
            ready = bool(self._poller.poll(timeout * 1000.0))
        else:
            ready = bool(select.select([self._pgconn.socket], [], [], timeout)[0])
        if not ready and raise_on_timeout and time.monotonic() >= deadline:
            raise ConnectionFailure("timed out waiting for the server", "check the server and the network, then retry")
        return ready

    def _wait_writable(self, deadline: float) -> None:
        # Read while waiting: the server may itself be blocked writing to us.
        sock = self._pgconn.socket
        timeout = max(0.0, deadline - time.monotonic())
        readable, writable, _ = select.select([sock], [sock], [], timeout)
        if readable:
            self._pgconn.consume_input()
        elif not writable:
            raise ConnectionFailure("timed out sending to the server", "check the server and the network, then retry")
