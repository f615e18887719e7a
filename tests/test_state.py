"""The pgcdc state table and the lazy per-table log reads (docs/contracts.md, "pgcdc state and per-table log reads"), against PostgreSQL 15 and 18 and Sail.

A drain reads a table's own log only when it meets a change for that table; the state table
(``resources/delta/state_table.py``) answers the rest. These tests make the state stale or
wrong in each way a crash or a re-snapshot can, and check that the drain still skips and
applies exactly (Delta equal to PostgreSQL after every drain); and they count the log reads
of a drain over many tables. The crashes at the other fault points end with the state checked
too (``test_incremental.py::test_sigkill_at_each_fault_point_then_rerun_is_exact``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import deltalake
import pytest
import yaml
from pyspark.sql import SparkSession

from resources.config import parse_config, PgcdcConfig
from resources.crash_points import FAULT_POINT_ENV
from resources.delta import table_log
from resources.delta.destination import TableLog
from resources.delta.layout import HASH, TableLayout
from resources.delta.spark_destination import lake_destination, SparkDeltaDestination
from resources.delta.state_table import read_state, state_path, StateRow, write_state
from resources.lsn import LSN
from resources.names import ColumnNumbers
from resources.postgres.catalog import TableName
from resources.runs.incremental import IncrementalResult, run_incremental
from resources.runs.snapshot import snapshot_table, snapshot_tables
from resources.testing.verify import assert_delta_equals_postgres
from tests.support.postgres import PgDatabase

pytest_plugins = ["tests.support.spark_fixtures"]

SLOT = "pgcdc_slot"


def configure(pg: PgDatabase, tmp_path: Path, ddl: str) -> PgcdcConfig:
    pg.execute(ddl)
    return parse_config(
        {
            "postgres": {"dsn": pg.dsn},
            "publication": "pub",
            "slot": SLOT,
            "delta": {"root": str(tmp_path / "lake")},
        }
    )


def path_of(config: PgcdcConfig, table: str) -> str:
    return config.table_path("public", table)


def version_of(config: PgcdcConfig, table: str) -> int:
    return deltalake.DeltaTable(path_of(config, table)).version()


def state_of(spark: SparkSession, config: PgcdcConfig) -> dict[str, StateRow]:
    return read_state(state_path(config.delta.root, config.slot))


def resnapshot_without_state(pg: PgDatabase, config: PgcdcConfig, spark: SparkSession, table: str) -> None:
    """A snapshot whose process died after its Delta commit, before its state write (snapshot_table
    alone writes no state row)."""
    snapshot_table(
        pg.dsn, "pub", TableName("public", table), SparkDeltaDestination(spark, None), path_of(config, table), slot=SLOT
    )


def crashing_child(config: PgcdcConfig, tmp_path: Path, fault: str) -> subprocess.CompletedProcess[str]:
    """One drain in a child process that SIGKILLs itself at ``fault`` (resources/crash_points.py)."""
    config_file = tmp_path / "pgcdc.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump()))
    return subprocess.run(
        [sys.executable, "-m", "tests.support.incremental_child", str(config_file), "1000"],
        env={**os.environ, FAULT_POINT_ENV: fault},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent.parent,
    )


def drained(pg: PgDatabase, config: PgcdcConfig, spark: SparkSession, expected: dict[str, int]) -> IncrementalResult:
    """One drain; then every table equals PostgreSQL (``expected``: its row count; key ``id`` or none)
    and every state row and reported version is the table's real newest version."""
    result = run_incremental(config, lake_destination(spark, config), log=print)
    for table, rows in expected.items():
        key = ("id",) if table != "journal" else ()
        assert assert_delta_equals_postgres(pg.dsn, f"public.{table}", path_of(config, table), key=key) == rows
    for table, row in state_of(spark, config).items():
        name = table.removeprefix("public.")
        assert row.log.version == version_of(config, name) == result.tables[table].delta_version, table
    return result


