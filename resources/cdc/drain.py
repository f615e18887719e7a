"""The drain loop of an incremental run: stream batches -> transactions -> the applier, confirming only what Delta holds."""

from __future__ import annotations

import time
from collections.abc import Callable

from resources.cdc.applier import ChangeApplier
from resources.cdc.change_source import ChangeSource
from resources.cdc.transactions import TransactionAssembler
from resources.crash_points import fault_point
from resources.errors import SlotError
from resources.lsn import LSN
from resources.pgoutput.options import PgOutputOptions
from resources.postgres.slots import slot_in_use
from resources.postgres.stream import ReplicationStream


def drain(
    stream: ChangeSource,
    assembler: TransactionAssembler,
    applier: ChangeApplier,
    end_lsn: LSN,
    say: Callable[[str], None],
    started: float,
    before_final_confirm: Callable[[], None] | None = None,
    before_confirm: Callable[[LSN], None] | None = None,
) -> None:
    """The main loop over ``stream`` (the slot's stream, or a recording in server-free tests); on any error the stream stops having confirmed only durable positions.

    ``before_final_confirm`` runs once every change below ``end_lsn`` is durable in Delta and
    before the last confirm (the run records the state of the tables it wrote): a crash in it
    leaves the last chunk unconfirmed, so the next run replays it.

    ``before_confirm`` hears every position before the slot is confirmed there, only when the
    position moves (once per durable chunk): the run records it in the lake first
    (``resources/runs/slot_guard.py``), so the slot is never confirmed beyond the record."""
    feed = assembler.feed
    feed_rows = assembler.feed_rows
    confirmed = stream.confirmed_lsn
    next_report = time.monotonic() + PROGRESS_SECONDS

    def confirm(position: LSN) -> None:
        nonlocal confirmed
        if position > confirmed:
            fault_point("after_delta_commit")
            if before_confirm is not None:
                before_confirm(position)
                fault_point("after_slot_record")
            stream.confirm(position)
            stream.send_status()
            confirmed = position
            fault_point("after_confirm")

    try:
        for item in stream.drain_batches(end_lsn, stop=False):
            if isinstance(item, list):  # row changes inside a transaction: kept undecoded
                feed_rows(item)
                continue
            txn = feed(item.payload, item.wal_start)
            if txn is None:
                continue
            if not applier.fits(txn):
                applier.flush()
            applier.add(txn)
            confirm(applier.durable_lsn())  # moves when a background Delta write completes
            now = time.monotonic()
            if now >= next_report:
                next_report = now + PROGRESS_SECONDS
                elapsed = now - started
                say(
                    f"{applier.transactions} transactions, {applier.changes_applied} changes applied "
                    f"({applier.changes_applied / elapsed:,.0f}/s), {applier.pending_changes} pending, "
                    f"at {txn.end_lsn} of {end_lsn}"
                )
        applier.flush()
        durable = applier.finish()
        if before_final_confirm is not None:
            before_final_confirm()
        # Everything committed before end_lsn has been applied: confirm at least end_lsn so an
        # idle slot advances (see the module docstring for why this loses nothing).
        confirm(max(durable, end_lsn))
    except BaseException:
        try:
            applier.close()
            if stream.streaming:
                stream.stop()
        except Exception:  # noqa: BLE001 - the first failure is the one to report
            pass
        raise
    applier.close()
    stream.stop()


def start_streaming(stream: ReplicationStream, slot: str, options: PgOutputOptions, checked: LSN | None = None) -> None:
    """Start the slot's stream. ``checked``: the slot's position when the run checked it (against the
    position pgcdc recorded, ``resources/runs/slot_guard.py``); a slot found beyond it now was moved by
    another consumer in between, and the stream stops before anything is read or confirmed (the next
    drain finds the slot beyond the record and refuses with the fix)."""
    try:
        stream.start(slot, options=options)
    except SlotError as exc:
        if "active for PID" in exc.cause:
            raise slot_in_use(slot, exc.cause.rsplit(" ", 1)[-1]) from None
        raise
    if checked is not None and stream.confirmed_lsn > checked:
        moved = stream.confirmed_lsn
        stream.stop()
        raise SlotError(
            f'replication slot "{slot}" moved from {checked} to {moved} while this drain started, by another'
            " consumer of the slot; nothing was applied or confirmed",
            "run the drain again: it names the fix",
        )


PROGRESS_SECONDS = 5.0
