"""pgcdc on the engines beyond embedded Sail: Apache Spark with Delta (managed by pgcdc, and a
standalone cluster behind a Spark Connect server) and Sail's standalone server.

A JVM engine costs 15-40 s to start and seconds per Delta statement on two cores, so each engine
(``tests/support/engine_fixtures.py``, one at a time, shared by every test that runs on it) walks one
scenario instead of several tests that each set one up
(:func:`test_lifecycle_kill_and_crash_match_postgres`), compared with PostgreSQL after every step by
``resources/testing/verify.py`` (delta-rs, independent of the writer):

1. lifecycle: snapshot, drains under concurrent writes, re-snapshot of one table (adopting buckets,
   as a table an earlier pgcdc wrote does), log cleanup of that table's snapshot commits (its layout
   then comes from the pgcdc state: no table property names it), TRUNCATE, ADD COLUMN with a default, a REPLICA IDENTITY FULL table with identical rows, a keyless table, and
   timestamps at PostgreSQL's ``infinity``, then maintenance after those drains (Delta's own
   commands over Spark Connect on the cluster, delta-rs on Sail's server; ``UNMAINTAINED``). The
   cluster's walk is shorter (``SHORT_WALK``): its executors run in another JVM, so it keeps the steps
   whose work they do (the drains' MERGEs and appends, TRUNCATE, maintenance) and leaves re-snapshot,
   log cleanup and ADD COLUMN to the managed engine;
2. the engine SIGKILLed during a drain in another process: one-line failure within seconds, the
   slot not moved past Delta, exact after a restart;
3. a crash point (the drain process SIGKILLs itself; ``CRASH_POINT``, all points run on embedded
   Sail); on the managed engine the crashed process had started its own Spark JVM, which must die with it.

``spark-local`` also runs a short seeded randomized workload (tests/support/workload.py) and the
object-storage lifecycle of tests/test_object_storage.py on ``s3://`` through S3A. Which test
runs on which engine: docs/testing.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import TextIO

import deltalake
import pytest
import yaml
from pyspark.sql import SparkSession

from resources.config import parse_config, PgcdcConfig
from resources.crash_points import FAULT_POINT_ENV
from resources.delta.deletion_vectors import file_deletions
from resources.delta.lake_storage import LakeStorage
from resources.delta.maintenance import (
    describe,
    maintain_table,
    MAINTENANCE_OPERATIONS,
    RETENTION_PROPERTIES,
)
from resources.delta.markers import layout_from_property, LAYOUT_PROPERTY, pgcdc_marker
from resources.delta.spark_destination import lake_destination, SparkDeltaDestination
from resources.delta.table_files import storage_files
from resources.delta.table_log import read_table_log, read_table_metadata, unfinished_create
from resources.engines.capabilities import (
    DELTA_SPARK_CAPABILITIES,
    engine_capabilities,
    EngineCapabilities,
    set_engine_capabilities,
)
from resources.engines.engine import SparkEngine
from resources.engines.kept_spark import SERVERS_DIR_ENV
from resources.engines.spark_server import DELTA_PACKAGE, DELTA_VERSION, free_port
from resources.lsn import LSN
from resources.postgres.catalog import TableName
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables, SnapshotProgress
from resources.testing.local_postgres import LocalPostgres, start_local_postgres
from resources.testing.verify import assert_buckets_right, assert_delta_equals_postgres, delta_rows
from tests.support.deletion_vectors import assert_deletion_vectors
from tests.support.postgres import PgDatabase, POSTGRES_VERSIONS, TEST_SERVER_SETTINGS

pytest.register_assert_rewrite(
    "tests.support.engine_fixtures", "tests.support.s3_fixtures"
)  # imported here before pytest loads them as plugins
from tests.support.busy_drain import assert_busy_exact, BUSY_DDL, busy_workload, settle, with_write_concurrency
from tests.support.delta_log import clean_log, commit_bytes, live_data_files, stale_data_files
from tests.support.engine_fixtures import ENGINES, EngineUnderTest, group_alive, SUITE_SPARK_CONFIG
from tests.support.fault_child import SNAPSHOT_WRITER_ENV
from tests.support.fault_runs import (
    assert_never_truncated_exact,
    assert_one_line_failure,
    backlog,
    Child,
    confirmed,
    NEVER_TRUNCATED_DDL,
    REPO,
    rerun_converges,
    SLOT,
    wait_mid_drain,
)
from tests.support.history_oracle import assert_as_of_equals, capture
from tests.support.key_range_writer import Writer
from tests.support.key_shapes import (
    IDENTITY_CHANGES,
    key_shapes_config,
    key_shapes_ddl,
    PublisherOracle,
    run_key_shapes,
    SHAPES,
)
from tests.support.object_storage_lifecycle import lifecycle as object_storage_lifecycle
from tests.support.poisons import DDL as POISONS_DDL, round_of_changes
from tests.support.randomized_replay import Replay
from tests.support.s3_fixtures import S3Server
from tests.support.workload import generate

pytest_plugins = ["tests.support.engine_fixtures", "tests.support.s3_fixtures"]
pytestmark = (
    pytest.mark.spark
)  # the JVM engines, Sail's standalone server and a classic session in a child; tiers: docs/testing.md

LIFECYCLE_DDL = (
    NEVER_TRUNCATED_DDL
    + """
    CREATE TABLE acct (id int PRIMARY KEY, balance int, note text, seen timestamptz);
    CREATE TABLE dup (k int, v text);
    ALTER TABLE dup REPLICA IDENTITY FULL;
    CREATE TABLE journal (entry int, note text, at timestamptz);
    INSERT INTO acct SELECT g, 0, 'start',
        (CASE g % 3 WHEN 0 THEN 'infinity' WHEN 1 THEN '-infinity' ELSE '2024-05-01 10:00+00' END)::timestamptz
      FROM generate_series(1, 300) g;
    INSERT INTO dup VALUES (1, 'a'), (1, 'a'), (1, 'a'), (2, 'b'), (2, 'b'), (3, NULL), (3, NULL);
    INSERT INTO journal VALUES (-1, 'seed', 'infinity');
    CREATE PUBLICATION pub FOR TABLE acct, dup, journal, ledger, tally;
