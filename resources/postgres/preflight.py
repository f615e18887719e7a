"""Checks run before a slot is read, so bad input fails with the fix and moves nothing.

PostgreSQL reports some of these problems late or not at all: PostgreSQL 18
streams nothing, without an error, for a publication that does not exist, and a
slot of another output plugin fails only after streaming has begun.

The one set of checks (and messages) for every reader of a slot: ``pgcdc changes`` and
the incremental run (``resources/incremental.py``) both call :func:`check_server`,
:func:`check_publications` and :func:`check_slot`, in that order.
"""

from __future__ import annotations

from resources.errors import ConfigurationError, SlotError
from resources.names import RESNAPSHOT_JOB, SNAPSHOT_JOB
from resources.postgres.replication import CreatedSlot, ReplicationConnection
from resources.postgres.slots import slot_in_use, SlotState

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
    if state.wal_status == "lost" or state.invalidation_reason is not None or state.confirmed_flush_lsn is None:
        reason = f", {state.invalidation_reason}" if state.invalidation_reason else ""
        raise SlotError(
            f'replication slot "{slot}" is invalidated (wal_status {state.wal_status}{reason}): the changes it held are gone',
            f"run the {RESNAPSHOT_JOB} job (it recreates the slot and copies every table afresh),"
            " or drop and recreate the slot and re-snapshot every table",
        )
    if state.active:
        raise slot_in_use(slot, state.active_pid)
    return state


def ensure_slot(dsn: str, slot: str) -> CreatedSlot | SlotState:
    """Create the permanent pgoutput slot if missing; refuse one that cannot serve pgcdc.

    Run before any table is copied: every table's snapshot LSN is then at or after the
    slot's start, so the stream covers every change a snapshot misses.
    """
    with ReplicationConnection(dsn, application_name="pgcdc") as conn:
        state = conn.read_slot(slot)
        if state is None:
            return conn.create_slot(slot, snapshot="nothing")
        (database,), = conn.execute("SELECT pg_catalog.current_database()::pg_catalog.text")
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
    if state.wal_status == "lost" or state.invalidation_reason is not None:
        why = f", {state.invalidation_reason}" if state.invalidation_reason else ""
        reason = f"wal_status {state.wal_status}{why}"
        raise SlotError(
            f'replication slot "{slot}" is invalidated ({reason}): changes since its position are gone',
            f"drop it (SELECT pg_drop_replication_slot('{slot}')) and run the snapshot again, "
            "which recreates it and copies every table afresh",
        )
    return state
