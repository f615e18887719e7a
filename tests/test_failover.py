"""Failover slots on real PostgreSQL: refused before 17, created and turned on with 17+, and a real failover.

The failover tests run a PostgreSQL 18 primary with a physical slot and a streaming standby
made with pg_basebackup (``sync_replication_slots``, ``hot_standby_feedback``,
``primary_slot_name``, a ``dbname`` in ``primary_conninfo``), the primary's
``synchronized_standby_slots`` naming the standby's slot. pgcdc is configured once, with a
multi-host DSN and ``target_session_attrs=read-write``: it follows the promotion without a
configuration change. Snapshot and drains run under a concurrent workload, the primary is
killed (immediate stop), the standby promoted, and the drains continue from the synchronized
slot: Delta equals the new primary value for value, keyless rows exactly once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from dagster import DagsterInstance, SkipReason
from pyspark.sql import SparkSession

from pgcdc_assets.builder import build_definitions
from resources.config import parse_config, PgcdcConfig
from resources.delta.spark_destination import lake_destination
from resources.errors import ConfigurationError, PgcdcError, SlotError
from resources.postgres.catalog import TableName
from resources.postgres.connections import connect
from resources.postgres.failover import failover_problems
from resources.postgres.preflight import ensure_slot
from resources.postgres.slots import read_slot
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.local_postgres import free_port, LocalPostgres, start_local_postgres
from resources.testing.verify import assert_delta_equals_postgres
from tests.support.dagster_runs import evaluate
from tests.support.fault_runs import assert_one_line_failure, Child, confirmed, wait_mid_drain, write_config
from tests.support.postgres import PgDatabase, TEST_SERVER_SETTINGS

pytest_plugins = ["tests.support.spark_fixtures"]
pytestmark = pytest.mark.slow  # standbys promoted and slots synchronized; tiers: docs/testing.md

SLOT = "pgcdc_slot"
STANDBY_SLOT = "pgcdc_standby"
DATABASE = "ha"
ACCOUNTS = 200

DDL = f"""
    CREATE TABLE acct (id int PRIMARY KEY, balance int, note text);
    CREATE TABLE journal (entry int, note text);
    INSERT INTO acct SELECT g, 0, 'start' FROM generate_series(1, {ACCOUNTS}) g;
    CREATE PUBLICATION pub FOR TABLE acct, journal;