"""
)
"""``infinity`` (stored at the int64 microsecond limits) is the regression test of Spark's INT96
timestamps, which delta-rs cannot read there (resources/delta/dataframes.py: WRITE_SETTINGS)."""
#: The lifecycle's table on the copy-on-write opt-out (``delta.deletion_vectors_tables``).
LIFECYCLE_COPY_ON_WRITE = ("public.dup",)
#: The lifecycle's history tables on the managed engine (Delta on Spark; every other history test runs on
#: embedded Sail, tests/test_history.py): acct's versions through bucket adoption, TRUNCATE and a fill,
#: changelogs of the keyless and the REPLICA IDENTITY FULL table.
LIFECYCLE_HISTORY = {"public.acct": "scd2", "public.dup": "changelog", "public.journal": "changelog"}
#: Tests that run on the managed Spark engine only: its JVM is up anyway, and the other engines
#: add nothing to them that the lifecycle walk does not cover.
SPARK_LOCAL_ONLY = {
    "test_faults_of_two_tables_on_spark_quarantine_them_and_the_others_flow",
    "test_randomized_workload_on_spark_matches_postgres",
    "test_lifecycle_on_s3_with_apache_spark_and_delta",
    "test_snapshot_in_key_ranges_on_spark_with_an_empty_range_matches_postgres",
    "test_key_shapes_and_a_replica_identity_change_on_spark_match_postgres",
    "test_a_snapshot_killed_on_spark_recovers_on_the_next_run",
    "test_maintenance_on_spark_purges_deletion_vectors_and_stays_exact",
    "test_snapshot_on_spark_by_delta_rs_gives_sparks_own_table",
    "test_a_busy_drain_on_spark_commits_tables_side_by_side_and_replays_a_kill_exactly",
}
#: The crash point each engine's walk ends with. Delta on Spark meets the point whose replay reads what the
#: engine committed (``after_delta_commit``) on the managed engine, in a process with its own JVM, which must
#: die with it; the cluster's Connect server writes through the same Delta on Spark and its walk ends with its
#: server SIGKILLed mid-drain instead (a restarted JVM's re-run: minutes on two cores). Every point runs on
#: embedded Sail in the module of its topic (docs/testing.md, "Which engine runs which test").
CRASH_POINT = {"spark-local": "after_delta_commit", "sail-server": "after_confirm"}
#: The engines whose server the lifecycle walk SIGKILLs mid-drain. The managed engine is a Spark Connect
#: server like the cluster's, so a drain meets its death on the same client path; its own test is that
#: its JVM dies with the process that started it (its crash point), which needs no second JVM start.
KILLED_MID_DRAIN = frozenset({"spark-cluster", "sail-server"})
#: The engines whose walk is the short one: snapshot, a drain under writes, a drain with the FULL table's
#: changes and the TRUNCATEs, maintenance, then the engine's kill. What a standalone cluster adds over the
#: managed engine's ``local[2]`` is where the work runs: executors in another JVM (the worker's) write and read
#: the lake's files, for the MERGEs (bucket-pruned, with deletion vectors and copy-on-write, FULL identical
#: rows, ``infinity`` timestamps), the keyless appends, TRUNCATE and Delta's maintenance commands; its Connect
#: server killed mid-drain and restarted is the walk's own step. The rest of the long walk (re-snapshot
#: adopting buckets, whose rows delta-rs writes on Delta on Spark, log cleanup, ADD COLUMN with a default) is
#: pgcdc's side, the same on every Delta on Spark; the managed engine walks it with history on, Sail's server
#: too. On the cluster those steps were a sixth of the walk (a drain of about 20 s each on two busy cores).
SHORT_WALK = frozenset({"spark-cluster"})
#: The engines whose walk runs no maintenance. The managed engine's would run the cluster's commands on the
#: same client path (Delta on Spark over Spark Connect) and the same tables, without the executors in another
#: JVM that the cluster adds; test_maintenance_on_spark_purges_deletion_vectors_and_stays_exact maintains on
#: the managed engine (deletion vectors purged above the ratio), and its maintenance step cost the walk over a
#: minute on two cores.
UNMAINTAINED = frozenset({"spark-local"})
#: Each engine runs against one PostgreSQL version, together covering all of them: a JVM engine costs
#: minutes per pass on two cores. Sail's server runs the newest only: what the server's version changes
#: (the stream, the slot) is pgcdc's side, which embedded Sail runs on every version (tests/test_faults.py
#: for the engine killed mid-drain and every crash point), and the managed engine's walk runs on the oldest.
ENGINE_VERSIONS = {
    "spark-local": POSTGRES_VERSIONS[:1],
    "spark-cluster": POSTGRES_VERSIONS[-1:],
    "sail-server": POSTGRES_VERSIONS[-1:],
}


@pytest.fixture(scope="session")
def pg_server(request: pytest.FixtureRequest) -> Iterator[LocalPostgres]:
    """conftest's server, parametrized here rather than over every version (see ENGINE_VERSIONS)."""
    server = start_local_postgres(request.param, TEST_SERVER_SETTINGS)
    try:
        yield server
    finally:
        server.destroy()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One session-wide engine instance per name, shared by every test that runs on it, paired
    with the PostgreSQL versions it runs against."""
    if "engine" in metafunc.fixturenames:
        names = ["spark-local"] if metafunc.function.__name__ in SPARK_LOCAL_ONLY else ENGINES
        pairs = [(name, version) for name in names for version in ENGINE_VERSIONS[name]]
        metafunc.parametrize(
            ("engine", "pg_server"), pairs, indirect=True, scope="session",
            ids=[f"{name}-pg{version}" for name, version in pairs],
        )  # fmt: skip
    elif "pg_server" in metafunc.fixturenames:  # the classic session: one JVM start, the newest version
        metafunc.parametrize("pg_server", POSTGRES_VERSIONS[-1:], indirect=True, scope="session",
                             ids=[f"pg{POSTGRES_VERSIONS[-1]}"])  # fmt: skip


def engine_config(
    pg: PgDatabase,
    tmp_path: Path,
    engine: EngineUnderTest,
    buckets: dict[str, object] | None = None,
    snapshot: dict[str, object] | None = None,
    copy_on_write: tuple[str, ...] = (),
    history: dict[str, str] | None = None,
    **spark: object,
) -> PgcdcConfig:
    """pgcdc configured as a user would for this engine: ``spark.remote`` is its URL; the tables
    ``copy_on_write`` opted out of deletion vectors; ``history``: schema.table -> its history mode."""
    return parse_config({
        "postgres": {"dsn": pg.dsn},
        "publication": "pub",
        "slot": SLOT,
        "delta": {"root": str(tmp_path / "lake"), "buckets": buckets or {},
                  "deletion_vectors_tables": {name: False for name in copy_on_write}},
        "snapshot": snapshot or {},
        "spark": {"remote": engine.url, **spark},
        "history": {"tables": history or {}},
    })  # fmt: skip


def write_config(config: PgcdcConfig, tmp_path: Path) -> Path:
    path = tmp_path / "pgcdc.yaml"
    path.write_text(yaml.safe_dump(config.model_dump()), encoding="utf-8")
    return path


def assert_lake_exact(pg: PgDatabase, config: PgcdcConfig, acct_rows: int | None = None) -> None:
    acct = assert_delta_equals_postgres(pg.dsn, "public.acct", config.table_path("public", "acct"), key=("id",))
    assert acct_rows is None or acct == acct_rows
    assert_delta_equals_postgres(pg.dsn, "public.dup", config.table_path("public", "dup"))
    assert_delta_equals_postgres(pg.dsn, "public.journal", config.table_path("public", "journal"))
    assert_never_truncated_exact(pg, config)


FULL_IDENTITY_CHANGES = """
    UPDATE dup SET v = 'c' WHERE ctid = (SELECT min(ctid) FROM dup WHERE k = 1 AND v = 'a');
    DELETE FROM dup WHERE ctid = (SELECT min(ctid) FROM dup WHERE k = 3);
    INSERT INTO dup VALUES (2, 'b');
"""
"""One of several identical copies changes, one NULL-holding copy goes, one more copy comes."""
TRUNCATES = """
    TRUNCATE journal; INSERT INTO journal VALUES (1, 'after'), (1, 'after');
    TRUNCATE acct; INSERT INTO acct SELECT g, g, 'reborn' FROM generate_series(1, 50) g;
