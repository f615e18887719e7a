"""One incremental run: drain the permanent slot up to where WAL stood at the start, apply, confirm.

The order that makes it exactly-once (argued in docs/contracts.md):

1. Preflight, read-only (``resources/postgres/preflight.py``, shared with ``pgcdc changes``): server (version,
   wal_level), publication, slot (exists, pgoutput, this database, not lost, not in use). PostgreSQL 18
   streams nothing for a missing publication instead of failing, so that check is ours. Then the tables to replicate, the pgcdc state table (one read) and
   the snapshot markers of the tables it does not list: when no table has a snapshot,
   delta.root is most likely wrong and the run refuses (confirming would skip every pending
   change for good). A listed table's own log is read only when a change for it arrives.
2. ``end_lsn`` = IDENTIFY_SYSTEM's xlogpos: the WAL *flush* position, i.e. everything the
   walsender can decode right now. A transaction committed with synchronous_commit=off
   may lie just beyond it; the next run picks it up. (pg_current_wal_lsn() could point
   at WAL not yet flushed, making the drain wait for the WAL writer.)
3. Stream the slot from its confirmed_flush_lsn up to end_lsn, assemble transactions
   (``resources.cdc.transactions``), batch them per table (``resources.cdc.applier``).
4. Per chunk, ending at a transaction boundary: every table's batch is committed to
   Delta, *then* the chunk's last commit end LSN is confirmed to the slot. A crash in
   between replays the chunk, which the Delta writes absorb (MERGE of final images per
   key; append markers for keyless tables).
5. At the end, with nothing left below end_lsn, record the state rows of the tables whose
   log the run read, then confirm max(last commit end, end_lsn), so an idle slot (or one
   whose changes are all for other tables) still advances.

Tables whose Delta table has no snapshot marker yet are left alone and their changes skipped: confirming
past them is safe because their snapshot, taken later, starts at a consistent point beyond everything confirmed now.

While the run waits for Delta, nothing reads the replication stream: the waits call ``ReplicationStream.keepalive``
(status updates with the same, durable position), so the walsender does not drop the connection after
wal_sender_timeout during a long write. A full or unwritable lake fails the run in one line (``runs/storage_faults.py``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import closing, contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta

import psycopg

from resources.cdc.applier import ChangeApplier, DEFAULT_MERGE_ROWS, DEFAULT_REPLACE_VALUES
from resources.cdc.drain import drain, start_streaming
from resources.cdc.tables import TableTarget
from resources.cdc.transactions import TransactionAssembler
from resources.cdc.writer import HEARTBEAT_SECONDS
from resources.config import PgcdcConfig
from resources.crash_points import fault_point
from resources.delta.destination import Destination, TableLog
from resources.delta.state_table import read_state, state_path, StateRow, write_state
from resources.engines.engine import process_memory_mib
from resources.engines.spark_connect import reports_dead_engine
from resources.errors import explain, mask_dsn, SlotError
from resources.lsn import LSN
from resources.names import RESNAPSHOT_JOB, slot_pool
from resources.pgoutput.options import PgOutputOptions
from resources.pgtypes import SESSION_SETTINGS
from resources.postgres.catalog import TableName
from resources.postgres.column_types import TypeResolver
from resources.postgres.connections import connect
from resources.postgres.failover import failover_problems
from resources.postgres.preflight import check_server, check_slot, ensure_failover, idle_timeout_risk
from resources.postgres.publication import check_publications, resolve_tables
from resources.postgres.replication import ReplicationConnection
from resources.postgres.slots import read_slot, slot_holder, slot_in_use, SlotInUseError, SlotState, wal_position
from resources.postgres.stream import ReplicationStream
from resources.postgres.table_locks import TableLocks
from resources.runs.catalog_names import register_unnamed
from resources.runs.drain_tables import drain_targets, read_log, wanted_tables
from resources.runs.key_range_copy import copy_key_range
from resources.runs.quarantine import Quarantine, Quarantines
from resources.runs.slot_guard import check_slot_position
from resources.runs.storage_faults import reports_storage_faults

__all__ = ["DEFAULT_CHUNK_BYTES", "IncrementalResult", "TableResult", "run_incremental"]

DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
"""Payload bytes per chunk: with ``max_chunk_changes`` this bounds the run's memory."""


