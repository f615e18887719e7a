"""Is a failover slot ready for a failover? What the primary and a standby say about it.

A failover slot (PostgreSQL 17+) survives a promotion only once a standby running
``sync_replication_slots`` holds a synchronized, persistent copy of it. Until then a failover
loses the slot and every table must be re-snapshotted. The primary's
``synchronized_standby_slots`` makes logical walsenders wait until the standbys behind the
named physical slots have received the WAL they send: without it a drain can confirm
changes no standby has yet, and a promoted standby would lack changes Delta already holds.

Nothing here fails a drain, not even an unreachable standby: the slot works without one. The incremental run logs these
problems as warnings and the slot-health sensor fails its tick with them.
"""

from __future__ import annotations

import psycopg

from resources.errors import explain, mask_dsn, PgcdcError, SlotError
from resources.postgres.connections import connect
from resources.postgres.slots import read_slot, SlotState

SYNC_SETTINGS_FIX = (
    "on the standby set sync_replication_slots = on, hot_standby_feedback = on, primary_slot_name,"
    " and a dbname in primary_conninfo; a new slot is copied once a drain has moved it"
)


def failover_problems(primary: psycopg.Connection, state: SlotState, standby_dsn: str | None) -> list[SlotError]:
    """Why slot ``state`` would not survive a failover now, each a one-line cause and fix; empty when it would.

    ``primary`` is a connection to the server the slot lives on; ``standby_dsn`` (optional) a
    standby to check for the synchronized copy. Without it only the primary's side is checked.
    """
    slot = state.slot_name
    problems: list[SlotError] = []
    if not state.failover:
        problems.append(
            SlotError(
                f'replication slot "{slot}" is not a failover slot: no standby keeps a copy of it',
                "set slot_failover: true (the next drain or snapshot turns it on)",
            )
        )
    problems.extend(_primary_problems(primary))
    if standby_dsn is not None:
        problems.extend(_standby_problems(standby_dsn, slot))
    return problems


def _setting(conn: psycopg.Connection, name: str) -> str | None:
    row = conn.execute("SELECT pg_catalog.current_setting(%s, true)", (name,)).fetchone()
    return None if row is None else row[0]


def _primary_problems(primary: psycopg.Connection) -> list[SlotError]:
    """``synchronized_standby_slots`` must name physical slots that standbys stream through."""
    listed = _setting(primary, "synchronized_standby_slots") or ""
    names = [name.strip().strip('"') for name in listed.split(",") if name.strip()]
    if not names:
        return [
            SlotError(
                "synchronized_standby_slots is empty on the primary: a drain can confirm changes no standby has"
                " received, and a promoted standby would lack changes Delta already holds",
                "set it to the standby's physical slot (ALTER SYSTEM SET synchronized_standby_slots = '<slot>';"
                " SELECT pg_reload_conf())",
            )
        ]
    problems: list[SlotError] = []
    for name in names:
        physical = read_slot(primary, name)
        if physical is None or physical.slot_type != "physical":
            problems.append(
                SlotError(
                    f'synchronized_standby_slots names "{name}", which is not a physical slot on the primary,'
                    " so every drain waits for it",
                    "create it for the standby (pg_create_physical_replication_slot) or remove it from the list",
                )
            )
        elif physical.invalidated or not physical.active:
            what = "invalidated" if physical.invalidated else "not in use (no standby streams through it)"
            problems.append(
                SlotError(
                    f'standby slot "{name}" in synchronized_standby_slots is {what}, so drains wait for it',
                    "start the standby with primary_slot_name = '" + name + "', or remove the slot from the list",
                )
            )
    return problems


def _standby_problems(standby_dsn: str, slot: str) -> list[SlotError]:
    """The standby must be in recovery, synchronize slots, and hold a persistent, valid, synced copy."""
    where = mask_dsn(standby_dsn)
    try:
        with connect(standby_dsn, application_name="pgcdc-failover-check") as standby:
            ((in_recovery,),) = standby.execute("SELECT pg_catalog.pg_is_in_recovery()").fetchall()
            sync = _setting(standby, "sync_replication_slots")
            copy = read_slot(standby, slot)
    except (psycopg.Error, PgcdcError) as error:  # a standby that is down must not fail a drain
        reason = explain(error, standby_dsn)
        return [
            SlotError(
                f"cannot check the slot's copy on the standby {where} ({reason.cause})",
                f"{reason.fix}; or fix postgres.standby_dsn",
            )
        ]
    if not in_recovery:
        return [
            SlotError(
                f"postgres.standby_dsn ({where}) is not a standby: it was promoted or is another primary",
                "point postgres.standby_dsn at the current standby",
            )
        ]
    if sync != "on":
        return [SlotError(f"sync_replication_slots is {sync or 'missing'} on the standby {where}", SYNC_SETTINGS_FIX)]
    if copy is None or copy.temporary:
        state = "has no copy" if copy is None else "has only a temporary copy"
        return [
            SlotError(
                f'replication slot "{slot}" is not yet synchronized to the standby {where} (it {state}):'
                " a failover now would lose it",
                SYNC_SETTINGS_FIX,
            )
        ]
    if not copy.synced:
        return [
            SlotError(
                f'the standby {where} has its own slot named "{slot}", not a copy synchronized from the primary',
                "drop that slot on the standby; the standby then synchronizes the primary's",
            )
        ]
    if copy.invalidated:
        return [
            SlotError(
                f'the standby {where} holds an invalidated copy of slot "{slot}" ({copy.invalidation_reason}):'
                " a failover now would lose the slot",
                "rebuild the standby (pg_basebackup) so it copies the slot afresh, with hot_standby_feedback = on"
                " and primary_slot_name set so it stays valid",
            )
        ]
    return []