"""
"""TRUNCATE of the keyless table and of a keyed one, with rows after it."""


def writes(pg: PgDatabase, transactions: int, offset: int) -> None:
    with pg.connect() as conn:
        for i in range(transactions):
            with conn.transaction():
                conn.execute(
                    "UPDATE acct SET balance = balance + 1, note = %s, seen = 'infinity' WHERE id = %s",
                    (f"w{i}", 1 + i % 50),
                )
                conn.execute("INSERT INTO journal VALUES (%s, 'w', '-infinity')", (offset + i,))
                conn.execute("INSERT INTO dup VALUES (%s, 'x'), (%s, 'x')", (i % 3, i % 3))


@pytest.mark.timeout(1800)  # three scenarios of the suite's 600 s each, on a JVM on two shared cores
def test_lifecycle_kill_and_crash_match_postgres(engine: EngineUnderTest, pg: PgDatabase, tmp_path: Path) -> None:
    spark = engine.spark
    assert spark is not None
    # The seam says what the engine is; nothing below depends on it but the cost.
    assert engine_capabilities(spark).delta_commands == engine.name.startswith("spark")
    pg.execute(LIFECYCLE_DDL)
    # dup (REPLICA IDENTITY FULL, identical rows) copy-on-write, the opt-out; acct and tally with deletion vectors
    history = LIFECYCLE_HISTORY if engine.name == "spark-local" else None
    config = engine_config(pg, tmp_path, engine, copy_on_write=LIFECYCLE_COPY_ON_WRITE, history=history)
    moments: list[LSN] = []  # acct as PostgreSQL held it at quiet moments (tests/support/history_oracle.py)

    def capture_acct() -> None:
        if history:
            with pg.connect() as conn:
                moments.append(capture(conn, len(moments), ["public.acct"])[0])

    timings: dict[str, float] = {}

    def step(label: str, action: Callable[[], object]) -> None:
        started = time.monotonic()
        action()
        timings[label] = round(time.monotonic() - started, 1)

    short = engine.name in SHORT_WALK
    # acct as an earlier pgcdc wrote it (unbucketed); its re-snapshot below adopts buckets. The short walk
    # has no re-snapshot: its acct is bucketed from the start, so its MERGEs carry bucket predicates.
    unbucketed = engine_config(
        pg,
        tmp_path,
        engine,
        {"tables": {"public.acct": {"bucketed": False}}},
        copy_on_write=LIFECYCLE_COPY_ON_WRITE,
        history=history,
    )
    step("snapshot", lambda: snapshot_tables(config if short else unbucketed, SparkDeltaDestination(spark, None)))
    assert_deletion_vectors(config, {"public.acct": True, "public.dup": False, "public.tally": True})
    assert_lake_exact(pg, config, 300)

    # Drains while another connection keeps writing: whatever the first drain misses, the next one gets.
    writer = threading.Thread(target=writes, args=(pg, 20, 0))
    writer.start()
    # In chunks of 40 changes on the long walk: the managed engine's SCD type 2 versions across chunks of one
    # drain. The short walk's drain is one chunk; its killed drain below runs in chunks.
    chunked = {} if short else {"max_chunk_changes": 40}
    step("drain under writes", lambda: run_incremental(config, lake_destination(spark, config), **chunked))
    writer.join()
    capture_acct()
    # REPLICA IDENTITY FULL with identical rows (one copy changes, one NULL-holding copy goes), drained with
    # what the writer left: a drain on a JVM costs seconds a table, whatever it holds. The short walk's
    # TRUNCATEs come in the same drain: they give acct and journal files its maintenance must vacuum.
    pg.execute(FULL_IDENTITY_CHANGES + (TRUNCATES if short else ""))
    step("drain on FULL identity" + (" with TRUNCATE" if short else ""),
         lambda: run_incremental(config, lake_destination(spark, config)))  # fmt: skip
    assert_lake_exact(pg, config, 50 if short else 300)
    if not short:
        lifecycle_of_acct(pg, spark, config, step, capture_acct)
    if (
        history
    ):  # the changelogs folded whole and acct's current versions equal the tables; acct's versions at each moment
        step("history as of", lambda: [
            *(assert_as_of_equals(pg, spark, config, table, None, table) for table in LIFECYCLE_HISTORY),
            *(assert_as_of_equals(pg, spark, config, "public.acct", lsn, f"public.past_{k}_acct") for k, lsn in enumerate(moments)),
        ])  # fmt: skip

    if engine.name not in UNMAINTAINED:
        step("maintenance", lambda: maintenance_after_drains(pg, spark, config, engine.name))
    assert_lake_exact(pg, config, 50)

    # The crash first, on the server the walk has warmed: after the kill, a restarted server's first
    # MERGEs are a cold JVM's (tens of seconds each on two shared cores).
    if engine.name in CRASH_POINT:
        step(f"crash at {CRASH_POINT[engine.name]}, re-run", lambda: crash_point(engine, pg, tmp_path))
    if engine.name in KILLED_MID_DRAIN:
        step("engine killed mid-drain, restart, re-run", lambda: engine_killed_mid_drain(engine, pg, tmp_path, config))
    print(f"{engine.name} (PostgreSQL {pg.major}) seconds: {timings}")


def maintenance_after_drains(pg: PgDatabase, spark: SparkSession, config: PgcdcConfig, engine_name: str) -> None:
    """Maintenance after the walk's drains, with the engine's own commands where it has them (Delta on Spark,
    over Spark Connect) and delta-rs otherwise, at a one-second retention: every file the drains replaced is
    deleted, the rows stay; the kill below runs on the maintained tables."""
    maintained_paths = [config.table_path("public", name) for name in ("acct", "dup", "journal")]
    newest_commit_s = max(deltalake.DeltaTable(path).history(1)[0]["timestamp"] for path in maintained_paths) / 1000
    time.sleep(max(0.0, newest_commit_s + 1.5 - time.time()))  # the replaced files are older than the retention
    # The data files the drains replaced, by name: a live deletion vector file is on storage too, and
    # once compaction rewrites its data file it is too recent for the retention, so counts cannot say it.
    lake = LakeStorage(config.delta.root, config.delta.storage)
    replaced_by_drains = {path: stale_data_files(lake, path) for path in maintained_paths}
    read_before = {path: live_data_files(path) for path in maintained_paths}
    maintained = [
        maintain_table(path, lake, retention_hours=1 / 3600, target_file_bytes=1 << 27, spark=spark)
        for path in maintained_paths
    ]
    for done in maintained:
        assert done.method == ("spark" if engine_name.startswith("spark") else "delta-rs"), done
        replaced = replaced_by_drains[done.path]
        assert replaced and not replaced & storage_files(lake, done.path).keys(), (sorted(replaced), done)
        left = stale_data_files(lake, done.path)  # only what compaction replaced, too recent to vacuum
        assert left <= read_before[done.path] and len(left) <= done.files_compacted, (sorted(left), done)


def lifecycle_of_acct(
    pg: PgDatabase,
    spark: SparkSession,
    config: PgcdcConfig,
    step: Callable[[str, Callable[[], object]], None],
    capture_acct: Callable[[], None],
) -> None:
    """The long walk's middle: a re-snapshot of acct adopting buckets between changes, log cleanup of its
    snapshot commits, TRUNCATE of the keyless and a keyed table with rows after it, ADD COLUMN with a default.
    The cluster's walk leaves these out: pgcdc decides them the same way on every Delta on Spark (the rows of
    a re-snapshot are delta-rs's, the layout is read from the log and the state), the managed engine walks
    them with history on, and embedded Sail and Sail's server walk them too."""
    # Re-snapshot of one table between changes, then the changes on both sides of it.
    pg.execute("UPDATE acct SET note = 'before resnapshot' WHERE id <= 20")
    step("re-snapshot", lambda: snapshot_tables(config, lake_destination(spark, config), [TableName("public", "acct")]))
    capture_acct()  # after it: the versions it opened hold from its LSN (a change it absorbed is dated there)
    pg.execute("UPDATE acct SET note = 'after resnapshot' WHERE id BETWEEN 10 AND 30")
    step("drain after re-snapshot", lambda: run_incremental(config, lake_destination(spark, config)))
    assert_lake_exact(pg, config, 300)

    # Log cleanup removes the snapshot commits of acct: no table property names its layout (Delta on
    # Spark refuses it; Sail's says "created unbucketed"), the drains below use the pgcdc state's, kept
    # for acct's Delta id.
    acct = config.table_path("public", "acct")
    layout = read_table_log(acct).layout
    assert (
        layout is not None
        and layout_from_property(deltalake.DeltaTable(acct).metadata().configuration.get(LAYOUT_PROPERTY)) is None
    )
    clean_log(acct)

    # TRUNCATE of the keyless table and of a keyed one, with rows after it.
    pg.execute(TRUNCATES)
    capture_acct()
    step("drain with TRUNCATE", lambda: run_incremental(config, lake_destination(spark, config)))
    assert_lake_exact(pg, config, 50)

    # A column added with a default reaches the rows no change touched.
    pg.execute(
        "ALTER TABLE acct ADD COLUMN status text NOT NULL DEFAULT 'new'; UPDATE acct SET balance = -1 WHERE id = 1"
    )
    step("drain with ADD COLUMN", lambda: run_incremental(config, lake_destination(spark, config)))
    assert_lake_exact(pg, config, 50)
    assert assert_buckets_right(acct, known=layout) == layout