@dataclass(frozen=True)
class TableResult:
    inserted: int
    updated: int
    deleted: int
    truncates: int
    #: Commit end LSN of the newest change this run applied; None when none was.
    applied_lsn: LSN | None
    #: The Delta table's newest version after the run (from the pgcdc state for a table the run did not read).
    delta_version: int | None
    #: Commit end LSN of the newest change applied to the table by this run or, as the state records, an earlier one.
    last_applied_lsn: LSN | None = None
    #: Its schema check is due: a Relation message changed it in this run, or it was snapshotted since the previous drain.
    schema_changed: bool = False
    #: Why the run's MERGEs of this bucketed table read every bucket, and what restores the pruning (None: they did not).
    unpruned: str | None = None
    #: Rows this run appended to the table's changelog (docs/history.md); None: the table keeps no history.
    history_rows: int | None = None
    #: Bytes of data files and deletion vectors this run's commits to the table wrote (from its log).
    bytes_written: int = 0
    #: The table itself: the result's key (``schema.table`` unquoted) splits ambiguously where a name holds a dot.
    table: TableName | None = None


@dataclass(frozen=True)
class IncrementalResult:
    #: The slot's confirmed_flush_lsn before the run.
    start_lsn: LSN
    #: IDENTIFY_SYSTEM xlogpos at the start: the run drains up to here.
    end_lsn: LSN
    #: confirmed_flush_lsn re-read from pg_replication_slots after the run.
    confirmed_flush_lsn: LSN
    tables: dict[str, TableResult]
    transactions: int
    #: Changes written to Delta (before folding per key).
    changes: int
    #: Changes read but not applied: tables without snapshot or not replicated, at or below a snapshot LSN, replays.
    changes_skipped: int
    lag_bytes_before: int
    lag_bytes_after: int
    duration_s: float
    #: The run's process at its most resident memory so far (VmHWM), read when the drain ends: the
    #: drain's chunks at their worst on top of what the process holds anyway. Plotted run after run it
    #: shows memory follow the chunk size, not the backlog or the months of runs.
    peak_memory_mib: float
    tables_without_snapshot: list[str] = field(default_factory=list)
    #: Tables set aside by a fault of their own after the run, by name (resources/runs/quarantine.py).
    quarantined: dict[str, Quarantine] = field(default_factory=dict)
    #: Of those, the ones this run set aside: the run reports them as its failure once it has confirmed the rest.
    newly_quarantined: list[str] = field(default_factory=list)
    #: Tables whose quarantine a re-snapshot lifted, found at the run's start.
    lifted: list[str] = field(default_factory=list)
    #: Tables no longer published under their name whose Delta tables remain, by name: why, and the fix
    #: (resources/runs/drain_tables.py).
    departed: dict[str, str] = field(default_factory=dict)
    #: Tables (or their history) a name could not be registered for in the catalog (``catalog:``), by name: the line.
    unregistered: dict[str, str] = field(default_factory=dict)

    @property
    def changes_per_second(self) -> float:
        return self.changes / self.duration_s if self.duration_s > 0 else 0.0


