"""Checks run before a slot is read, so bad input fails with the fix and moves nothing.

PostgreSQL reports some of these problems late or not at all: PostgreSQL 18
streams nothing, without an error, for a publication that does not exist, and a
slot of another output plugin fails only after streaming has begun.
"""

from __future__ import annotations

from collections.abc import Sequence

from resources.errors import ConfigurationError, SlotError
from resources.replication import ReplicationConnection, SlotState, quote_literal

MIN_SERVER_VERSION_NUM = 140000


def check_server(conn: ReplicationConnection) -> None:
    """The server must decode logically and speak a pgoutput protocol we support."""
    version = conn.server_version_num
    if version < MIN_SERVER_VERSION_NUM:
        raise ConfigurationError(
            f"PostgreSQL {version // 10000} is too old for pgcdc", "upgrade the source to PostgreSQL 14 or newer"
        )
    ((wal_level,),) = conn.execute("SHOW wal_level")
    if wal_level != "logical":
        raise ConfigurationError(
            f"wal_level is {wal_level!r}, logical decoding needs 'logical'",
            "ALTER SYSTEM SET wal_level = logical, then restart PostgreSQL",
        )


def check_publications(conn: ReplicationConnection, publications: Sequence[str]) -> None:
    """Every publication must exist in the connected database."""
    wanted = ", ".join(quote_literal(name) for name in publications)
    found = {name for (name,) in conn.execute(f"SELECT pubname FROM pg_publication WHERE pubname IN ({wanted})")}
    for name in publications:
        if name not in found:
            raise ConfigurationError(
                f'publication "{name}" does not exist in this database',
                f'CREATE PUBLICATION "{name}" FOR TABLE ..., or fix the publication name',
            )


def check_slot(conn: ReplicationConnection, slot: str) -> SlotState:
    """The slot must exist here, decode with pgoutput, be valid, and be free."""
    state = conn.read_slot(slot)
    if state is None:
        raise SlotError(
            f'replication slot "{slot}" does not exist', "create it (pgcdc changes --create-slot) or fix the slot name"
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
    if state.wal_status == "lost":
        raise SlotError(
            f'replication slot "{slot}" was invalidated (wal_status lost): the WAL it needed is gone',
            "drop and recreate the slot, then re-snapshot every table (pgcdc_resnapshot job)",
        )
    if state.active:
        raise SlotError(
            f'replication slot "{slot}" is in use by PID {state.active_pid}',
            "stop the other consumer or wait for its run to finish",
        )
    return state