def engine_killed_mid_drain(engine: EngineUnderTest, pg: PgDatabase, tmp_path: Path, config: PgcdcConfig) -> None:
    """SIGKILL of the engine's server (the Spark Connect JVM or the Sail server) while a drain
    in another process is applying chunks: that process fails within seconds with one line,
    the slot stays where the last durable chunk put it, and after a restart the next run is exact."""
    start = confirmed(pg)
    backlog(pg, 60)
    child = Child(write_config(config, tmp_path), chunk=40)
    try:
        wait_mid_drain(pg, child, start, timeout=180)
        engine.kill()
        killed = time.monotonic()
        line = assert_one_line_failure(child, "EngineUnavailable", f"Spark engine at {engine.url} stopped answering (")
        took = time.monotonic() - killed
    finally:
        child.kill()
    # The bound is assert_one_line_failure's wait (120 s): several times the seconds it takes, far
    # below a gRPC client retrying a dead server forever.
    print(f"{engine.name}: failed {took:.1f} s after the kill: {line}")
    after_failure = confirmed(pg)
    engine.restart()
    assert confirmed(pg) == after_failure  # nothing moved the slot meanwhile
    rerun_converges(
        pg, engine_config(pg, tmp_path, engine), engine.spark, exact=assert_lake_exact
    )  # new port if managed


def crash_point(engine: EngineUnderTest, pg: PgDatabase, tmp_path: Path) -> None:
    """The drain process SIGKILLs itself at the engine's fault point; the re-run applies exactly
    the rest. On the managed engine the crashed process had started its own Spark JVM
    (``spark.engine: spark``, ``keep_alive_s: 0``): that JVM must die with it, and nothing is kept. It
    interprets expressions as the suite's JVMs do: its cold start's first MERGEs are the step's cost, and
    the engine's defaults meet drains in ``pgcdc spark-server``'s test and the kept JVM's."""
    config = engine_config(pg, tmp_path, engine)
    # The child's first chunk (100 changes) is one transaction into the keyless ledger alone, where a chunk
    # applied twice would show: the crashed process's cold JVM makes one append before the point, not a
    # MERGE of each table (minutes on two busy cores); the re-run, on the warm engine, drains the backlog.
    pg.execute("INSERT INTO ledger SELECT g % 4, 'first chunk' FROM generate_series(1, 100) g")
    backlog(pg, 30)
    own_jvm = engine.name == "spark-local"
    child_config = (
        config.model_copy(
            update={
                "spark": config.spark.model_copy(
                    update={
                        "remote": None,
                        "engine": "spark",
                        "keep_alive_s": 0,
                        "config": SUITE_SPARK_CONFIG,
                    }
                )
            }  # fmt: skip
        )
        if own_jvm
        else config
    )
    kept_servers = tmp_path / "kept-servers"
    child = Child(
        write_config(child_config, tmp_path),
        chunk=100,
        env={FAULT_POINT_ENV: CRASH_POINT[engine.name], SERVERS_DIR_ENV: str(kept_servers)},
    )
    started = time.monotonic()
    try:
        assert child.wait(timeout=600) == -9, child.output()
    finally:
        child.kill()
    print(
        f"{engine.name}: the drain child crashed at {CRASH_POINT[engine.name]} after {time.monotonic() - started:.1f} s"
    )
    if own_jvm:
        jvm = int(child.out.read_text().split("engine up ", 1)[1].split()[0])
        deadline = time.monotonic() + 30
        while group_alive(jvm) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not group_alive(jvm), "the managed Spark JVM outlived the pgcdc process that started it"
        assert not kept_servers.exists(), "a run with keep_alive_s 0 left a kept server's state"
    rerun_converges(pg, config, engine.spark, exact=assert_lake_exact)


#: A short workload (17 steps, 5 runs of chunks of 100 and more) that covers unchanged TOAST, key
#: changes, identical rows of a REPLICA IDENTITY FULL table, a keyless table, TRUNCATE, ADD COLUMN,
#: re-snapshots, a table published mid-stream and timestamps at infinity; found with tests.support.workload.generate.
SPARK_WORKLOAD = (16325, 16)


def test_randomized_workload_on_spark_matches_postgres(engine: EngineUnderTest, pg: PgDatabase, tmp_path: Path) -> None:
    """tests/test_randomized.py's differential workload on Delta-on-Spark, exact against PostgreSQL
    after every run (seed 20240601 found the INT96 timestamps there; the longer seeds run on Sail)."""
    seed, ops = SPARK_WORKLOAD
    steps = generate(seed, ops)
    rendered = "\n".join(" ".join(step.statements) for step in steps if step.kind == "sql")
    for feature in ("TRUNCATE", "ADD COLUMN", "UPDATE dup_t", "INSERT INTO log_t", "UPDATE full_t", "infinity"):
        assert feature in rendered, (
            f"seed {seed} no longer covers {feature}: tests/support/workload.py changed, pick another"
        )
    replay = Replay(pg, tmp_path, engine.spark, seed, ops)
    replay.execute(steps)
    assert replay.most_duplicates > 0, "dup_t never held identical rows"
    print(f"{engine.name}: seed {seed}, {len(steps)} steps, runs {' '.join(replay.run_times)}")


