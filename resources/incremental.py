"""One incremental run: drain the permanent slot up to where WAL stood at the start, apply, confirm.

The order that makes it exactly-once (argued in docs/contracts.md):

1. Preflight, read-only (``resources/preflight.py``, shared with ``pgcdc changes``): server
   (version, wal_level), publication, slot (exists, pgoutput, this database, not lost, not
   in use). PostgreSQL 18 streams nothing for a missing publication instead of failing,
   so that check is ours. Then the tables to replicate and their snapshot markers: when no
   table has one, delta.root is most likely wrong and the run refuses (confirming would
   skip every pending change for good).
2. ``end_lsn`` = IDENTIFY_SYSTEM's xlogpos: the WAL *flush* position, i.e. everything the
   walsender can decode right now. A transaction committed with synchronous_commit=off
   may lie just beyond it; the next run picks it up. (pg_current_wal_lsn() could point
   at WAL not yet flushed, making the drain wait for the WAL writer.)
3. Stream the slot from its confirmed_flush_lsn up to end_lsn, assemble transactions
   (``resources.transactions``), batch them per table (``resources.change_batches``).
4. Per chunk, ending at a transaction boundary: every table's batch is committed to
   Delta, *then* the chunk's last commit end LSN is confirmed to the slot. A crash in
   between replays the chunk, which the Delta writes absorb (MERGE of final images per
   key; append markers for keyless tables).
5. At the end, with nothing left below end_lsn, confirm max(last commit end, end_lsn), so
   an idle slot (or one whose changes are all for other tables) still advances.

Tables whose Delta table has no snapshot marker yet are left alone and their changes
skipped: confirming past them is safe because their snapshot, taken later, starts at a
consistent point beyond everything confirmed now.

While the run waits for Delta, nothing reads the replication stream: the waits call
``ReplicationStream.keepalive`` (status updates with the same, durable position), so the
walsender does not drop the connection after wal_sender_timeout during a long write.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg
from pyspark.sql import SparkSession

from resources.catalog import resolve_tables
from resources.change_batches import DEFAULT_MERGE_ROWS, DEFAULT_REPLACE_VALUES, ChangeApplier, TableTarget, TypeResolver
from resources.config import PgcdcConfig
from resources.connections import connect
from resources.delta_engine import read_commit_metadata
from resources.errors import ConfigurationError, PgcdcError, SlotError, explain
from resources.faults import fault_point
from resources.lake_storage import open_lake
from resources.lsn import LSN
from resources.pgtypes import SESSION_SETTINGS
from resources.preflight import check_publications, check_server, check_slot, slot_in_use
from resources.replication import PgOutputOptions, ReplicationConnection, ReplicationStream
from resources.snapshot import read_snapshot_lsn
from resources.spark_connect import reports_dead_engine
from resources.transactions import TransactionAssembler

__all__ = ["DEFAULT_CHUNK_BYTES", "IncrementalResult", "TableResult", "run_incremental"]

DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
"""Payload bytes per chunk: with ``max_chunk_changes`` this bounds the run's memory."""
PROGRESS_SECONDS = 5.0


@dataclass(frozen=True)
class TableResult:
    inserted: int
    updated: int
    deleted: int
    truncates: int
    #: Commit end LSN of the newest change this run applied; None when none was.
    applied_lsn: LSN | None
    #: The Delta table's newest version after the run.
    delta_version: int | None


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
    tables_without_snapshot: list[str] = field(default_factory=list)

    @property
    def changes_per_second(self) -> float:
        return self.changes / self.duration_s if self.duration_s > 0 else 0.0