"""


# --------------------------------------------------------------------------- PostgreSQL < 17 and 17+


def test_failover_slot_is_refused_before_17_and_created_or_turned_on_from_17(pg: PgDatabase) -> None:
    if pg.major < 17:
        with pytest.raises(ConfigurationError) as refused:
            ensure_slot(pg.dsn, SLOT, failover=True)
        assert str(refused.value) == (
            f"slot_failover needs PostgreSQL 17 or newer, the source runs PostgreSQL {pg.major}:"
            " set slot_failover: false, or upgrade the source to PostgreSQL 17+"
        )
        assert pg.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (SLOT,)) == [(0,)]
        return
    ensure_slot(pg.dsn, SLOT, failover=True)  # created with FAILOVER
    assert pg.execute("SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (SLOT,)) == [(True,)]

    ensure_slot(pg.dsn, "plain_slot")  # an existing slot without failover ...
    assert pg.execute("SELECT failover FROM pg_replication_slots WHERE slot_name = 'plain_slot'") == [(False,)]
    ensure_slot(pg.dsn, "plain_slot", failover=True)  # ... is turned into one (ALTER_REPLICATION_SLOT)
    assert pg.execute("SELECT failover FROM pg_replication_slots WHERE slot_name = 'plain_slot'") == [(True,)]

    # No standby: the primary's side says what is missing, one line each.
    with connect(pg.dsn, application_name="test") as conn:
        state = read_slot(conn, SLOT)
        assert state is not None
        problems = [str(problem) for problem in failover_problems(conn, state, None)]
        unreachable = failover_problems(conn, state, f"postgresql://postgres@127.0.0.1:{free_port()}/{pg.name}")
    # A standby that cannot be reached is one more problem, never a failed drain.
    assert [str(problem) for problem in unreachable[:-1]] == problems
    assert str(unreachable[-1]).startswith("cannot check the slot's copy on the standby postgres@127.0.0.1:") and str(
        unreachable[-1]
    ).endswith("; or fix postgres.standby_dsn"), unreachable
    assert problems == [
        "synchronized_standby_slots is empty on the primary: a drain can confirm changes no standby has received,"
        " and a promoted standby would lack changes Delta already holds: set it to the standby's physical slot"
        " (ALTER SYSTEM SET synchronized_standby_slots = '<slot>'; SELECT pg_reload_conf())"
    ]


def test_standby_dsn_needs_slot_failover_and_is_masked() -> None:
    base = {"postgres": {"dsn": "postgresql://u:secret@h/db"}, "publication": "pub"}
    with pytest.raises(ConfigurationError) as refused:
        parse_config({**base, "postgres": {**base["postgres"], "standby_dsn": "postgresql://u:secret@s/db"}})
    assert "postgres.standby_dsn is only used to check a failover slot: set slot_failover: true or remove it" in str(
        refused.value
    )
    config = parse_config(
        {**base, "slot_failover": True, "postgres": {**base["postgres"], "standby_dsn": "postgresql://u:secret@s/db"}}
    )
    assert repr(config.postgres) == "PostgresSettings(dsn='u@h:5432/db', standby_dsn='u@s:5432/db')"


# --------------------------------------------------------------------------- a real failover


class Pair:
    """A primary and its streaming standby; from PostgreSQL 17 on, ready for failover slots."""

    def __init__(self, major: int = 18) -> None:
        self.primary = start_local_postgres(major, TEST_SERVER_SETTINGS)
        self.standby: LocalPostgres | None = None
        try:
            self.standby = self.primary.start_standby(STANDBY_SLOT)
            with psycopg.connect(self.primary.dsn(), autocommit=True) as admin:
                if major >= 17:
                    admin.execute(f"ALTER SYSTEM SET synchronized_standby_slots = '{STANDBY_SLOT}'")
                    admin.execute("SELECT pg_reload_conf()")
                admin.execute(f'CREATE DATABASE "{DATABASE}"')
        except BaseException:
            self.destroy()
            raise

    @property
    def multi_host_dsn(self) -> str:
        """Both servers, whichever accepts writes: pgcdc follows a promotion without a configuration change."""
        assert self.standby is not None
        return (
            f"postgresql://postgres@127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}/{DATABASE}"
            "?target_session_attrs=read-write"
        )

    def destroy(self) -> None:
        if self.standby is not None:
            self.standby.destroy()
        self.primary.destroy()


@pytest.fixture
def pair() -> Iterator[Pair]:
    servers = Pair()
    try:
        yield servers
    finally:
        servers.destroy()


class Workload:
    """Small transactions on one server in a thread, until stopped or the server goes away."""

    def __init__(self, dsn: str, *, log_standby_snapshots: bool = False) -> None:
        self.dsn = dsn
        self.log_standby_snapshots = log_standby_snapshots
        self.committed = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self._stop.is_set():
                    transact(conn, self.committed)
                    self.committed += 1
                    if self.log_standby_snapshots and self.committed % 20 == 0:
                        # What a standby needs to create a logical slot: PostgreSQL logs it every
                        # 15 s on its own, this only saves the wait.
                        conn.execute("SELECT pg_log_standby_snapshot()")
        except psycopg.OperationalError as error:  # the primary was killed
            self.error = error

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive()
        return self.committed


def transact(conn: psycopg.Connection, i: int) -> None:
    """One transaction touching both tables; now and then a key is deleted and re-inserted."""
    with conn.transaction():
        conn.execute("UPDATE acct SET balance = balance + 1, note = %s WHERE id %% 20 = %s", (f"t{i}", i % 20))
        conn.execute("INSERT INTO journal SELECT %s, 'e' || g FROM generate_series(1, 5) g", (i,))
        if i % 25 == 24:
            conn.execute("DELETE FROM acct WHERE id = %s", (i % ACCOUNTS + 1,))
            conn.execute("INSERT INTO acct VALUES (%s, -1, 'reborn')", (i % ACCOUNTS + 1,))


def assert_exact(dsn: str, config: PgcdcConfig) -> None:
    root = Path(config.delta.root)
    assert assert_delta_equals_postgres(dsn, "public.acct", str(root / "public" / "acct"), key=("id",)) == ACCOUNTS
    assert_delta_equals_postgres(dsn, "public.journal", str(root / "public" / "journal"))


def wait_until_failover_ready(config: PgcdcConfig, spark: SparkSession, timeout: float = 240) -> None:
    """Drain until the standby holds a persistent synchronized copy of the slot.

    The standby's copy stays temporary until the primary's slot has moved past where the
    copy started, so drains (which move it) alternate with the check.
    """
    deadline = time.monotonic() + timeout
    problems: list[PgcdcError] = []
    while time.monotonic() < deadline:
        run_incremental(config, lake_destination(spark, config), warn=lambda line: None)
        with connect(config.postgres.dsn, application_name="test") as conn:
            state = read_slot(conn, SLOT)
            assert state is not None and state.failover
            problems = list(failover_problems(conn, state, config.postgres.standby_dsn))
        if not problems:
            return
        time.sleep(2)
    raise AssertionError(f"the slot was not synchronized within {timeout} s: {problems}")


@pytest.mark.parametrize("kill", ["between_drains", "mid_drain"])
def test_failover_to_the_standby_loses_and_doubles_nothing(
    pair: Pair, kill: str, tmp_path: Path, spark: SparkSession
) -> None:
    primary, standby = pair.primary, pair.standby
    assert standby is not None
    primary_db = PgDatabase(primary, DATABASE)
    primary_db.execute(DDL)
    config = parse_config({
        "postgres": {"dsn": pair.multi_host_dsn, "standby_dsn": standby.dsn(DATABASE)},
        "publication": "pub",
        "slot": SLOT,
        "slot_failover": True,
        "delta": {"root": str(tmp_path / "lake")},
    })  # fmt: skip

    config_file = write_config(config, tmp_path)
    defs = build_definitions(config_file)
    workload = Workload(primary.dsn(DATABASE))
    snapshot_tables(config, lake_destination(spark, config))
    assert primary_db.execute("SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (SLOT,)) == [(True,)]
    warnings: list[str] = []
    run_incremental(config, lake_destination(spark, config), warn=warnings.append)
    # Only the standby's copy can be missing (nothing moved the new slot yet); the primary's side is set up.
    assert len(warnings) <= 1 and all(
        f'replication slot "{SLOT}" is not yet synchronized to the standby' in warning for warning in warnings
    ), warnings
    wait_until_failover_ready(config, spark)
    with DagsterInstance.ephemeral() as instance:
        healthy = evaluate(defs, "pgcdc_slot_health_sensor", instance, config_file)
    assert isinstance(healthy, SkipReason) and healthy.skip_message.startswith(f'slot "{SLOT}" is healthy'), healthy

    if kill == "between_drains":
        run_incremental(config, lake_destination(spark, config))
        time.sleep(0.5)  # the workload goes on past the last drain
        primary.stop("immediate")
    else:
        workload.stop()
        with psycopg.connect(primary.dsn(DATABASE), autocommit=True) as conn:
            for i in range(400):  # a backlog of many small chunks
                transact(conn, 10_000 + i)
        workload = Workload(primary.dsn(DATABASE))
        start = confirmed(primary_db)
        child = Child(config_file)
        try:
            wait_mid_drain(primary_db, child, start)
            primary.stop("immediate")
            assert_one_line_failure(child, "ConnectionFailure")
        finally:
            child.kill()
    committed = workload.stop()
    assert committed > 0 and workload.error is not None  # killed in the middle of the workload

    standby.promote()
    with psycopg.connect(standby.dsn(DATABASE), autocommit=True) as conn:
        for i in range(30):  # writes on the new primary
            transact(conn, 20_000 + i)

    warnings.clear()
    result = run_incremental(config, lake_destination(spark, config), warn=warnings.append)  # the same configuration
    assert result.confirmed_flush_lsn > result.start_lsn
    assert_exact(standby.dsn(DATABASE), config)
    # The new primary has no standby yet: the run says the slot is no longer protected.
    assert warnings == [
        "synchronized_standby_slots is empty on the primary: a drain can confirm changes no standby has received,"
        " and a promoted standby would lack changes Delta already holds: set it to the standby's physical slot"
        " (ALTER SYSTEM SET synchronized_standby_slots = '<slot>'; SELECT pg_reload_conf())",
        f"postgres.standby_dsn (postgres@127.0.0.1:{standby.port}/{DATABASE}) is not a standby: it was promoted"
        " or is another primary: point postgres.standby_dsn at the current standby",
    ]

    with DagsterInstance.ephemeral() as instance, pytest.raises(SlotError) as unprotected:
        evaluate(defs, "pgcdc_slot_health_sensor", instance, config_file)
    assert str(unprotected.value) == warnings[0]  # the first problem fails the tick

    with psycopg.connect(standby.dsn(DATABASE), autocommit=True) as conn:
        for i in range(30):
            transact(conn, 30_000 + i)
    run_incremental(config, lake_destination(spark, config), warn=warnings.append)
    assert_exact(standby.dsn(DATABASE), config)


@pytest.mark.parametrize("major", [15, 18])
def test_without_failover_slots_a_failover_names_the_resnapshot_which_restores_an_exact_lake(
    major: int, tmp_path: Path, spark: SparkSession
) -> None:
    """PostgreSQL 15, or 18 with slot_failover off: the slot stays behind on the old primary."""
    servers = Pair(major)
    try:
        primary, standby = servers.primary, servers.standby
        assert standby is not None
        PgDatabase(primary, DATABASE).execute(DDL)
        config = parse_config({
            "postgres": {"dsn": servers.multi_host_dsn},
            "publication": "pub",
            "slot": SLOT,
            "delta": {"root": str(tmp_path / "lake")},
        })  # fmt: skip
        workload = Workload(primary.dsn(DATABASE))
        snapshot_tables(config, lake_destination(spark, config))
        run_incremental(config, lake_destination(spark, config))
        primary.stop("immediate")
        assert workload.stop() > 0 and workload.error is not None
        standby.promote()

        with pytest.raises(SlotError) as lost:
            run_incremental(config, lake_destination(spark, config))
        assert str(lost.value) == (
            f'replication slot "{SLOT}" does not exist on postgres@127.0.0.1,127.0.0.1:{primary.port},{standby.port}/'
            f"{DATABASE}, but the lake holds tables copied for it: it was dropped, or lost in a failover (only a"
            " synchronized failover slot survives one): run the pgcdc_resnapshot job with no table list: it recreates"
            " the slot and re-snapshots every table"
        )

        # Re-copying only some tables would leave the others missing every change since: refused.
        with pytest.raises(SlotError) as partial:
            snapshot_tables(config, lake_destination(spark, config), [TableName("public", "acct")])
        assert str(partial.value) == (
            f'replication slot "{SLOT}" does not exist, and 1 table(s) snapshotted for it are not in this run'
            " (public.journal): they would miss every change since the slot was lost: run the pgcdc_resnapshot job"
            " with no table list: it recreates the slot and re-snapshots every table"
        )
        assert standby_slots(standby) == []

        config_file = write_config(config, tmp_path)
        with DagsterInstance.ephemeral() as instance:
            resnapshot = build_definitions(config_file).resolve_job_def("pgcdc_resnapshot")
            assert resnapshot.execute_in_process(instance=instance).success
        with psycopg.connect(standby.dsn(DATABASE), autocommit=True) as conn:
            for i in range(30):
                transact(conn, 40_000 + i)
        run_incremental(config, lake_destination(spark, config))
        assert_exact(standby.dsn(DATABASE), config)
    finally:
        servers.destroy()


def standby_slots(server: LocalPostgres) -> list[tuple]:
    return PgDatabase(server, DATABASE).execute(
        "SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'logical'"
    )


# --------------------------------------------------------------------------- a standby as the source


def wait_replayed(primary: LocalPostgres, standby: LocalPostgres, timeout: float = 60) -> None:
    """Until the standby has replayed all WAL the primary has flushed."""
    with psycopg.connect(primary.dsn(), autocommit=True) as conn:
        ((target,),) = conn.execute("SELECT pg_current_wal_flush_lsn()").fetchall()
    deadline = time.monotonic() + timeout
    with psycopg.connect(standby.dsn(), autocommit=True) as conn:
        while time.monotonic() < deadline:
            ((behind,),) = conn.execute(
                "SELECT pg_wal_lsn_diff(%s, pg_last_wal_replay_lsn()) > 0", (target,)
            ).fetchall()
            if not behind:
                return
            time.sleep(0.1)
    raise AssertionError(f"the standby did not replay up to {target} within {timeout} s")


def test_snapshot_and_drains_from_a_standby_are_exact_against_the_primary(
    pair: Pair, tmp_path: Path, spark: SparkSession
) -> None:
    """PostgreSQL 16+ decodes on a hot standby: the slot and the snapshot live there, the primary only writes."""
    primary, standby = pair.primary, pair.standby
    assert standby is not None
    PgDatabase(primary, DATABASE).execute(DDL)
    wait_replayed(primary, standby)
    config = parse_config({
        "postgres": {"dsn": standby.dsn(DATABASE)},
        "publication": "pub",
        "slot": SLOT,
        "delta": {"root": str(tmp_path / "lake")},
    })  # fmt: skip

    workload = Workload(primary.dsn(DATABASE), log_standby_snapshots=True)
    snapshot_tables(config, lake_destination(spark, config))  # the slot and the tables' snapshots, on the standby
    run_incremental(config, lake_destination(spark, config))
    time.sleep(0.5)
    run_incremental(config, lake_destination(spark, config))
    assert workload.stop() > 0 and workload.error is None
    wait_replayed(primary, standby)
    result = run_incremental(config, lake_destination(spark, config))
    assert result.changes > 0
    assert_exact(primary.dsn(DATABASE), config)
    on_primary = PgDatabase(primary, DATABASE).execute(
        "SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'logical'"
    )
    on_standby = PgDatabase(standby, DATABASE).execute(
        "SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'logical'"
    )
    assert on_primary == [(0,)] and on_standby == [(SLOT,)]

    # A failover slot belongs on the primary: asking for one on the standby is refused in one line.
    with pytest.raises(ConfigurationError) as refused:
        ensure_slot(standby.dsn(DATABASE), "another_slot", failover=True)
    assert str(refused.value) == (
        "slot_failover is set but postgres.dsn points at a standby: only a primary's slot can fail over:"
        " point postgres.dsn at the primary (a multi-host DSN with target_session_attrs=read-write),"
        " or set slot_failover: false to decode on the standby"
    )