#: The key shapes the engine's own MERGE and hash pruning are checked on: an array, a composite, a
#: mixed multi-column key, a primary key with INCLUDE columns, and a uuid key whose table gets
#: another replica identity index and then its primary key back.
SPARK_KEY_SHAPES = ("array", "composite", "mixed", "include", "uuid")


def test_key_shapes_and_a_replica_identity_change_on_spark_match_postgres(
    engine: EngineUnderTest, pg: PgDatabase, tmp_path: Path
) -> None:
    """tests/test_key_shapes.py's matrix, a subset (every Delta statement costs seconds on a JVM):
    MERGEs pruned by hash and range buckets, and one without a bucket predicate, exact against PostgreSQL."""
    shapes = [shape for shape in SHAPES if shape.name in SPARK_KEY_SHAPES]
    pg.execute(key_shapes_ddl(shapes))
    changes = [[change for change in round_ if change.table == "k_uuid"] for round_ in IDENTITY_CHANGES]
    config = key_shapes_config(pg, tmp_path / "lake", chunked=False, remote=engine.url)
    run_key_shapes(pg, config, engine.spark, PublisherOracle(pg, shapes), shapes, changes, 30, ("k_array", "k_include"))


KEY_RANGES_DDL = """
    CREATE TABLE big (id int PRIMARY KEY, v int, body text);
    ALTER TABLE big ALTER COLUMN body SET STORAGE EXTERNAL;
    INSERT INTO big SELECT g, g, CASE WHEN g % 50 = 0 THEN repeat(md5(g::text), 100) ELSE 'b' || g END
      FROM generate_series(1, 3000) g WHERE g <= 1000 OR g > 2000;
    CREATE TABLE flat (n int, s text);
    CREATE PUBLICATION pub FOR TABLE big;
"""
"""Keys 1-1,000 and 2,001-3,000: three ranges of equal width, the middle one (1,001-2,000) empty.
``flat`` takes the writer's inserts, unpublished: on a JVM every Delta write costs seconds."""


def test_snapshot_in_key_ranges_on_spark_with_an_empty_range_matches_postgres(
    engine: EngineUnderTest, pg: PgDatabase, tmp_path: Path
) -> None:
    """A snapshot in key ranges on Delta on Spark (docs/contracts.md, "Chunked snapshots in primary-key
    ranges") while another connection writes: three ranges of ``big``'s key, the middle one empty,
    whose replaceWhere commit adds and removes nothing yet must land with its marker (else the walk
    could not go on); every range commit keeps the layout the first one chose, which on Spark only
    the marker records (no table property). Then a drain: Delta equals PostgreSQL value for value."""
    spark = engine.spark
    assert spark is not None and engine_capabilities(spark).delta_commands
    pg.execute(KEY_RANGES_DDL)
    heap_mb = pg.execute("SELECT pg_catalog.pg_relation_size('big')")[0][0] / 2**20
    config = engine_config(
        pg, tmp_path, engine, {"tables": {"public.big": {"width": 1000}}},
        {"chunked_above_mb": heap_mb / 2, "key_chunk_mb": heap_mb / 2.5},  # three ranges, with room for the writer's growth
    )  # fmt: skip
    path = config.table_path("public", "big")
    started = time.monotonic()
    # Keys 1 and 3,000 stay (the ranges' bounds are fixed); none of the writer's keys is in the middle
    # range. It writes while the first two ranges are copied (into a copied range and one not copied
    # yet); then it stops: every further MERGE costs seconds on a JVM.
    with Writer(pg, seed=pg.major, keys=[*range(2, 1001), *range(2001, 3000)], pause=0.2) as writer:

        def stop_after_two_ranges(progress: SnapshotProgress) -> None:
            if progress.chunks_done >= 2:
                writer.stop.set()

        [result] = snapshot_tables(config, lake_destination(spark, config), on_progress=stop_after_two_ranges)
    walked = time.monotonic() - started
    assert writer.transactions > 10
    assert result.key_ranges and result.chunks == 3
    log = read_table_log(path)
    assert log.chunks is not None and log.chunks.next_range() is None and log.snapshot_lsn is not None
    assert log.chunks.limits(1) == (1001, 2001), log.chunks
    commits = range_commits(path)
    assert sorted(commits) == [0, 1, 2] and commits[1] == 0, commits  # the empty range's marker landed, no rows
    assert log.layout is not None and log.layout.key == ("id",)
    assert read_table_metadata(path).layout_property is None  # type: ignore[union-attr]  # Spark: the marker only
    assert assert_buckets_right(path) == log.layout
    pg.execute("UPDATE big SET v = -1 WHERE id IN (1, 3000); INSERT INTO big VALUES (3500, 0, 'after')")
    run_incremental(config, lake_destination(spark, config))
    assert assert_delta_equals_postgres(pg.dsn, "public.big", path, key=("id",)) > 1000
    print(f"{engine.name} (PostgreSQL {pg.major}): walk of {log.chunks.count} key ranges {walked:.1f} s, "
          f"{writer.transactions} concurrent transactions")  # fmt: skip


def test_a_snapshot_killed_on_spark_recovers_on_the_next_run(
    engine: EngineUnderTest, pg: PgDatabase, tmp_path: Path
) -> None:
    """Snapshot processes on Delta on Spark (connected to the engine, which outlives them) SIGKILLed
    under writes (docs/contracts.md, "Snapshot crash points"): first by delta-rs between its create and
    its commit (a lake moved from the embedded engine), then by the engine's writer while staging and
    right after its commit. Each next run goes on; the table delta-rs created is created again by
    Spark (its layout property, which Spark does not write, is gone); after a drain Delta equals
    PostgreSQL."""
    spark = engine.spark
    assert spark is not None and engine_capabilities(spark).delta_commands
    pg.execute(KEY_RANGES_DDL)
    config = engine_config(pg, tmp_path, engine, {"tables": {"public.big": {"width": 1000}}})
    config_file = write_config(config, tmp_path)
    path = config.table_path("public", "big")
    left = []
    with Writer(pg, seed=pg.major, pause=0.05) as writer:
        for point, snapshot_writer in (
            ("after_snapshot_create", "delta-rs"),
            ("during_snapshot_write", "engine"),
            ("after_snapshot_commit", "engine"),
        ):
            child = Child(config_file, "snapshot", env={FAULT_POINT_ENV: point, SNAPSHOT_WRITER_ENV: snapshot_writer})
            assert child.wait(300) == -9, (point, child.output())
            left.append((unfinished_create(path), read_table_log(path).snapshot_lsn is not None))
    assert writer.transactions > 0
    assert left == [(True, False), (False, False), (False, True)]
    assert read_table_metadata(path).layout_property is None  # type: ignore[union-attr]  # created again, by Spark
    snapshot_tables(config, lake_destination(spark, config))
    run_incremental(config, lake_destination(spark, config))
    assert assert_delta_equals_postgres(pg.dsn, "public.big", path, key=("id",)) > 1000
    assert assert_buckets_right(path) is not None