def test_stale_wrong_and_missing_state_rows_never_change_what_is_applied(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    config = configure(
        pg,
        tmp_path,
        """
        CREATE TABLE acct (id int PRIMARY KEY, n int);
        CREATE TABLE journal (entry int, note text);
        INSERT INTO acct VALUES (1, 0), (2, 0);
        INSERT INTO journal VALUES (0, 'seed');
        CREATE PUBLICATION pub FOR TABLE acct, journal;
    """,
    )
    snapshots = {str(r.table): r for r in snapshot_tables(config, lake_destination(spark, config))}
    state = state_of(spark, config)
    assert {t: (r.log.snapshot_lsn, r.log.snapshot_version, r.log.version, r.log.layout) for t, r in state.items()} == {
        t: (s.snapshot_lsn, s.delta_version, s.delta_version, s.layout) for t, s in snapshots.items()
    }
    assert state["public.acct"].log.layout is not None  # keyed: bucketed

    # SIGKILL once every Delta commit of the drain is durable, before the state write and the
    # final confirm: the state is behind both tables, the rerun replays the drain (the keyless
    # table's append marker, in a commit the state does not know, makes it skip the replay).
    pg.execute("UPDATE acct SET n = 1 WHERE id = 1; INSERT INTO journal VALUES (1, 'one')")
    versions = {table: version_of(config, table) for table in ("acct", "journal")}
    killed = crashing_child(config, tmp_path, "before_state_write")
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert {t: version_of(config, t) for t in versions} == {t: v + 1 for t, v in versions.items()}
    assert {t: r.log.version for t, r in state_of(spark, config).items()} == {
        f"public.{t}": v for t, v in versions.items()
    }
    first = drained(pg, config, spark, {"acct": 2, "journal": 2})
    assert first.tables["public.journal"].inserted == 0 and first.changes_skipped == 1  # applied before the crash
    # The drain's rows keep the column numbers the snapshot markers recorded (for once log cleanup removes them).
    relids = dict(
        pg.execute("SELECT 'public.' || relname, oid::int8 FROM pg_class WHERE relname IN ('acct', 'journal')")
    )
    assert {t: r.log.columns for t, r in state_of(spark, config).items()} == {
        "public.acct": ColumnNumbers({"id": 1, "n": 2}, 2, relids["public.acct"]),
        "public.journal": ColumnNumbers({"entry": 1, "note": 2}, 2, relids["public.journal"]),
    }

    # A re-snapshot whose state write was lost: the state names the old snapshot. The rows
    # inserted before the new snapshot are in it; applying them again would duplicate them.
    pg.execute("INSERT INTO journal VALUES (2, 'in the new snapshot')")
    old_row = state_of(spark, config)["public.journal"]
    resnapshot_without_state(pg, config, spark, "journal")
    assert state_of(spark, config)["public.journal"] == old_row
    pg.execute("INSERT INTO journal VALUES (3, 'after the new snapshot')")
    second = drained(pg, config, spark, {"acct": 2, "journal": 4})
    assert second.changes_skipped == 1 and second.tables["public.journal"].inserted == 1
    assert state_of(spark, config)["public.journal"].log.snapshot_version > old_row.log.snapshot_version

    # A row claiming a later snapshot than the table's log holds (a lost race, a corrupt row):
    # believed, it would skip the next change of acct. The log's snapshot commit says otherwise.
    real = state_of(spark, config)
    forged = real["public.acct"]
    ((now,),) = pg.execute("SELECT pg_current_wal_lsn()::text")
    lying = replace(forged.log, snapshot_lsn=LSN.parse(now) + 1_000_000, applied_marker=None)
    write_state(state_path(config.delta.root, SLOT), real, [StateRow(forged.table, forged.path, lying, None)])
    # And a row one commit behind (a crash after an intermediate confirm, before the state write).
    behind = real["public.journal"]
    write_state(
        state_path(config.delta.root, SLOT),
        state_of(spark, config),
        [
            StateRow(
                behind.table,
                behind.path,
                replace(behind.log, version=behind.log.version - 1, applied_marker=None),
                None,
            )
        ],
    )
    pg.execute("UPDATE acct SET n = 2 WHERE id = 2; INSERT INTO journal VALUES (4, 'four')")
    third = drained(pg, config, spark, {"acct": 2, "journal": 5})
    assert third.tables["public.acct"].updated == 1 and third.tables["public.journal"].inserted == 1

    # A table added to the publication later: unknown to the state, read from its log every run
    # until it has a snapshot; its snapshot's state write lost too.
    pg.execute(
        "CREATE TABLE extra (id int PRIMARY KEY); ALTER PUBLICATION pub ADD TABLE extra; INSERT INTO extra VALUES (1)"
    )
    fourth = run_incremental(config, lake_destination(spark, config), log=print)
    assert fourth.tables_without_snapshot == ["public.extra"] and "public.extra" not in state_of(spark, config)
    resnapshot_without_state(pg, config, spark, "extra")
    pg.execute("INSERT INTO extra VALUES (2)")
    fifth = drained(pg, config, spark, {"acct": 2, "journal": 5, "extra": 2})
    assert fifth.tables_without_snapshot == [] and fifth.tables["public.extra"].inserted == 1
    assert "public.extra" in state_of(spark, config)

    # A listed table whose Delta table went away: its changes are skipped, its row forgotten. And a row
    # claiming another layout (believed, the MERGE would look for acct's row in another bucket and
    # insert a second one): the snapshot commit's marker says otherwise.
    shutil.rmtree(path_of(config, "extra"))
    real = state_of(spark, config)
    other_layout = replace(real["public.acct"].log, layout=TableLayout(HASH, ("id",), 7))
    write_state(
        state_path(config.delta.root, SLOT),
        real,
        [StateRow("public.acct", path_of(config, "acct"), other_layout, None)],
    )
    pg.execute("INSERT INTO extra VALUES (3); UPDATE acct SET n = 3 WHERE id = 1")
    sixth = drained(pg, config, spark, {"acct": 2, "journal": 5})
    assert sixth.tables_without_snapshot == ["public.extra"] and sixth.tables["public.extra"].delta_version is None
    assert "public.extra" not in state_of(spark, config) and not Path(path_of(config, "extra")).exists()
    assert state_of(spark, config)["public.acct"].log.layout == snapshots["public.acct"].layout


def test_a_drain_reads_the_logs_of_the_tables_with_changes_only(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    tables = [f"t{i}" for i in range(12)]
    config = configure(
        pg,
        tmp_path,
        "".join(f"CREATE TABLE {t} (id int PRIMARY KEY, n int); INSERT INTO {t} VALUES (1, 0);" for t in tables)
        + f"CREATE PUBLICATION pub FOR TABLE {', '.join(tables)};",
    )
    snapshot_tables(config, lake_destination(spark, config))
    destination_reads: list[str] = []
    log_files: list[str] = []

    class CountingDestination(SparkDeltaDestination):
        def read_table_log(self, path: str, known: TableLog | None) -> TableLog:
            destination_reads.append(path)
            return super().read_table_log(path, known)

    real_read = table_log._Log.read

    def counted_read(log: table_log._Log, name: str) -> str | None:
        log_files.append(log.directory)
        return real_read(log, name)

    counting = CountingDestination(spark, None)
    monkeypatch.setattr(table_log._Log, "read", counted_read)
    log_files.clear()
    versions = {t: version_of(config, t) for t in tables}

    idle = run_incremental(config, counting)
    table_logs = [directory for directory in log_files if "/_pgcdc/" not in directory]  # not the state's own log
    assert destination_reads == [] and table_logs == [] and idle.changes == 0
    assert {t: idle.tables[f"public.{t}"].delta_version for t in tables} == versions

    pg.execute("UPDATE t7 SET n = 1")
    one = run_incremental(config, counting)
    changed = path_of(config, "t7")
    assert destination_reads == [changed, changed]  # met, then re-read for its state row
    table_logs = [directory for directory in log_files if "/_pgcdc/" not in directory]
    # Its log, read a bounded number of times: the marker walk, the state row's re-read, the schema's metaData.
    assert set(table_logs) == {f"{changed}/_delta_log"} and len(table_logs) <= 10
    assert one.tables["public.t7"].updated == 1 and one.tables["public.t7"].delta_version == version_of(config, "t7")
    assert assert_delta_equals_postgres(pg.dsn, "public.t7", changed, key=("id",)) == 1
