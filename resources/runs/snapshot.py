"""The snapshot run: the published tables copied into Delta, each in the mode that suits it.

:func:`snapshot_tables` (the ``pgcdc snapshot`` command; the Dagster snapshot step calls
:func:`snapshot_each`) sets up the publication and the permanent slot, then copies each table: in
parallel, one snapshot each (``resources/runs/table_snapshot.py``: one COPY, or ctid chunks under
one exported snapshot, at a temporary slot's consistent point), and afterwards, one at a time, the
tables copied in primary-key ranges (:func:`snapshot_in_key_ranges`: one range per drain run that
holds the slot). Every write goes through the run's :class:`~resources.delta.destination.Destination`;
the finished tables are recorded in the pgcdc state table in one write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import closing
from dataclasses import replace
from typing import Any

import psycopg

from resources.config import PgcdcConfig
from resources.crash_points import fault_point
from resources.delta.destination import Destination, TableLog
from resources.delta.key_ranges import KeyRanges
from resources.delta.state_table import known_log, read_state, state_path, StateRow, write_state
from resources.errors import ConfigurationError, explain, PgcdcError, SlotError, SnapshotError
from resources.names import RESNAPSHOT_JOB
from resources.pgtypes import SESSION_SETTINGS
from resources.postgres.catalog import read_table, TableName
from resources.postgres.connections import connect
from resources.postgres.ctid_copy import heap_blocks
from resources.postgres.preflight import ensure_slot
from resources.postgres.publication import ensure_publication
from resources.postgres.slots import read_slot
from resources.postgres.table_locks import TableLocks
from resources.runs.catalog_names import catalog_targets, refusals, Registrations
from resources.runs.incremental import run_incremental
from resources.runs.key_range_copy import ColumnsChanged, copy_key_range, key_range_plan, RangeCopy
from resources.runs.phases import Phases
from resources.runs.slot_guard import record_created
from resources.runs.table_snapshot import naming_table, snapshot_table, SnapshotProgress, SnapshotResult
from resources.sql import quote_ident

__all__ = [
    "refuse_partial_recopy",
    "snapshot_each",
    "snapshot_in_key_ranges",
    "SnapshotProgress",
    "SnapshotResult",
    "snapshot_table",
    "snapshot_tables",
]

logger = logging.getLogger(__name__)


def refuse_partial_recopy(
    config: PgcdcConfig, destination: Destination, to_copy: Sequence[TableName], replicated: Sequence[TableName]
) -> None:
    """Refuse to create the slot anew while a table this run leaves out holds a snapshot in the lake.

    That snapshot was taken for a slot that is gone (lost in a failover, or dropped): the new slot
    starts now, so the table would silently miss every change in between. Only copying every
    such table again is exact.
    """
    with connect(config.postgres.dsn, application_name="pgcdc") as conn:
        if read_slot(conn, config.slot) is not None:
            return
    copied = set(to_copy)
    left_out = [
        table for table in replicated
        if table not in copied and destination.read_table_log(config.table_path(table.schema, table.name), None).snapshot_lsn is not None
    ]  # fmt: skip
    if left_out:
        raise SlotError(
            f'replication slot "{config.slot}" does not exist, and {len(left_out)} table(s) snapshotted for it are not'
            f" in this run ({', '.join(str(table) for table in left_out)}): they would miss every change since the slot was lost",
            f"run the {RESNAPSHOT_JOB} job with no table list: it recreates the slot and re-snapshots every table",
        )


def snapshot_tables(
    config: PgcdcConfig,
    destination: Destination,
    tables: Sequence[TableName] | None = None,
    on_progress: Callable[[SnapshotProgress], None] | None = None,
) -> list[SnapshotResult]:
    """Snapshot ``tables`` (default: ``config.tables``, or the whole publication), in parallel.

    ``config.snapshot.parallel_tables`` tables copy at once, each on its own connection and
    temporary slot, all writing through ``destination`` (one Spark session: opened by the caller, with
    the lake checked before the publication or slot is touched). A failing table does not stop
    the others; once all have finished, the first failure is raised (later ones are attached
    as notes). ``on_progress`` is called from the worker threads.
    """
    replicated = ensure_publication(config)
    selected = list(tables) if tables is not None else replicated
    unknown = [table for table in selected if table not in replicated]
    if unknown:
        raise ConfigurationError(
            f"{', '.join(str(t) for t in unknown)} not published by \"{config.publication}\" (or not in 'tables')",
            f"ALTER PUBLICATION {quote_ident(config.publication)} ADD TABLE ..., or snapshot only replicated tables",
        )
    refuse_partial_recopy(config, destination, selected, replicated)
    record_created(
        config, destination.lake, ensure_slot(config.postgres.dsn, config.slot, failover=config.slot_failover)
    )
    results: list[SnapshotResult] = []
    failures: list[BaseException] = []
    for _, outcome in snapshot_each(config, destination, selected, on_progress):
        if isinstance(outcome, BaseException):
            failures.append(outcome)
        else:
            results.append(outcome)
    if failures:
        first = failures[0]
        for later in failures[1:]:
            first.add_note(f"also failed: {later}")
        raise first
    return sorted(results, key=lambda result: selected.index(result.table))


def snapshot_each(
    config: PgcdcConfig,
    destination: Destination,
    tables: Sequence[TableName],
    on_progress: Callable[[SnapshotProgress], None] | None = None,
    phases: Phases | None = None,
) -> Iterator[tuple[TableName, SnapshotResult | BaseException]]:
    """Copy ``tables`` in parallel, yielding each table's result (or its failure) as it finishes.

    Callers report per table as soon as one is done (a Dagster step materializes it)
    instead of waiting for the slowest; the publication and slot must already be set up.
    Once all are done, the finished ones are recorded in the pgcdc state table in one write
    (``resources/delta/state_table.py``; a crash before it costs the next drain a log read).
    ``phases`` gets the state table's read and write (``state_read``, ``state_write``).
    """
    clock = phases or Phases()
    state = state_path(config.delta.root, config.slot)
    with clock.timed("state_read"):
        rows = read_state(state, destination.lake)

    def known(table: TableName) -> TableLog | None:
        return known_log(rows, str(table), config.table_path(table.schema, table.name))

    finished: list[SnapshotResult] = []
    named = _Naming(config, destination)
    modes: dict[TableName, tuple[KeyRanges | None, bool]] = {}
    for table in tables:
        try:
            modes[table] = _choose_mode(config, destination, table)
        except Exception as error:  # noqa: BLE001 - reported per table, as a failed copy is
            yield table, error
    one_snapshot = [table for table, (plan, resume) in modes.items() if plan is None and not resume]
    workers = max(1, min(config.snapshot.parallel_tables, len(one_snapshot)))
    locks = TableLocks(config.postgres.dsn, config.slot, "snapshot")
    with closing(locks), ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pgcdc-snapshot") as pool:
        pending = {
            pool.submit(
                _locked,
                locks,
                config.table_path(table.schema, table.name),
                snapshot_table,
                config.postgres.dsn,
                config.publication,
                table,
                destination,
                config.table_path(table.schema, table.name),
                slot=config.slot,
                workers=config.snapshot.workers,
                chunk_mb=config.snapshot.chunk_mb,
                on_progress=on_progress,
                buckets=config.delta.buckets,
                deletion_vectors=config.delta.deletion_vectors_for(table),
                known=known(table),
                overrides=config.column_overrides,
            ): table
            for table in one_snapshot
        }
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                table = pending.pop(future)
                failure = future.exception()
                if failure is None:
                    finished.append(future.result())
                yield table, failure if failure is not None else named(future.result())
    # Only now, one at a time: each step of a walk drains the slot, which must not confirm past the
    # consistent point of a one-snapshot copy still in flight (its changes would be skipped for good).
    for table, (plan, resume) in modes.items():
        if plan is None and not resume:
            continue
        try:
            result = _locked_walk(config, destination, table, plan, on_progress, known(table))
        except Exception as error:  # noqa: BLE001 - a failing table does not stop the others
            yield table, naming_table(error, table) if isinstance(error, PgcdcError) else error
            continue
        finished.append(result)
        yield table, named(result)
    if finished:
        with clock.timed("state_write"):
            _record_snapshots(state, finished, destination)


class _Naming:
    """A finished snapshot's tables registered by name (``catalog:``), right after its commit; a registration
    that fails never fails the snapshot: its one line goes with the result, and the next drain tries again."""

    def __init__(self, config: PgcdcConfig, destination: Destination) -> None:
        self._config = config
        self._registrations = Registrations(config, destination) if config.catalog is not None else None

    def __call__(self, result: SnapshotResult) -> SnapshotResult:
        if self._registrations is None:
            return result
        main = catalog_targets(self._config, result.table)[0]
        try:
            outcomes = self._registrations.register([result.table], again=True)
        except Exception as error:  # noqa: BLE001 - the data is committed; the next drain registers the table
            line = f"{result.table} could not be registered in the catalog ({error}): the next drain tries again"
            logger.warning("%s", line)
            return replace(result, catalog_refusal=line)
        name = str(main.name) if main in outcomes and outcomes[main] is None else None
        return replace(result, catalog_name=name, catalog_refusal=refusals(outcomes).get(str(result.table)))


def _locked(
    locks: TableLocks, path: str, copy: Callable[..., SnapshotResult], *args: Any, **kwargs: Any
) -> SnapshotResult:
    """``copy`` with the lock of the Delta table at ``path`` held exclusively (no drain writes it meanwhile,
    nor another snapshot or maintenance of it), up to its commit; the state row written after is a cache."""
    with locks.holding(path):
        return copy(*args, **kwargs)


def _locked_walk(
    config: PgcdcConfig, destination: Destination, table: TableName, plan: KeyRanges | None,
    on_progress: Callable[[SnapshotProgress], None] | None, known: TableLog | None,
) -> SnapshotResult:  # fmt: skip
    """:func:`snapshot_in_key_ranges` with the table's lock held exclusively for the whole walk (its own
    drains, between its ranges, are told they hold it)."""
    with closing(TableLocks(config.postgres.dsn, config.slot, "snapshot")) as locks:
        locks.acquire(config.table_path(table.schema, table.name), exclusive=True)
        return snapshot_in_key_ranges(config, destination, table, plan, on_progress, known=known)


def _record_snapshots(state: str, finished: list[SnapshotResult], destination: Destination) -> None:
    """The finished tables' snapshots in the pgcdc state table (on ``destination``'s lake), in one write."""
    fault_point("before_snapshot_state_write")
    write_state(state, read_state(state, destination.lake), [
        StateRow(
            str(done.table), done.path,
            TableLog(
                done.snapshot_lsn, done.snapshot_version or done.delta_version, done.delta_version, None, done.layout,
                done.table_id,
            ),
            None,
        )
        for done in finished
    ], lake=destination.lake)  # fmt: skip


def _choose_mode(config: PgcdcConfig, destination: Destination, table: TableName) -> tuple[KeyRanges | None, bool]:
    """(the key ranges of a new snapshot in key ranges, or None; whether one part-way is resumed),
    logged with the reason: a snapshot in key ranges part-way is resumed; otherwise key ranges above
    ``snapshot.chunked_above_mb`` for a table with a one-column integer primary key (in place, range
    by range, when the table has a complete snapshot by that key), else one snapshot (one COPY, or
    ctid chunks in parallel)."""
    log = destination.read_table_log(config.table_path(table.schema, table.name), None)
    if log.chunks is not None and log.chunks.next_range() is not None:
        logger.info(
            "snapshot %s: resuming its snapshot in key ranges of %s: %d of %d done",
            table, log.chunks.key, log.chunks.done, log.chunks.count,
        )  # fmt: skip
        return None, True
    plan, why = _plan(config, table)
    if plan is not None and log.snapshot_lsn is not None:
        if log.chunks is not None and log.chunks.key == plan.key:
            plan = log.chunks.again()
        else:
            plan = KeyRanges(plan.key, plan.bounds, (int(log.snapshot_lsn),) * plan.count, frozenset(range(plan.count)))
        why += "; a re-snapshot in place: each range is drained as before until copied again"
    logger.info("snapshot %s: %s", table, why)
    return plan, False


def _plan(config: PgcdcConfig, table: TableName) -> tuple[KeyRanges | None, str]:
    """:func:`~resources.runs.key_range_copy.key_range_plan` for the table as it is now."""
    try:
        with connect(config.postgres.dsn, application_name="pgcdc_snapshot", session_settings=SESSION_SETTINGS) as conn:
            info = read_table(conn, config.publication, table)
            blocks, block_size = heap_blocks(conn, info.oid)
            return key_range_plan(conn, info, blocks * block_size, config.snapshot)
    except PgcdcError as exc:
        raise naming_table(exc, table) from exc
    except psycopg.Error as exc:
        raise naming_table(explain(exc, config.postgres.dsn), table) from exc


def snapshot_in_key_ranges(
    config: PgcdcConfig,
    destination: Destination,
    table: TableName,
    plan: KeyRanges | None,
    on_progress: Callable[[SnapshotProgress], None] | None = None,
    known: TableLog | None = None,
) -> SnapshotResult:
    """Walk the table's key ranges, one per drain run of the slot, until every range is done.

    Each step is one :func:`~resources.runs.incremental.run_incremental` whose ``hold`` copies the next
    range (:func:`~resources.runs.key_range_copy.copy_key_range`) while the run holds the permanent slot,
    then drains every table from the slot's confirmed position, this one by the drain rule of key
    ranges. ``plan`` starts a new snapshot (its first range replaces the whole table) or, with ranges
    to copy again (``redo``), a re-snapshot in place (each range replaced on its own, the others
    drained as before); None resumes the one the table's log records, at its next range. A run
    stopped anywhere loses nothing: the next one resumes. The last step copies nothing and only
    drains. When the table's columns no longer match its Delta table, the walk starts over with a
    snapshot whose first range replaces the whole table. ``known`` is the pgcdc state's row of the
    table (where its layout is recorded after log cleanup).
    """
    started = time.monotonic()
    path = config.table_path(table.schema, table.name)
    recorded = destination.read_table_log(path, known).chunks
    done_before = recorded.done if plan is None and recorded is not None else 0
    copies: list[RangeCopy] = []
    rows = nbytes = 0

    def copy_range(ranges: KeyRanges, k: int, first: bool, log: TableLog) -> None:
        copies.append(copy_key_range(
            config.postgres.dsn, config.publication, config.slot, table, destination, path, ranges, k,
            first=first, log=log, buckets=config.delta.buckets, deletion_vectors=config.delta.deletion_vectors_for(table),
            overrides=config.column_overrides,
        ))  # fmt: skip

    def copy_next() -> None:
        log = destination.read_table_log(
            path, known
        )  # once per range: its ranges (but the plan's first) and its layout
        ranges = plan if plan is not None and not copies else log.chunks
        if ranges is None:
            raise SnapshotError(
                f"{table}: its snapshot in key ranges is gone from its Delta log", "snapshot the table again"
            )
        k = ranges.next_range()
        if k is None:
            return
        new_snapshot = ranges is plan and not plan.redo
        try:
            copy_range(ranges, k, new_snapshot, log)
        except ColumnsChanged as changed:
            fresh = _plan(config, table)[0] or KeyRanges(ranges.key, (), (None,))  # else one range: the whole table
            logger.info("snapshot %s: %s; starting over in %d key ranges", table, changed, fresh.count)
            copy_range(fresh, 0, True, log)  # nothing was written: the log is as read

    while True:
        copied = len(copies)
        run_incremental(
            config, destination, hold=copy_next, log=lambda line: logger.info("snapshot %s: %s", table, line),
            held=frozenset({path}),
        )  # fmt: skip
        if len(copies) == copied:
            break
        copy = copies[-1]
        rows, nbytes = rows + copy.rows, nbytes + copy.bytes
        if on_progress is not None:
            on_progress(SnapshotProgress(
                table, rows, nbytes, time.monotonic() - started, copy.ranges.done, copy.ranges.count, done_before, "key ranges",
            ))  # fmt: skip
    return _walk_result(destination, table, path, rows, copies, started)


def _walk_result(
    destination: Destination, table: TableName, path: str, rows: int, copies: list[RangeCopy], started: float
) -> SnapshotResult:
    """The result of a finished walk in key ranges, from the table's log (its last range's commit)."""
    log = destination.read_table_log(path, None)
    if log.chunks is None or log.snapshot_lsn is None or log.version is None:
        raise SnapshotError(f"{table}: its snapshot in key ranges did not complete", "run the table's snapshot again")
    return SnapshotResult(
        table=table,
        snapshot_lsn=log.snapshot_lsn,
        rows=rows,
        path=path,
        delta_version=log.version,
        duration_s=time.monotonic() - started,
        columns=copies[-1].columns if copies else [],
        chunks=log.chunks.count,
        layout=log.layout,
        key_ranges=True,
        snapshot_version=log.snapshot_version,
        table_id=log.table_id,
    )