SNAPSHOT_TYPES_DDL = """
    CREATE TABLE typed (id bigint PRIMARY KEY, small int2, amount numeric(12,2), at timestamptz, naive timestamp,
                        day date, ok bool, raw bytea, tags text[], note text);
    INSERT INTO typed SELECT g, g % 100, g / 7.0, timestamptz '2024-01-01 00:00+00' + g * interval '1 minute',
        timestamp '2024-01-01' + g * interval '1 second', date '2020-01-01' + g % 3000, g % 2 = 0,
        decode(md5(g::text), 'hex'), ARRAY['a' || g, NULL], 'n' || g FROM generate_series(1, 3000) g;
    INSERT INTO typed VALUES (0, NULL, NULL, 'infinity', NULL, NULL, NULL, NULL, NULL, NULL);
    CREATE TABLE flat (k int, v text);
    INSERT INTO flat SELECT g % 7, 'v' || g FROM generate_series(1, 500) g;
    CREATE PUBLICATION pub FOR TABLE typed, flat;
"""


def _table_actions(path: str) -> dict[str, object]:
    """The newest protocol and metaData actions of the table at ``path`` (local log, no checkpoint yet)."""
    found: dict[str, object] = {}
    for commit in sorted((Path(path) / "_delta_log").glob("*.json")):
        for line in commit.read_text(encoding="utf-8").splitlines():
            action = json.loads(line)
            found.update({key: action[key] for key in ("protocol", "metaData") if key in action})
    return found


def _written_by_delta_rs(path: str, version: int) -> bool:
    """Whether commit ``version`` of the table at ``path`` was written by delta-rs (its commitInfo's engineInfo)."""
    lines = (Path(path) / "_delta_log" / f"{version:020d}.json").read_text(encoding="utf-8").splitlines()
    infos = [json.loads(line)["commitInfo"] for line in lines if line.startswith('{"commitInfo"')]
    return any("delta-rs" in info.get("engineInfo", "") for info in infos)


def test_snapshot_on_spark_by_delta_rs_gives_sparks_own_table(
    engine: EngineUnderTest, pg: PgDatabase, tmp_path: Path
) -> None:
    """On Delta on Spark a snapshot's rows are written by delta-rs into a table Spark created (an empty
    write with the snapshot's options): the same protocol, table properties, partitioning, schema and
    marker as Spark's own snapshot write of the same tables gives (compared with tables Spark wrote
    itself), bucketed and deletion-vector, keyless and copy-on-write; a process killed between the
    create and the snapshot commit leaves an unfinished create the next run takes over; drains
    (deletion vectors) and a re-snapshot into the existing table stay exact."""
    spark = engine.spark
    assert spark is not None and engine_capabilities(spark).delta_rs_snapshot_rows
    pg.execute(SNAPSHOT_TYPES_DDL)
    buckets = {"tables": {"public.typed": {"width": 1000}}}
    config = engine_config(pg, tmp_path, engine, buckets, {"parallel_tables": 1}, copy_on_write=("public.flat",))
    own = engine_config(pg, tmp_path / "own", engine, buckets, copy_on_write=("public.flat",))
    paths = {name: config.table_path("public", name) for name in ("typed", "flat")}
    child = Child(write_config(config, tmp_path), "snapshot", env={FAULT_POINT_ENV: "after_snapshot_create"})
    assert child.wait(300) == -9, child.output()
    assert sum(unfinished_create(path) for path in paths.values()) == 1
    assert all(read_table_log(path).snapshot_lsn is None for path in paths.values())
    snapshot_tables(config, lake_destination(spark, config))
    set_engine_capabilities(spark, EngineCapabilities(delta_commands=True, delta_rs_snapshots=False))  # Spark's own
    try:
        snapshot_tables(own, lake_destination(spark, own))
    finally:
        set_engine_capabilities(spark, DELTA_SPARK_CAPABILITIES)
    for name, path in paths.items():
        ours, sparks = _table_actions(path), _table_actions(own.table_path("public", name))
        assert ours["protocol"] == sparks["protocol"], name
        for key in ("schemaString", "partitionColumns", "configuration", "format"):
            assert ours["metaData"][key] == sparks["metaData"][key], (name, key)  # type: ignore[index]
        log, own_log = read_table_log(path), read_table_log(own.table_path("public", name))
        assert (log.snapshot_version, own_log.snapshot_version) == (1, 0), name  # after the engine's create
        assert (log.layout, log.columns) == (own_log.layout, own_log.columns), name
        assert _written_by_delta_rs(path, 1), name
        assert_delta_equals_postgres(pg.dsn, f"public.{name}", path, key=("id",) if name == "typed" else None)
    assert _table_actions(paths["typed"])["metaData"]["partitionColumns"] == ["_pgcdc_bucket"]  # type: ignore[index]
    pg.execute("UPDATE typed SET note = 'changed' WHERE id % 10 = 0; DELETE FROM typed WHERE id BETWEEN 5 AND 9;"
               "INSERT INTO typed (id, note) VALUES (5000, 'new'); INSERT INTO flat VALUES (1, 'more')")  # fmt: skip
    run_incremental(config, lake_destination(spark, config))
    deleted = file_deletions(LakeStorage(config.delta.root), paths["typed"])
    assert any(file.deleted for file in deleted)  # the drain's MERGE marked rows of delta-rs's files deleted
    [again] = snapshot_tables(config, lake_destination(spark, config), [TableName("public", "typed")])
    assert _written_by_delta_rs(paths["typed"], again.delta_version)  # into the existing table
    assert _table_actions(paths["typed"])["protocol"] == _table_actions(own.table_path("public", "typed"))["protocol"]
    pg.execute("UPDATE typed SET note = 'again' WHERE id % 7 = 0")
    run_incremental(config, lake_destination(spark, config))
    assert assert_delta_equals_postgres(pg.dsn, "public.typed", paths["typed"], key=("id",)) == 2997
    assert_delta_equals_postgres(pg.dsn, "public.flat", paths["flat"])


def range_commits(path: str) -> dict[int, int]:
    """Per key range, the rows its newest commit added (from the local log: Delta's add statistics)."""
    added: dict[int, int] = {}
    for commit in sorted((Path(path) / "_delta_log").glob("*.json")):
        actions = [json.loads(line) for line in commit.read_text(encoding="utf-8").splitlines()]
        markers = [pgcdc_marker(a["commitInfo"].get("userMetadata")) for a in actions if "commitInfo" in a]
        copied = [m["chunks"]["range"] for m in markers if m is not None and "chunks" in m]
        if copied:
            added[copied[0]] = sum(json.loads(a["add"]["stats"])["numRecords"] for a in actions if "add" in a)
    return added


DELETION_VECTORS_DDL = """
    CREATE TABLE acct (id int PRIMARY KEY, balance int, note text);
    INSERT INTO acct SELECT g, g, 'n' || g FROM generate_series(0, 2999) g;
    CREATE PUBLICATION pub FOR TABLE acct;
"""


