"""Replication slots: name validation, and the one version-aware pg_replication_slots query every caller reads a slot with."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import psycopg

from resources.errors import SlotError
from resources.lsn import LSN
from resources.postgres.sql import quote_literal


SLOT_NAME = re.compile(r"^[a-z0-9_]{1,63}$")


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


def lsn_or_none(text: str | None) -> LSN | None:
    return None if text is None else LSN.parse(text)


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
        lsn_or_none(restart), lsn_or_none(confirmed), wal_status, tp, why,
    )  # fmt: skip


def read_slot(conn: psycopg.Connection, name: str) -> SlotState | None:
    """Slot ``name``'s row over a normal connection; None when there is no such slot.

    A plain query: watching a slot never opens a walsender and never moves the slot. A
    replication connection reads the same row with ``ReplicationConnection.read_slot``.
    """
    return slot_state(conn.execute(slot_state_query(name, conn.info.server_version)).fetchall())


def slot_in_use(slot: str, pid: object) -> SlotError:
    """The error for a slot another consumer is reading (also when START_REPLICATION finds it so)."""
    return SlotError(
        f'replication slot "{slot}" is in use by PID {pid}',
        "another run or consumer is reading it; stop the other consumer or wait for it to finish",
    )