@reports_storage_faults
@reports_dead_engine
def run_incremental(
    config: PgcdcConfig,
    destination: Destination,
    *,
    log: Callable[[str], None] | None = None,
    max_chunk_changes: int = 200_000,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_merge_rows: int = DEFAULT_MERGE_ROWS,
    max_replace_values: int = DEFAULT_REPLACE_VALUES,
    spill_dir: str | None = None,
    end_lsn: LSN | None = None,
    hold: Callable[[], None] | None = None,
    warn: Callable[[str], None] | None = None,
    schedule_gap: timedelta | None = None,
    held: frozenset[str] = frozenset(),
    lock_wait: float | None = None,
) -> IncrementalResult:
    """Apply the slot's backlog up to the current WAL flush position to ``destination``, then confirm it.

    ``max_chunk_changes`` / ``max_chunk_bytes`` bound a chunk (and so memory); a chunk ends
    at a transaction boundary unless one transaction alone exceeds them. ``max_merge_rows``
    bounds the source rows of one MERGE (a table's folded batch is split into several;
    Sail's memory during a MERGE grows with its source). ``max_replace_values`` bounds the
    distinct row values one commit of a REPLICA IDENTITY FULL table rewrites. ``spill_dir``
    holds large transactions' changes while they are assembled (default: the system
    temporary directory). ``end_lsn`` drains up to exactly that position instead of the WAL
    flush position (reconciliation fixes it as a temporary slot's consistent point); it must
    not lie behind the slot's confirmed position.

    ``hold`` runs first, while the run holds the slot (streaming started, so no other reader can take it;
    status updates keep it), before the tables' logs are read and the end position is taken: a
    snapshot in key ranges copies its next range there (docs/contracts.md).

    ``warn`` (default: ``log``) hears what would lose the slot later without stopping this
    run: a failover slot no standby has synchronized yet (``slot_failover``), and an
    ``idle_replication_slot_timeout`` shorter than ``schedule_gap``, the longest gap between
    scheduled drains, allows.

    Each table the run writes is locked against a snapshot or maintenance of it (``resources/postgres/table_locks.py``,
    waiting ``lock_wait`` s at most), but the Delta paths in ``held``, whose locks the caller holds."""
    say = log or (lambda message: None)
    caution = warn or (lambda message: say(f"warning: {message}"))
    started = time.monotonic()
    dsn = config.postgres.dsn
    with _sessions(dsn, config.slot, lock_wait) as (conn, rc, locks):
        start_lsn, tables = _checked_start(config, destination, conn, rc, end_lsn, schedule_gap, caution)
        guard = check_slot_position(config, destination, tables[0], start_lsn, holding=hold is not None)
        stream = ReplicationStream(rc)
        options = PgOutputOptions([config.publication], streaming="on")
        if hold is not None:
            end_lsn = _held(stream, config.slot, options, start_lsn, hold, conn, end_lsn)
        state = read_state(state_path(config.delta.root, config.slot), destination.lake)
        targets, gone = drain_targets(conn, config, destination, tables, state, start_lsn, (say, caution))
        end_lsn = rc.identify_system().xlogpos if end_lsn is None else end_lsn
        quarantines = Quarantines.start(config, destination, targets, (start_lsn, end_lsn), say)
        applier = ChangeApplier(
            destination, TypeResolver(conn, config.column_overrides), targets, max_changes=max_chunk_changes,
            max_bytes=max_chunk_bytes, log=say, heartbeat=stream.keepalive, max_merge_rows=max_merge_rows,
            max_replace_values=max_replace_values, recopy_range=functools.partial(_recopy_range, config, destination),
            set_aside=None if config.on_table_error == "stop" else quarantines.set_aside,
            write_concurrency=config.spark.writes_at_once(), claim=_claims(locks, held, stream.keepalive),
        )  # fmt: skip
        say(f"draining slot {config.slot} from {start_lsn} to {end_lsn} ({max(0, end_lsn - start_lsn)} bytes of WAL)")
        if not stream.streaming:
            start_streaming(stream, config.slot, options, start_lsn)
        written: dict[str, StateRow] = {}

        def record_state() -> None:
            written.update(_record_state(config, destination, targets, state))

        with TransactionAssembler(options.resolve_proto_version(rc.server_version_num), spill_dir) as assembler:
            drain(stream, assembler, applier, end_lsn, say, started, record_state, before_confirm=guard.allow)
        rc.close()
        confirmed, flush_now = _confirmed_flush(dsn, config.slot), wal_position(conn)
    result = _summary(
        applier, destination, targets, {**state, **written}, quarantines, (start_lsn, end_lsn), confirmed, flush_now, started,
        say, gone,
    )  # fmt: skip
    unregistered = register_unnamed(config, destination, targets, caution, held)  # the slot released: no hold on it
    return replace(result, unregistered=unregistered) if unregistered else result


@contextmanager
def _sessions(
    dsn: str, slot: str, lock_wait: float | None
) -> Iterator[tuple[psycopg.Connection, ReplicationConnection, TableLocks]]:
    """The run's sessions: a normal one, the replication one (its name names the run) and its table locks';
    a slot found in use (by the preflight, or by START_REPLICATION in a race) is refused naming its reader."""
    conn = connect(dsn, application_name="pgcdc_incremental", session_settings=SESSION_SETTINGS)
    locks = TableLocks(dsn, slot, "drain", lock_wait)
    named = f"pgcdc_incremental {locks.run}"[:63]
    with conn, ReplicationConnection(dsn, application_name=named, session_settings=SESSION_SETTINGS) as rc:
        with closing(locks):
            try:
                yield conn, rc, locks
            except SlotInUseError as busy:
                holder = slot_holder(conn, busy.pid)
                if holder is None:
                    raise
                raise slot_in_use(busy.slot, busy.pid, holder) from None


def _claims(
    locks: TableLocks, held: frozenset[str], heartbeat: Callable[[], None]
) -> tuple[Callable[[str], None], Callable[[str], None]]:
    """The change applier's ``claim``: a table's lock taken shared (keeping the stream alive while it
    waits), but for the tables the caller holds."""

    def take(path: str) -> None:
        if path not in held:
            locks.acquire(path, exclusive=False, heartbeat=heartbeat)

    return take, locks.release


