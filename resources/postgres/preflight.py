"""Checks run before a slot is read, so bad input fails with the fix and moves nothing.

PostgreSQL reports some of these problems late or not at all: PostgreSQL 18
streams nothing, without an error, for a publication that does not exist, and a
slot of another output plugin fails only after streaming has begun.

The one set of checks (and messages) for every reader of a slot: ``pgcdc changes`` and
the incremental run (``resources/runs/incremental.py``) both call :func:`check_server`,
:func:`check_publications` and :func:`check_slot`, in that order.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import psycopg

from resources.errors import ConfigurationError, SlotError
from resources.names import RESNAPSHOT_JOB, SNAPSHOT_JOB
from resources.postgres.replication import CreatedSlot, ReplicationConnection
from resources.postgres.slots import invalidated_slot, require_failover_slots, slot_in_use, SlotState

MIN_SERVER_VERSION_NUM = 150000


def check_server(conn: ReplicationConnection) -> None:
    """The server must decode logically and speak a pgoutput protocol we support."""
    version = conn.server_version_num
    if version < MIN_SERVER_VERSION_NUM:
        raise ConfigurationError(
            f"PostgreSQL {version // 10000} is too old for pgcdc", "upgrade the source to PostgreSQL 15 or newer"
        )
    ((wal_level,),) = conn.execute("SHOW wal_level")
    if wal_level != "logical":
        raise ConfigurationError(
            f"wal_level is {wal_level!r}, logical decoding needs 'logical'",
            "ALTER SYSTEM SET wal_level = logical, then restart PostgreSQL",
        )


def check_slot(conn: ReplicationConnection, slot: str) -> SlotState:
    """The slot must exist here, decode with pgoutput, be valid, and be free."""
    state = conn.read_slot(slot)
    if state is None:
        raise SlotError(
            f'replication slot "{slot}" does not exist',
            f"create it (run the {SNAPSHOT_JOB} job, or pgcdc changes --create-slot) or fix the slot name",
        )
    database = conn.identify_system().dbname
    if state.slot_type != "logical" or state.database != database:
        raise SlotError(
            f'replication slot "{slot}" is a {state.slot_type} slot of database {state.database!r}',
            f"use a logical slot created in database {database!r}",
        )
    if state.plugin != "pgoutput":
        raise SlotError(
            f'replication slot "{slot}" uses output plugin {state.plugin!r}, not pgoutput',
            "drop it and create it again with pgoutput, or use another slot name",
        )
    if state.invalidated or state.confirmed_flush_lsn is None:
        raise invalidated_slot(
            state,
            f"run the {RESNAPSHOT_JOB} job (it recreates the slot and copies every table afresh),"
            " or drop and recreate the slot and re-snapshot every table",
        )
    if state.active:
        raise slot_in_use(slot, state.active_pid)
    return state


def ensure_failover(conn: ReplicationConnection, state: SlotState) -> SlotState:
    """Turn failover on for an existing slot that lacks it (ALTER_REPLICATION_SLOT, PostgreSQL 17+)."""
    require_failover_slots(conn.server_version_num)
    if state.failover:
        return state
    conn.set_slot_failover(state.slot_name)
    return replace(state, failover=True)


def ensure_slot(dsn: str, slot: str, *, failover: bool = False) -> CreatedSlot | SlotState:
    """Create the permanent pgoutput slot if missing; refuse one that cannot serve pgcdc.

    Run before any table is copied: every table's snapshot LSN is then at or after the
    slot's start, so the stream covers every change a snapshot misses. With ``failover``
    (PostgreSQL 17+) the slot is created as a failover slot, or an existing one is turned
    into one.
    """
    with ReplicationConnection(dsn, application_name="pgcdc") as conn:
        if failover:
            require_failover_slots(conn.server_version_num)
            ((in_recovery,),) = conn.execute("SELECT pg_catalog.pg_is_in_recovery()")
            if in_recovery:
                raise ConfigurationError(
                    "slot_failover is set but postgres.dsn points at a standby: only a primary's slot can fail over",
                    "point postgres.dsn at the primary (a multi-host DSN with target_session_attrs=read-write),"
                    " or set slot_failover: false to decode on the standby",
                )
        state = conn.read_slot(slot)
        if state is None:
            return conn.create_slot(slot, snapshot="nothing", failover=failover)
        ((database,),) = conn.execute("SELECT pg_catalog.current_database()::pg_catalog.text")
        _check_usable(state, slot, database)
        if failover:
            state = ensure_failover(conn, state)
    return state


def _check_usable(state: SlotState, slot: str, database: str) -> None:
    """Refuse, with the one-line reason, a slot pgcdc cannot take over."""
    if state.slot_type != "logical":
        raise SlotError(
            f'replication slot "{slot}" is a physical slot',
            "choose another slot name in 'slot' (pgcdc needs a logical pgoutput slot)",
        )
    if state.database != database:
        raise SlotError(
            f'replication slot "{slot}" belongs to database "{state.database}", not "{database}"',
            "choose another slot name in 'slot' or point the DSN at that database",
        )
    if state.plugin != "pgoutput":
        raise SlotError(
            f'replication slot "{slot}" uses output plugin {state.plugin}, not pgoutput',
            "choose another slot name in 'slot', or drop that slot if nothing else uses it",
        )
    if state.temporary:
        raise SlotError(
            f'replication slot "{slot}" is a temporary slot of another session',
            "choose another slot name in 'slot'",
        )
    if state.invalidated:
        raise invalidated_slot(
            state,
            f"drop it (SELECT pg_drop_replication_slot('{slot}')) and run the snapshot again, "
            "which recreates it and copies every table afresh",
        )


IDLE_TIMEOUT_MARGIN = 2
"""The slot must survive this many schedule gaps idle: one missed or late drain must not lose it."""


def idle_timeout_risk(conn: psycopg.Connection, slot: str, schedule_gap: timedelta) -> SlotError | None:
    """Why PostgreSQL 18's idle_replication_slot_timeout can invalidate the slot between drains; None when it cannot.

    The slot idles from the end of one drain to the start of the next; PostgreSQL invalidates
    it at a checkpoint once it has idled longer than the timeout (0, the default, never does).
    """
    row = conn.execute(
        "SELECT setting::pg_catalog.int8 FROM pg_catalog.pg_settings"
        " WHERE name OPERATOR(pg_catalog.=) 'idle_replication_slot_timeout'"
    ).fetchone()
    if row is None or not row[0]:
        return None
    timeout = int(row[0])
    gap = int(schedule_gap.total_seconds())
    needed = IDLE_TIMEOUT_MARGIN * gap
    if timeout >= needed:
        return None
    return SlotError(
        f"idle_replication_slot_timeout is {timeout} s, less than {IDLE_TIMEOUT_MARGIN} x the schedule's longest gap"
        f' between drains ({gap} s): PostgreSQL can invalidate slot "{slot}" while it waits for a drain,'
        " and every table must then be re-snapshotted",
        f"raise it to at least {needed} s (ALTER SYSTEM SET idle_replication_slot_timeout = '{needed}s';"
        " SELECT pg_reload_conf()), or set it to 0",
    )
