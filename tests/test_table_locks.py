"""Runs that write the same Delta table do not overlap, without Dagster's pool: per-table advisory locks
on the publisher (``resources/postgres/table_locks.py``, docs/contracts.md "Runs that must not overlap").

A drain holds its table's lock (shared) from its first change of the table to its end; a snapshot of the
table (exclusive) started beside it waits, bounded, and refuses in one line naming the drain's run, or
runs once the drain is done. Drains never wait for each other here (the slot keeps two drains of one
slot apart: ``tests/test_faults.py::test_second_run_while_one_drains_fails_fast_and_the_first_finishes_exactly``).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from resources.config import parse_config
from resources.delta.spark_destination import lake_destination, SparkDeltaDestination
from resources.names import TableName
from resources.postgres import table_locks
from resources.postgres.table_locks import TableBusyError, TableLocks
from resources.runs.incremental import IncrementalResult, run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.verify import assert_delta_equals_postgres
from tests.support.incremental_runs import settings
from tests.support.postgres import PgDatabase

pytest_plugins = ["tests.support.spark_fixtures"]

WAIT = 60.0  # bounds every wait for an event of the other thread


class PausedMerges:
    """A lake whose MERGEs wait for ``go`` once ``entered`` is set: a drain held mid-write, on the real lake."""

    def __init__(self, destination: SparkDeltaDestination) -> None:
        self._destination = destination
        self.entered = threading.Event()
        self.go = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._destination, name)

    def merge_batch(self, *args: Any, **kwargs: Any) -> None:
        self.entered.set()
        assert self.go.wait(WAIT), "the test never let the drain go on"
        self._destination.merge_batch(*args, **kwargs)


def _sessions(pg: PgDatabase, prefix: str) -> int:
    ((count,),) = pg.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s", (prefix + "%",))
    return int(count)


def test_a_snapshot_of_a_table_a_drain_writes_waits_for_it_or_refuses_naming_it(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    pg.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v text); CREATE TABLE u (id int PRIMARY KEY);"
        " INSERT INTO t VALUES (1, 'a'), (2, 'b'); INSERT INTO u VALUES (1); CREATE PUBLICATION pub FOR TABLE t, u"
    )
    config = parse_config(settings(pg, tmp_path / "lake"))
    lake = lake_destination(spark, config)
    snapshot_tables(config, lake)
    pg.execute("UPDATE t SET v = 'drained' WHERE id = 1; INSERT INTO t VALUES (3, 'c')")
    paused = PausedMerges(lake)
    table = TableName("public", "t")
    with ThreadPoolExecutor(max_workers=2) as pool:
        drain: Future[IncrementalResult] = pool.submit(run_incremental, config, paused)  # type: ignore[arg-type]
        try:
            assert paused.entered.wait(WAIT), "the drain never wrote t"
            # Refused after its bound, naming the drain's run (this process) and the fix.
            monkeypatch.setattr(table_locks, "DEFAULT_LOCK_WAIT_SECONDS", 0.5)
            with pytest.raises(TableBusyError) as busy:
                snapshot_tables(config, lake, [table])
            assert f"is being written by another pgcdc run: pgcdc drain pid {os.getpid()} on " in str(busy.value)
            assert str(busy.value).endswith(
                "(a run whose process is gone releases the table when PostgreSQL ends its session: pg_terminate_backend(PID))"
            )
            # A table the drain does not write is not held: u is snapshotted beside it.
            snapshot_tables(config, lake, [TableName("public", "u")])
            # Within its bound, the snapshot waits for the drain and runs after it.
            monkeypatch.setattr(table_locks, "DEFAULT_LOCK_WAIT_SECONDS", WAIT)
            before = _sessions(pg, "pgcdc snapshot")
            snapshot = pool.submit(snapshot_tables, config, lake, [table])
            while _sessions(pg, "pgcdc snapshot") == before and not snapshot.done():
                threading.Event().wait(0.05)  # its lock session is open: it is asking for t
            assert not snapshot.done(), snapshot.exception()
        finally:
            paused.go.set()
        result = drain.result(WAIT)
        (copied,) = snapshot.result(WAIT)
    assert result.tables["public.t"].delta_version is not None
    assert copied.delta_version > result.tables["public.t"].delta_version  # its commit came after the drain's
    assert copied.snapshot_lsn >= result.end_lsn
    run_incremental(config, lake)
    assert_delta_equals_postgres(pg.dsn, "public.t", config.table_path("public", "t"), key=["id"])


def test_a_table_lock_is_shared_by_drains_and_exclusive_to_a_snapshot(pg: PgDatabase) -> None:
    """The lock itself: shared holders coexist, an exclusive one waits for them, a closed session frees it."""
    first, second, snapshot = (TableLocks(pg.dsn, "s", what, 0.3) for what in ("drain", "drain", "snapshot"))
    try:
        first.acquire("/lake/public/t", exclusive=False)
        second.acquire("/lake/public/t", exclusive=False)
        with pytest.raises(TableBusyError, match="pgcdc drain .*, pgcdc drain "):
            snapshot.acquire("/lake/public/t", exclusive=True)
        snapshot.acquire("/lake/public/other", exclusive=True)
        first.release("/lake/public/t")
        second.close()
        snapshot.acquire("/lake/public/t", exclusive=True)
        with pytest.raises(TableBusyError, match="pgcdc snapshot "):
            first.acquire("/lake/public/t", exclusive=False)
        other_pipeline = TableLocks(pg.dsn, "another slot", "drain", 0.3)
        other_pipeline.acquire("/lake/public/t", exclusive=False)  # another pipeline's key
        other_pipeline.close()
    finally:
        for locks in (first, second, snapshot):
            locks.close()
