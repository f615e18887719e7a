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
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

import psycopg
from psycopg import pq

from resources.errors import ConfigurationError
from resources.lsn import LSN
from resources.postgres.connections import connect, from_psycopg
from resources.postgres.slots import (
    require_failover_slots,
    slot_state,
    slot_state_query,
    SlotState,
    validate_slot_name,
)
from resources.sql import quote_ident, quote_literal

__all__ = [
    "CreatedSlot",
    "ReplicationConnection",
    "SystemIdentity",
]

SnapshotAction = Literal["export", "use", "nothing"]


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

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
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
            raise from_psycopg(exc, slot=slot, conn=self._conn) from None

    def identify_system(self) -> SystemIdentity:
        """IDENTIFY_SYSTEM: system id, timeline, current WAL flush position, database."""
        ((systemid, timeline, xlogpos, dbname),) = self.execute("IDENTIFY_SYSTEM")
        return SystemIdentity(str(systemid), int(timeline), LSN.parse(xlogpos), dbname)

    def create_slot(
        self,
        name: str,
        *,
        temporary: bool = False,
        plugin: str = "pgoutput",
        snapshot: SnapshotAction = "nothing",
        two_phase: bool = False,
        failover: bool = False,
    ) -> CreatedSlot:
        """CREATE_REPLICATION_SLOT ... LOGICAL; ``snapshot='use'`` needs begin_snapshot_transaction() first.

        With ``snapshot='export'`` the snapshot stays importable until this
        connection runs its next command or closes. ``failover`` (PostgreSQL 17+) lets
        standbys running ``sync_replication_slots`` keep a copy of the slot, so it survives
        a promotion.
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
        if version < 150000:
            raise ConfigurationError(f"PostgreSQL {version // 10000} is too old", "use PostgreSQL 15 or newer")
        if failover:
            require_failover_slots(version)
        words = [f"CREATE_REPLICATION_SLOT {quote_ident(name)}"]
        if temporary:
            words.append("TEMPORARY")
        words.append(f"LOGICAL {plugin}")
        if version >= 150000:
            opts = [f"SNAPSHOT {quote_literal(snapshot)}"]
            if two_phase:
                opts.append("TWO_PHASE")
            if failover:
                opts.append("FAILOVER")
            words.append("(" + ", ".join(opts) + ")")
        else:
            words.append({"export": "EXPORT_SNAPSHOT", "use": "USE_SNAPSHOT", "nothing": "NOEXPORT_SNAPSHOT"}[snapshot])
            if two_phase:
                words.append("TWO_PHASE")
        ((slot_name, consistent_point, snapshot_name, output_plugin),) = self.execute(" ".join(words), slot=name)
        return CreatedSlot(slot_name, LSN.parse(consistent_point), snapshot_name or None, output_plugin)

    def drop_slot(self, name: str, wait: bool = True) -> None:
        """DROP_REPLICATION_SLOT; with ``wait`` it waits for an active slot to be released."""
        validate_slot_name(name)
        self.execute(f"DROP_REPLICATION_SLOT {quote_ident(name)}{' WAIT' if wait else ''}", slot=name)

    def set_slot_failover(self, name: str, failover: bool = True) -> None:
        """ALTER_REPLICATION_SLOT name (FAILOVER ...): turn synchronization to standbys on or off (17+).

        The slot must be free: PostgreSQL acquires it to change it.
        """
        validate_slot_name(name)
        require_failover_slots(self.server_version_num)
        self.execute(f"ALTER_REPLICATION_SLOT {quote_ident(name)} (FAILOVER {str(failover).lower()})", slot=name)

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