def _summary(
    applier: ChangeApplier,
    destination: Destination,
    targets: dict[TableName, TableTarget],
    state: dict[str, StateRow],
    quarantines: Quarantines,
    drained: tuple[LSN, LSN],
    confirmed: LSN,
    flush_now: LSN,
    started: float,
    say: Callable[[str], None],
    departed: dict[str, str],
) -> IncrementalResult:
    """What the run did, reported in one line and returned."""
    start_lsn, end_lsn = drained
    result = IncrementalResult(
        start_lsn=start_lsn,
        end_lsn=end_lsn,
        confirmed_flush_lsn=confirmed,
        tables=_table_results(destination, targets, state),
        transactions=applier.transactions,
        changes=applier.changes_applied,
        changes_skipped=applier.changes_skipped,
        lag_bytes_before=max(0, end_lsn - start_lsn),
        lag_bytes_after=max(0, flush_now - confirmed),
        duration_s=time.monotonic() - started,
        peak_memory_mib=process_memory_mib()[1],
        # Read before the run (not listed by the state) or during it (a listed table whose log has no snapshot now).
        tables_without_snapshot=[
            str(t.table)
            for t in targets.values()
            if t.log is not None and not t.log.being_snapshotted and not t.departed
        ],
        departed=departed,
        quarantined=dict(quarantines.active),
        newly_quarantined=list(quarantines.new),
        lifted=list(quarantines.lifted),
    )
    quarantines.report(targets)
    say(
        f"done: {result.transactions} transactions, {result.changes} changes applied "
        f"({result.changes_per_second:,.0f}/s), {result.changes_skipped} skipped, slot confirmed at {confirmed}; "
        f"peak memory {result.peak_memory_mib:,.0f} MiB"
    )
    return result


def _checked_start(
    config: PgcdcConfig,
    destination: Destination,
    conn: psycopg.Connection,
    rc: ReplicationConnection,
    end_lsn: LSN | None,
    schedule_gap: timedelta | None,
    caution: Callable[[str], None],
) -> tuple[LSN, tuple[list[TableName], list[TableName]]]:
    """The checks before a drain touches anything (server, publication, slot, lake), the warnings that
    do not stop it, and where it starts: the slot's confirmed position, the published tables to replicate
    and the configured ones not published now."""
    check_server(rc)
    check_publications(rc, [config.publication])
    if rc.read_slot(config.slot) is None:
        _refuse_lost_slot(config, destination, conn)
    slot_state = check_slot(rc, config.slot)
    start_lsn = slot_state.confirmed_flush_lsn
    assert start_lsn is not None  # check_slot refuses a slot without one
    for warning in _slot_risks(config, conn, rc, slot_state, schedule_gap):
        caution(warning)
    tables = wanted_tables(conn, config)
    if end_lsn is not None and end_lsn < start_lsn:
        raise SlotError(
            f'replication slot "{config.slot}" is confirmed at {start_lsn}, beyond the requested end {end_lsn}',
            f"a drain ran outside the {slot_pool(config.slot)} pool meanwhile: give it a limit of 1, then retry",
        )
    return start_lsn, tables


def _held(
    stream: ReplicationStream, slot: str, options: PgOutputOptions, start_lsn: LSN, hold: Callable[[], None],
    conn: psycopg.Connection, end_lsn: LSN | None,
) -> LSN:  # fmt: skip
    """Start streaming and run ``hold`` under the slot (``run_incremental``); returns where the drain ends:
    ``end_lsn``, or the WAL position once ``hold`` is done (IDENTIFY_SYSTEM cannot run while streaming)."""
    start_streaming(stream, slot, options, start_lsn)
    _holding(stream, hold)
    return wal_position(conn) if end_lsn is None else end_lsn


def _holding(stream: ReplicationStream, step: Callable[[], None]) -> None:
    """Run ``step`` on a thread of its own while this one keeps the stream alive with status updates
    (only this thread touches the replication connection)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pgcdc-hold") as pool:
        future = pool.submit(step)
        while not future.done():
            stream.keepalive()
            wait((future,), timeout=HEARTBEAT_SECONDS)
        future.result()


def _recopy_range(
    config: PgcdcConfig, destination: Destination, table: TableName, path: str, log: TableLog, k: int
) -> None:
    """The drain's re-copy of one key range (``ChangeApplier``): inside this run, so under the slot;
    ``log`` is the table's log as the drain knows it (its ranges and layout: no read of its own)."""
    assert log.chunks is not None, "only a table snapshotted in key ranges is copied again"
    copy_key_range(
        config.postgres.dsn, config.publication, config.slot, table, destination, path, log.chunks, k, first=False,
        log=log, buckets=config.delta.buckets, overrides=config.column_overrides,
    )  # fmt: skip