@reports_dead_engine
def run_incremental(
    config: PgcdcConfig,
    spark: SparkSession,
    *,
    log: Callable[[str], None] | None = None,
    max_chunk_changes: int = 200_000,
    max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_merge_rows: int = DEFAULT_MERGE_ROWS,
    max_replace_values: int = DEFAULT_REPLACE_VALUES,
    spill_dir: str | None = None,
) -> IncrementalResult:
    """Apply the slot's backlog up to the current WAL flush position to Delta, then confirm it.

    ``max_chunk_changes`` / ``max_chunk_bytes`` bound a chunk (and so memory); a chunk ends
    at a transaction boundary unless one transaction alone exceeds them. ``max_merge_rows``
    bounds the source rows of one MERGE (a table's folded batch is split into several;
    Sail's memory during a MERGE grows with its source). ``max_replace_values`` bounds the
    distinct row values one commit of a REPLICA IDENTITY FULL table rewrites. ``spill_dir``
    holds large transactions' changes while they are assembled (default: the system
    temporary directory).
    """
    say = log or (lambda message: None)
    started = time.monotonic()
    dsn = config.postgres.dsn
    conn = connect(dsn, application_name="pgcdc_incremental", session_settings=SESSION_SETTINGS)
    with conn, ReplicationConnection(
        dsn, application_name="pgcdc_incremental", session_settings=SESSION_SETTINGS
    ) as rc:
        check_server(rc)
        check_publications(rc, [config.publication])
        start_lsn = check_slot(rc, config.slot).confirmed_flush_lsn
        assert start_lsn is not None  # check_slot refuses a slot without one
        open_lake(config.delta.root, config.delta.storage)
        try:
            tables = resolve_tables(conn, config.publication, config.tables)
        except psycopg.Error as exc:
            raise explain(exc, dsn) from None
        targets = {
            table: TableTarget(table, path, _snapshot_lsn(spark, path, config))
            for table in tables
            for path in [config.table_path(table.schema, table.name)]
        }
        without_snapshot = [str(t.table) for t in targets.values() if t.snapshot_lsn is None]
        if targets and len(without_snapshot) == len(targets):
            # Every change would be skipped and the slot confirmed past it: with a mistyped or
            # unmounted delta.root the real lake would never get those changes.
            raise ConfigurationError(
                f"no replicated table has a snapshot under delta.root {config.delta.root}",
                "run the pgcdc_snapshot job first, or fix delta.root if it points to the wrong place",
            )
        if without_snapshot:
            say(
                f"no snapshot yet for {', '.join(without_snapshot)}: their changes are skipped "
                "(their snapshot will start after this run's position)"
            )
        stream = ReplicationStream(rc)
        applier = ChangeApplier(
            spark, TypeResolver(conn), targets, max_changes=max_chunk_changes, max_bytes=max_chunk_bytes, log=say,
            heartbeat=stream.keepalive, max_merge_rows=max_merge_rows, max_replace_values=max_replace_values,
        )
        end_lsn = rc.identify_system().xlogpos
        say(f"draining slot {config.slot} from {start_lsn} to {end_lsn} ({max(0, end_lsn - start_lsn)} bytes of WAL)")
        options = PgOutputOptions([config.publication], streaming="on")
        _start(stream, config.slot, options)
        proto = options.resolve_proto_version(rc.server_version_num)
        with TransactionAssembler(proto, spill_dir) as assembler:
            _drain(stream, assembler, applier, end_lsn, say, started)
        rc.close()
        confirmed = _confirmed_flush(dsn, config.slot)
        flush_now = LSN.parse(conn.execute("SELECT pg_catalog.pg_current_wal_flush_lsn()::pg_catalog.text").fetchone()[0])  # type: ignore[index]
    tables = {
        str(target.table): TableResult(
            target.stats.inserted,
            target.stats.updated,
            target.stats.deleted,
            target.stats.truncates,
            target.stats.applied_lsn,
            _delta_version(spark, target.path) if target.snapshot_lsn is not None else None,
        )
        for target in targets.values()
    }
    duration = time.monotonic() - started
    result = IncrementalResult(
        start_lsn=start_lsn,
        end_lsn=end_lsn,
        confirmed_flush_lsn=confirmed,
        tables=tables,
        transactions=applier.transactions,
        changes=applier.changes_applied,
        changes_skipped=applier.changes_skipped,
        lag_bytes_before=max(0, end_lsn - start_lsn),
        lag_bytes_after=max(0, flush_now - confirmed),
        duration_s=duration,
        tables_without_snapshot=without_snapshot,
    )
    say(
        f"done: {result.transactions} transactions, {result.changes} changes applied "
        f"({result.changes_per_second:,.0f}/s), {result.changes_skipped} skipped, slot confirmed at {confirmed}"
    )
    return result


def _drain(
    stream: ReplicationStream,
    assembler: TransactionAssembler,
    applier: ChangeApplier,
    end_lsn: LSN,
    say: Callable[[str], None],
    started: float,
) -> None:
    """The main loop; on any error the stream stops having confirmed only durable positions."""
    feed = assembler.feed
    feed_rows = assembler.feed_rows
    confirmed = stream.confirmed_lsn
    next_report = time.monotonic() + PROGRESS_SECONDS

    def confirm(position: LSN) -> None:
        nonlocal confirmed
        if position > confirmed:
            fault_point("after_delta_commit")
            stream.confirm(position)
            stream.send_status()
            confirmed = position
            fault_point("after_confirm")

    try:
        for item in stream.drain_batches(end_lsn, stop=False):
            if type(item) is list:  # row changes inside a transaction: kept undecoded
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
        # Everything committed before end_lsn has been applied: confirm at least end_lsn so an
        # idle slot advances (see the module docstring for why this loses nothing).
        confirm(max(applier.finish(), end_lsn))
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


def _start(stream: ReplicationStream, slot: str, options: PgOutputOptions) -> None:
    try:
        stream.start(slot, options=options)
    except SlotError as exc:
        if "active for PID" in exc.cause:
            raise slot_in_use(slot, exc.cause.rsplit(" ", 1)[-1]) from None
        raise


def _snapshot_lsn(spark: SparkSession, path: str, config: PgcdcConfig) -> LSN | None:
    """read_snapshot_lsn, with a failure to read the location as one line naming delta.root."""
    try:
        return read_snapshot_lsn(spark, path)
    except PgcdcError:
        raise
    except Exception as exc:  # noqa: BLE001 - Spark's errors are multi-line and name no fix
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0].strip()
        raise ConfigurationError(
            f"cannot read the Delta table at {path} ({first_line})",
            f"check delta.root ({config.delta.root}) and delta.storage: it must be a writable location holding the snapshots",
        ) from None


def _confirmed_flush(dsn: str, slot: str) -> LSN:
    """Re-read on a new connection: what the server recorded, not what we believe we sent."""
    with connect(dsn, application_name="pgcdc_incremental") as conn:
        row = conn.execute(
            "SELECT confirmed_flush_lsn::pg_catalog.text FROM pg_catalog.pg_replication_slots"
            " WHERE slot_name OPERATOR(pg_catalog.=) %s::pg_catalog.name",
            (slot,),
        ).fetchone()
    if row is None or row[0] is None:
        raise SlotError(f'replication slot "{slot}" disappeared during the run', "run the pgcdc_resnapshot job")
    return LSN.parse(row[0])


def _delta_version(spark: SparkSession, path: str) -> int | None:
    newest = read_commit_metadata(spark, path, limit=1)
    return newest[0].version if newest else None