@pytest.mark.timeout(
    1800
)  # the engine's start, four drains and three maintenance runs on a JVM: 3 minutes idle, 12 under load 20
def test_maintenance_on_spark_purges_deletion_vectors_and_stays_exact(
    engine: EngineUnderTest, pg: PgDatabase, tmp_path: Path
) -> None:
    """Delta on Spark writes deletion vectors on the drains' MERGEs (the table is created with them), and
    a drain reports the bytes its commits wrote; maintenance's OPTIMIZE and ``REORG ... APPLY (PURGE)``
    take every file whose deletion vector deletes more than ``max_deleted_rows_ratio`` of its rows out
    of the table, and the rows stay exact."""
    spark = engine.spark
    assert spark is not None and engine_capabilities(spark).delta_commands
    pg.execute(DELETION_VECTORS_DDL)
    config = engine_config(pg, tmp_path, engine, {"tables": {"public.acct": {"width": 1000}}})  # three buckets
    snapshot_tables(config, lake_destination(spark, config))
    acct = config.table_path("public", "acct")
    assert "deletionVectors" in (deltalake.DeltaTable(acct).protocol().reader_features or [])
    lake = LakeStorage(config.delta.root, config.delta.storage)

    # deletes only: each bucket's one file gets a deletion vector deleting a tenth of its rows; the
    # drain reports what its commits wrote (deletion vectors only), as the log records it
    snapshotted = deltalake.DeltaTable(acct).version()
    pg.execute("DELETE FROM acct WHERE id % 10 = 0")
    drained = run_incremental(config, lake_destination(spark, config)).tables["public.acct"]
    assert drained.bytes_written == commit_bytes(acct, snapshotted) > 0, drained
    assert_delta_equals_postgres(pg.dsn, "public.acct", acct, key=("id",))
    kept = maintain_table(
        acct, lake, retention_hours=1, target_file_bytes=1 << 27, max_deleted_rows_ratio=0.5, spark=spark
    )
    assert (
        kept.method == "spark" and kept.deleted_before.deleted == 300 and kept.deleted_after == kept.deleted_before
    ), kept
    done = maintain_table(
        acct, lake, retention_hours=1, target_file_bytes=1 << 27, max_deleted_rows_ratio=0.05, spark=spark
    )
    assert done.deleted_before.fraction == 0.1 and done.deleted_after.deleted == 0, done
    assert done.deleted_after.rows == 2700 and done.files_compacted >= 3, done
    assert_delta_equals_postgres(pg.dsn, "public.acct", acct, key=("id",))
    assert_buckets_right(acct)

    # random updates over every bucket for two drains (the second's deletion vectors replace the first's),
    # then maintenance at the default ratio: every file above it is purged, and drains on the purged files
    # stay exact
    for seed in range(3):
        pg.execute(f"UPDATE acct SET balance = balance + 1, note = 'u{seed}' WHERE id % 7 = {seed};"
                   f" DELETE FROM acct WHERE id % 101 = {seed}")  # fmt: skip
        if seed > 0:  # rounds 0 and 1 in one drain, round 2 in the next: each drain costs seconds on a JVM
            run_incremental(config, lake_destination(spark, config))
    again = maintain_table(acct, lake, retention_hours=1, target_file_bytes=1 << 27, spark=spark)
    assert again.deleted_before.fraction > 0.05, again
    assert not any(file.deleted > 0.05 * file.rows for file in file_deletions(lake, acct)), again
    pg.execute("UPDATE acct SET note = 'after' WHERE id % 13 = 0")
    run_incremental(config, lake_destination(spark, config))
    rows = assert_delta_equals_postgres(pg.dsn, "public.acct", acct, key=("id",))
    assert rows == pg.execute("SELECT count(*) FROM acct")[0][0]
    assert_buckets_right(acct)
    print(f"{engine.name}: maintenance {describe(done)}; again {describe(again)}")


def test_lifecycle_on_s3_with_apache_spark_and_delta(
    engine: EngineUnderTest, pg: PgDatabase, s3_server: S3Server, s3_root: str
) -> None:
    """tests/test_object_storage.py's lifecycle on ``s3://`` through Hadoop's S3A client, on the
    managed engine (started with S3A's settings and the store's credentials in its environment)."""
    object_storage_lifecycle(pg, s3_server, s3_root, engine.spark, copy_on_write="public.orders", drains_under_writes=1)


def next_line(stream: TextIO, prefix: str) -> str:
    """The child's next line starting with ``prefix`` (Ivy prints its own lines on stdout)."""
    for line in stream:
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"the child ended without a line starting with {prefix!r}")


def test_classic_in_process_session_snapshots_drains_and_maintains(pg: PgDatabase, tmp_path: Path) -> None:
    """Dagster's ``classic`` mode (an in-process JVM session with Delta's jars) in a child process:
    snapshot, a drain, then the maintenance of Delta on Spark (``ALTER TABLE ... SET TBLPROPERTIES``,
    ``OPTIMIZE``, ``VACUUM``) at a one-second retention, which its VACUUM accepts once the table
    property says so: on acct it deletes exactly the file the drain's MERGE replaced, on the keyless
    journal it compacts the snapshot's file and the drain's append into one; a drain after it stays exact."""
    pg.execute(LIFECYCLE_DDL)
    # acct copy-on-write: each MERGE replaces its file, so the vacuum has those files to delete
    config = parse_config({"postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": SLOT,
                           "delta": {"root": str(tmp_path / "lake"), "deletion_vectors_tables": {"public.acct": False}}})  # fmt: skip
    acct, journal = config.table_path("public", "acct"), config.table_path("public", "journal")
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.support.classic_child", str(write_config(config, tmp_path)), f"{acct},{journal}", str(1 / 3600)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, text=True,
        # This process has had Spark Connect sessions, which mark the environment as Connect mode
        # (SPARK_CONNECT_MODE_ENABLED); a child inheriting that cannot build a classic session.
        env={name: value for name, value in os.environ.items() if name != "SPARK_CONNECT_MODE_ENABLED"},
    )  # fmt: skip

    def command(line: str, answer: str) -> str:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(f"{line}\n")
        child.stdin.flush()
        return next_line(child.stdout, answer)

    try:
        assert child.stdout is not None and child.stdin is not None
        assert next_line(child.stdout, "delta commands:") == "delta commands: True"
        assert next_line(child.stdout, "snapshot") == "snapshot done"
        assert_lake_exact(pg, config, 300)
        writes(pg, 10, 100)
        command("drain", "confirmed ")
        assert_lake_exact(pg, config, 300)
        drained = deltalake.DeltaTable(acct)
        at_drained = {path: sorted(map(repr, delta_rows(path)[1])) for path in (acct, journal)}
        # The file the drain replaced is older than the retention once a second has passed since the last commit.
        last_commit_s = max(deltalake.DeltaTable(path).history(1)[0]["timestamp"] for path in (acct, journal)) / 1000
        time.sleep(max(0.0, last_commit_s + 1.5 - time.time()))
        done = json.loads(command("maintain", "maintained ").removeprefix("maintained "))
        print(f"maintained after drains: {done}")
        assert [m["method"] for m in done] == ["spark", "spark"]
        for maintained in done:
            assert maintained["properties_set"] == [
                f"{name}: (unset) -> interval 1 seconds" for name in RETENTION_PROPERTIES
            ]
        configuration = deltalake.DeltaTable(acct).metadata().configuration
        assert {name: configuration.get(name) for name in RETENTION_PROPERTIES} == dict.fromkeys(
            RETENTION_PROPERTIES, "interval 1 seconds"
        )
        # Spark names its property commit as delta-rs does: maintenance, not a writer (log clean-up's horizon).
        commit = (Path(acct) / "_delta_log" / f"{drained.version() + 1:020d}.json").read_text()
        assert json.loads(commit.splitlines()[0])["commitInfo"]["operation"] == "SET TBLPROPERTIES"
        assert "SET TBLPROPERTIES" in MAINTENANCE_OPERATIONS
        on_acct, on_journal = done
        # acct: the drain's MERGE replaced its one file; VACUUM deleted exactly that.
        assert on_acct["table_before"]["files"] == on_acct["table_after"]["files"] == 1, on_acct
        assert on_acct["storage_before"]["files"] == 2 and on_acct["files_vacuumed"] == 1, on_acct
        assert on_acct["storage_after"] == on_acct["table_after"], on_acct
        # journal: the snapshot's file and the drain's append, compacted into one.
        assert on_journal["table_before"]["files"] == on_journal["files_compacted"] == 2, on_journal
        assert on_journal["table_after"]["files"] == on_journal["files_written"] == 1, on_journal
        for path in (acct, journal):
            table = deltalake.DeltaTable(path)
            on_storage = {
                p.relative_to(path).as_posix() for p in Path(path).rglob("*.parquet") if "_delta_log" not in p.parts
            }
            assert set(table.get_add_actions(flatten=True).column("path").to_pylist()) <= on_storage
            assert sorted(map(repr, delta_rows(path)[1])) == at_drained[path]  # the same rows, fewer files
        assert_lake_exact(pg, config, 300)
        writes(pg, 10, 400)
        command("drain", "confirmed ")
        child.stdin.write("quit\n")
        child.stdin.flush()
        output, errors = child.communicate(timeout=600)
        assert child.returncode == 0, errors[-3000:]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert_lake_exact(pg, config, 300)