def _record_state(
    config: PgcdcConfig,
    destination: Destination,
    targets: dict[TableName, TableTarget],
    state: dict[str, StateRow],
) -> dict[str, StateRow]:
    """Write the state rows of the snapshotted tables whose log this run read; returns those rows.

    Each such log is read again from where the run read it (only this run's own commits), so a
    row records what the table's log says, not what the run believes it wrote.
    """
    rows = {}
    gone = []  # listed by the state, but their log has no snapshot (any more)
    for table, target in targets.items():
        if target.log is None:
            continue
        if target.log.snapshot_lsn is None:
            if str(table) in state:
                gone.append(str(table))
            continue
        log = read_log(destination, target.path, config, target.log)
        previous = state.get(str(table))
        applied = target.stats.applied_lsn
        if applied is None and previous is not None and previous.log.snapshot_version == log.snapshot_version:
            applied = previous.applied_lsn  # the same snapshot's rows: what was applied before still is
        rows[str(table)] = StateRow(str(table), target.path, log, applied)
    if rows or gone:
        fault_point("before_state_write")
        write_state(
            state_path(config.delta.root, config.slot), state, rows.values(), forget=gone, lake=destination.lake
        )
    return rows


def _table_results(
    destination: Destination, targets: dict[TableName, TableTarget], state: dict[str, StateRow]
) -> dict[str, TableResult]:
    """Per table: what the run applied, the Delta version it left (None without a snapshot), the
    newest change applied so far, from the run's state rows (``state``: without reading the tables it
    did not meet), and the bytes its commits wrote (read from those commits only)."""
    results = {}
    for table, target in targets.items():
        row = state.get(str(table))
        has_snapshot = row is not None and (target.log is None or target.log.snapshot_lsn is not None)
        stats = target.stats
        written = 0
        if has_snapshot and stats.version_read is not None and row.log.version is not None:  # type: ignore[union-attr]
            written = destination.bytes_added(target.path, stats.version_read, row.log.version)  # type: ignore[union-attr]
        results[str(table)] = TableResult(
            stats.inserted,
            stats.updated,
            stats.deleted,
            stats.truncates,
            stats.applied_lsn,
            row.log.version if has_snapshot else None,  # type: ignore[union-attr]
            row.applied_lsn if has_snapshot else None,  # type: ignore[union-attr]
            stats.schema_changed,
            stats.unpruned,
            stats.history_rows if target.history_path is not None else None,
            written,
            table,
        )
    return results


def _refuse_lost_slot(config: PgcdcConfig, destination: Destination, conn: psycopg.Connection) -> None:
    """A missing slot whose lake holds snapshots was lost (a failover without a synchronized failover
    slot, or a drop): the changes since its position are gone, so only a re-snapshot of every table helps.

    Returns when the lake holds nothing of this pipeline: the slot was never created.
    """
    drained = read_state(state_path(config.delta.root, config.slot), destination.lake)
    if not drained:
        try:
            tables = resolve_tables(conn, config.publication, config.tables)
        except psycopg.Error as exc:
            raise explain(exc, config.postgres.dsn) from None
        if all(
            destination.read_table_log(config.table_path(t.schema, t.name), None).snapshot_lsn is None for t in tables
        ):
            return
    raise SlotError(
        f'replication slot "{config.slot}" does not exist on {mask_dsn(config.postgres.dsn)}, but the lake holds'
        " tables copied for it: it was dropped, or lost in a failover (only a synchronized failover slot survives one)",
        f"run the {RESNAPSHOT_JOB} job with no table list: it recreates the slot and re-snapshots every table",
    )


def _slot_risks(
    config: PgcdcConfig,
    conn: psycopg.Connection,
    rc: ReplicationConnection,
    state: SlotState,
    schedule_gap: timedelta | None,
) -> list[str]:
    """What could lose the slot after this run; turns failover on first when ``slot_failover`` asks for it."""
    risks: list[str] = []
    if config.slot_failover:
        state = ensure_failover(rc, state)
        risks.extend(str(problem) for problem in failover_problems(conn, state, config.postgres.standby_dsn))
    if schedule_gap is not None:
        idle = idle_timeout_risk(conn, config.slot, schedule_gap)
        if idle is not None:
            risks.append(str(idle))
    return risks


def _confirmed_flush(dsn: str, slot: str) -> LSN:
    """Re-read on a new connection: what the server recorded, not what we believe we sent."""
    with connect(dsn, application_name="pgcdc_incremental") as conn:
        state = read_slot(conn, slot)
    if state is None or state.confirmed_flush_lsn is None:
        raise SlotError(f'replication slot "{slot}" disappeared during the run', f"run the {RESNAPSHOT_JOB} job")
    return state.confirmed_flush_lsn
