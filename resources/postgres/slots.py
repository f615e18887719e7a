"""Replication slots: name validation, and the one version-aware pg_replication_slots query every caller reads a slot with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psycopg

from resources.errors import ConfigurationError, SlotError
from resources.lsn import LSN
from resources.names import SLOT_NAME
from resources.sql import quote_literal


def validate_slot_name(name: str) -> str:
    """Slot names are 1-63 characters of [a-z0-9_], as PostgreSQL requires."""
    if not isinstance(name, str) or not SLOT_NAME.match(name):
        raise SlotError(
            f"invalid replication slot name {name!r}",
            "use 1 to 63 characters from lower-case letters, digits and underscores",
        )
    return name


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
    #: Bytes of WAL that can still be written before the slot risks being lost (None: no limit).
    safe_wal_size: int | None = None
    #: PostgreSQL 17+: a failover slot is synchronized to standbys that run sync_replication_slots.
    failover: bool | None = None
    #: PostgreSQL 17+, on a standby: the slot is a copy synchronized from the primary.
    synced: bool | None = None
    #: PostgreSQL 17+: when the slot was last released (ISO 8601 text), None while in use.
    inactive_since: str | None = None

    @property
    def invalidated(self) -> bool:
        """PostgreSQL gave the slot up: the changes it held are gone."""
        return self.wal_status == "lost" or self.invalidation_reason is not None


#: What each invalidation_reason means, and what keeps it from happening again.
INVALIDATION_CAUSES: dict[str, tuple[str, str]] = {
    "wal_removed": (
        "the WAL it needed was removed (it fell more than max_slot_wal_keep_size behind)",
        "drain more often or raise max_slot_wal_keep_size",
    ),
    "idle_timeout": (
        "no one read it for longer than idle_replication_slot_timeout",
        "raise idle_replication_slot_timeout above the longest gap between drains",
    ),
    "rows_removed": (
        "catalog rows its decoding needed were vacuumed away",
        "keep hot_standby_feedback on and a physical slot for the standby",
    ),
    "wal_level_insufficient": (
        "wal_level on the primary dropped below logical",
        "keep wal_level = logical on the primary",
    ),
}

FAILOVER_MIN_VERSION_NUM = 170000
"""Failover slots (CREATE_REPLICATION_SLOT ... (FAILOVER), slot synchronization) are new in PostgreSQL 17."""


def require_failover_slots(server_version_num: int) -> None:
    """Refuse failover slots on a server older than PostgreSQL 17, naming its version."""
    if server_version_num < FAILOVER_MIN_VERSION_NUM:
        raise ConfigurationError(
            f"slot_failover needs PostgreSQL 17 or newer, the source runs PostgreSQL {server_version_num // 10000}",
            "set slot_failover: false, or upgrade the source to PostgreSQL 17+",
        )


def invalidated_slot(state: SlotState, fix: str) -> SlotError:
    """The one-line error for an invalidated slot: its wal_status, why PostgreSQL gave it up, and ``fix``.

    ``fix`` is how the caller's user recovers (re-snapshot); what keeps the cause from
    recurring is appended when PostgreSQL names it (17+).
    """
    reason = state.invalidation_reason
    cause, prevention = INVALIDATION_CAUSES.get(reason or "", (None, None))
    why = f", {reason}" if reason else ""
    because = f" because {cause}" if cause else ""
    then = f"; then {prevention}" if prevention else ""
    return SlotError(
        f'replication slot "{state.slot_name}" is invalidated (wal_status {state.wal_status}{why}){because};'
        " the changes it held are gone",
        f"{fix}{then}",
    )


#: Where WAL stands for a slot's reader: the primary's flushed WAL, or on a standby (which can decode
#: logically from PostgreSQL 16 on) the WAL it has replayed, which is all its walsenders decode.
WAL_POSITION_SQL = (
    "SELECT (CASE WHEN pg_catalog.pg_is_in_recovery() THEN pg_catalog.pg_last_wal_replay_lsn()"
    " ELSE pg_catalog.pg_current_wal_flush_lsn() END)::pg_catalog.text"
)


def wal_position(conn: psycopg.Connection) -> LSN:
    """The WAL position of :data:`WAL_POSITION_SQL`, over a normal connection."""
    row = conn.execute(WAL_POSITION_SQL).fetchone()
    assert row is not None and row[0] is not None
    return LSN.parse(row[0])


def lsn_or_none(text: str | None) -> LSN | None:
    return None if text is None else LSN.parse(text)


def slot_state_query(name: str, server_version_num: int) -> str:
    """The SELECT of slot ``name``'s row in pg_replication_slots, with the slot name inlined.

    Inlined (no parameters) because a walsender speaks only the simple query protocol; the
    name is validated and quoted. Read the rows with :func:`slot_state`.
    """
    validate_slot_name(name)
    two_phase = "two_phase" if server_version_num >= 140000 else "NULL::pg_catalog.bool"
    if server_version_num >= FAILOVER_MIN_VERSION_NUM:
        since_17 = "invalidation_reason, failover, synced, inactive_since::pg_catalog.text"
    else:
        since_17 = "NULL::pg_catalog.text, NULL::pg_catalog.bool, NULL::pg_catalog.bool, NULL::pg_catalog.text"
    return (
        "SELECT slot_name::pg_catalog.text, plugin::pg_catalog.text, slot_type, database::pg_catalog.text,"
        " temporary, active, active_pid, restart_lsn::pg_catalog.text, confirmed_flush_lsn::pg_catalog.text,"
        f" wal_status, {two_phase}, safe_wal_size, {since_17} FROM pg_catalog.pg_replication_slots"
        f" WHERE slot_name OPERATOR(pg_catalog.=) {quote_literal(name)}::pg_catalog.name"
    )


def slot_state(rows: Sequence[tuple]) -> SlotState | None:
    """The :class:`SlotState` in the rows of :func:`slot_state_query`; None when there are none."""
    if not rows:
        return None
    (
        (
            slot_name,
            plugin,
            slot_type,
            database,
            temporary,
            active,
            pid,
            restart,
            confirmed,
            wal_status,
            tp,
            safe,
            why,
            failover,
            synced,
            since,
        ),
    ) = rows
    return SlotState(
        slot_name, plugin, slot_type, database, temporary, active, pid,
        lsn_or_none(restart), lsn_or_none(confirmed), wal_status, tp, why,
        None if safe is None else int(safe), failover, synced, since,
    )  # fmt: skip


def read_slot(conn: psycopg.Connection, name: str) -> SlotState | None:
    """Slot ``name``'s row over a normal connection; None when there is no such slot.

    A plain query: watching a slot never opens a walsender and never moves the slot. A
    replication connection reads the same row with ``ReplicationConnection.read_slot``.
    """
    return slot_state(conn.execute(slot_state_query(name, conn.info.server_version)).fetchall())


class SlotInUseError(SlotError):
    """Another consumer is reading the slot (``pid``: its walsender's)."""

    def __init__(self, cause: str, fix: str, slot: str, pid: object) -> None:
        super().__init__(cause, fix)
        self.slot = slot
        self.pid = pid


def slot_in_use(slot: str, pid: object, holder: str | None = None) -> SlotInUseError:
    """The error for a slot another consumer is reading (also when START_REPLICATION finds it so);
    ``holder`` names it (:func:`slot_holder`)."""
    return SlotInUseError(
        f'replication slot "{slot}" is in use by PID {pid}' + (f" ({holder})" if holder else ""),
        "another run or consumer is reading it (a second drain of one slot cannot run beside the first): wait "
        "for it to finish and retry, or stop the other consumer",
        slot,
        pid,
    )


def slot_holder(conn: psycopg.Connection, pid: object) -> str | None:
    """Who a walsender serves, as pg_stat_activity says: its application name (a pgcdc drain names its
    run there), client address and start; None when it is gone."""
    try:
        row = conn.execute(
            "SELECT application_name, client_addr::pg_catalog.text, backend_start::pg_catalog.timestamptz(0)::pg_catalog.text"
            " FROM pg_catalog.pg_stat_activity WHERE pid OPERATOR(pg_catalog.=) %s::pg_catalog.int4",
            (int(str(pid)),),
        ).fetchone()
    except (ValueError, psycopg.Error):
        return None
    if row is None:
        return None
    name, address, since = row
    return f"{name or 'an unnamed client'}" + (f" from {address}" if address else "") + f", since {since}"