def test_spark_server_serves_runs_until_stopped(pg: PgDatabase, tmp_path: Path) -> None:
    """``pgcdc spark-server``: the managed Spark with Delta as a service that outlives runs. A snapshot
    and a drain, each in a session of its own as a Dagster run opens one (``spark.remote``), are
    exact; the server probes as Delta on Spark (its MERGEs update rather than delete and insert); its
    JVM collects with the parallel collector; SIGTERM stops it, JVM included."""
    pg.execute(LIFECYCLE_DDL)
    port = free_port()
    config = parse_config({"postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": SLOT,
                           "delta": {"root": str(tmp_path / "lake")}, "spark": {"remote": f"sc://127.0.0.1:{port}"}})  # fmt: skip
    server = subprocess.Popen(
        [sys.executable, "-m", "resources.runs.cli", "spark-server", "--config", str(write_config(config, tmp_path)), "--port", str(port)],
        stdout=subprocess.PIPE, cwd=REPO, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        line = next_line(server.stdout, "pgcdc: Spark with Delta listening at ")
        assert line.startswith(f"pgcdc: Spark with Delta listening at sc://127.0.0.1:{port} (JVM pid "), line
        jvm = int(line.split("JVM pid ", 1)[1].split(",")[0])
        assert b"-XX:+UseParallelGC" in Path(f"/proc/{jvm}/cmdline").read_bytes().split(b"\0")  # LONG_LIVED_JVM_CONFIG
        with SparkEngine.from_config(config.spark) as engine:
            capabilities = engine_capabilities(engine.spark)
            assert capabilities.delta_commands and not capabilities.merge_delete_and_insert
            snapshot_tables(config, lake_destination(engine.spark, config))
        assert_lake_exact(pg, config, 300)
        writes(pg, 10, 100)
        with SparkEngine.from_config(config.spark) as engine:
            run_incremental(config, lake_destination(engine.spark, config))
        assert_lake_exact(pg, config, 300)
        server.terminate()
        assert server.wait(timeout=120) == 0
        assert not group_alive(jvm), "the JVM outlived pgcdc spark-server"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_delta_spark_pin_matches_the_jars_pgcdc_loads() -> None:
    """pip's delta-spark (dev and classic extras) and the jar coordinate pinned in code must not drift."""
    assert metadata.version("delta-spark") == DELTA_VERSION
    assert DELTA_PACKAGE == f"io.delta:delta-spark_4.1_2.13:{DELTA_VERSION}"


def test_faults_of_two_tables_on_spark_quarantine_them_and_the_others_flow(
    engine: EngineUnderTest, pg: PgDatabase, tmp_path: Path
) -> None:
    """A value Delta cannot hold in one table and a column Delta on Spark refuses (a case twin) in another:
    both set aside, the other tables and the slot flow, re-snapshots restore both exactly."""
    pg.execute(POISONS_DDL)
    config = engine_config(pg, tmp_path, engine)
    destination = lake_destination(engine.spark, config)
    snapshot_tables(config, destination)
    round_of_changes(pg, 1)
    pg.execute("INSERT INTO due VALUES (100, 'infinity', 1)")
    pg.execute("ALTER TABLE pairs ADD COLUMN \"A\" int; INSERT INTO pairs VALUES (7, 'z', 7)")
    round_of_changes(pg, 2)
    first = run_incremental(config, destination)
    assert sorted(first.newly_quarantined) == ["public.due", "public.pairs"]
    assert confirmed(pg) == first.confirmed_flush_lsn >= first.end_lsn
    for table in ("acct", "events"):
        assert_delta_equals_postgres(pg.dsn, f"public.{table}", config.table_path("public", table))
    pg.execute('DELETE FROM due WHERE id = 100; ALTER TABLE pairs DROP COLUMN "A"')
    snapshot_tables(config, destination, [TableName("public", "due"), TableName("public", "pairs")])
    round_of_changes(pg, 3)
    last = run_incremental(config, destination)
    assert sorted(last.lifted) == ["public.due", "public.pairs"] and last.quarantined == {}
    for table in ("acct", "events", "pairs", "due"):
        assert_delta_equals_postgres(pg.dsn, f"public.{table}", config.table_path("public", table))


def test_a_busy_drain_on_spark_commits_tables_side_by_side_and_replays_a_kill_exactly(
    engine: EngineUnderTest, pg: PgDatabase, tmp_path: Path
) -> None:
    """Four threads send the tables' commits of each chunk through one Spark Connect session at once (its
    sessions take concurrent queries): a drain killed between two tables' commits (some tables hold the
    chunk, others not) is replayed exactly by a drain in this process on the test's own session."""
    pg.execute(BUSY_DDL)
    config = with_write_concurrency(engine_config(pg, tmp_path, engine), 4)
    destination = lake_destination(engine.spark, config)
    snapshot_tables(config, destination)
    busy_workload(pg, 6)
    child = Child(write_config(config, tmp_path), chunk=30, env={FAULT_POINT_ENV: "after_table_commit:4"})
    try:
        assert child.wait(timeout=600) == -9, child.output()
    finally:
        child.kill()
    settle(config)  # the dead client's writes still running in the server land first
    rerun = run_incremental(config, destination)  # four threads again, on the test's own session
    assert confirmed(pg) == rerun.confirmed_flush_lsn >= rerun.end_lsn
    assert_busy_exact(pg, config)
