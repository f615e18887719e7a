"""Bad input, against real PostgreSQL 15 and 18: one clear line naming cause and fix, a failed
Dagster step (or a failed code-location load, or ``pgcdc changes`` exit 2), no Delta write and
no slot movement.

Every case starts from a working setup (tables, publication, snapshot, so a slot exists and
Delta tables exist) with changes pending, then breaks one thing. "Nothing moved" means: the
slot's confirmed_flush_lsn and restart_lsn are unchanged and every Delta table keeps its version.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import deltalake
import psycopg
import pytest
import yaml
from dagster import DagsterInstance, ExecuteInProcessResult
from pyspark.sql import SparkSession

from pgcdc_assets.builder import build_definitions
from resources.config import CONFIG_ENV_VAR, parse_config
from resources.delta.spark_destination import lake_destination, SparkDeltaDestination
from resources.errors import ConfigurationError, ConnectionFailure, PgcdcError
from resources.postgres.connections import CONNECT_TIMEOUT_SECONDS
from resources.postgres.preflight import check_server, MIN_SERVER_VERSION_NUM
from resources.postgres.replication import ReplicationConnection
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.local_postgres import LocalPostgres, start_local_postgres
from resources.testing.verify import assert_delta_equals_postgres
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase, POSTGRES_VERSIONS, TEST_SERVER_SETTINGS

pytest_plugins = ["tests.support.spark_fixtures"]

REPO = Path(__file__).resolve().parent.parent
PGCDC = str(Path(sys.executable).with_name("pgcdc"))
DAGSTER = str(Path(sys.executable).with_name("dagster"))
SLOT = "pgcdc_slot"
TABLES = ("orders", "notes")

DDL = """
    CREATE TABLE orders (id int PRIMARY KEY, amount numeric(10,2));
    CREATE TABLE notes (body text);
    INSERT INTO orders SELECT g, g * 1.5 FROM generate_series(1, 50) g;
    INSERT INTO notes VALUES ('first');
    CREATE PUBLICATION pub FOR TABLE orders, notes;
"""
PENDING = "INSERT INTO orders VALUES (51, 1); UPDATE orders SET amount = 0 WHERE id < 5; INSERT INTO notes VALUES ('x')"


# --------------------------------------------------------------------------- helpers


def settings(dsn: str, root: Path, **overrides: Any) -> dict[str, Any]:
    return {"postgres": {"dsn": dsn}, "publication": "pub", "slot": SLOT, "delta": {"root": str(root)}, **overrides}


def write(tmp_path: Path, data: dict[str, Any], name: str = "pgcdc.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def prepare(pg: PgDatabase, tmp_path: Path, spark: SparkSession, dsn: str | None = None) -> dict[str, Any]:
    """A working setup with changes pending; returns its settings."""
    pg.execute(DDL)
    good = settings(dsn or pg.dsn, tmp_path / "lake")
    snapshot_tables(parse_config(good), SparkDeltaDestination(spark, None), None)
    pg.execute(PENDING)
    return good


class State:
    """What must not move: the slot row and every Delta table's version under the good root."""

    def __init__(self, pg: PgDatabase, root: Path) -> None:
        self.pg, self.root = pg, root
        self.before = self.read()

    def read(self) -> tuple[object, ...]:
        with psycopg.connect(self.pg.server.dsn(self.pg.name), autocommit=True) as conn:
            slot = conn.execute(
                "SELECT confirmed_flush_lsn::text, restart_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                (SLOT,),
            ).fetchall()
        versions = tuple(
            deltalake.DeltaTable(str(self.root / "public" / t)).version()
            if (self.root / "public" / t).exists()
            else None
            for t in TABLES
        )
        return (slot, versions)

    def assert_unmoved(self) -> None:
        assert self.read() == self.before, "the slot or a Delta table moved on bad input"


def one_line(message: str, *fragments: str) -> str:
    text = message.strip()
    assert "\n" not in text, f"not one line:\n{text}"
    for fragment in fragments:
        assert fragment in text, text
    return text


def failed_step(config_file: Path, job: str = "pgcdc_incremental") -> str:
    """Run ``job`` in process; it must fail in its step without retries. Returns the failure message."""
    defs = build_definitions(config_file)
    with DagsterInstance.ephemeral() as instance:
        result: ExecuteInProcessResult = defs.resolve_job_def(job).execute_in_process(
            instance=instance, raise_on_error=False
        )
    assert not result.success
    kinds = [event.event_type_value for event in result.all_events]
    assert "STEP_UP_FOR_RETRY" not in kinds, "a setup error must not be retried"
    (failure,) = [event for event in result.all_events if event.event_type_value == "STEP_FAILURE"]
    error = failure.step_failure_data.error
    # A dagster.Failure carries pgcdc's line as its message; anything else shows "Class: message".
    return error.message.strip()


def run_changes(dsn: str, *extra: str, slot: str = SLOT, publication: str = "pub") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PGCDC, "changes", "--dsn", dsn, "--slot", slot, "--publication", publication, *extra],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def cli_fails(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    line = one_line(result.stderr, *fragments)
    assert line.startswith("pgcdc: ")
    return line


# --------------------------------------------------------------------------- credentials and privileges


@pytest.fixture(scope="module", params=POSTGRES_VERSIONS, ids=lambda v: f"pg{v}")
def scram_server(request: pytest.FixtureRequest) -> Iterator[LocalPostgres]:
    """A server that checks passwords (scram-sha-256) on TCP for every role but the superuser."""
    server = start_local_postgres(request.param, {**TEST_SERVER_SETTINGS, "password_encryption": "'scram-sha-256'"})
    try:
        (server.data_dir / "pg_hba.conf").write_text(
            "host all postgres 127.0.0.1/32 trust\n"
            "host replication postgres 127.0.0.1/32 trust\n"
            "host all all 127.0.0.1/32 scram-sha-256\n"
            "host replication all 127.0.0.1/32 scram-sha-256\n",
            encoding="utf-8",
        )
        with psycopg.connect(server.dsn(), autocommit=True) as admin:
            admin.execute("SELECT pg_reload_conf()")
            admin.execute("CREATE ROLE app LOGIN REPLICATION PASSWORD 'right-secret'")
            admin.execute("CREATE DATABASE shop OWNER app")
        yield server
    finally:
        server.destroy()


@pytest.mark.slow  # a scram server of its own and Dagster runs
def test_wrong_password_fails_without_showing_it_and_moves_nothing(
    scram_server: LocalPostgres, tmp_path: Path, spark: SparkSession
) -> None:
    pg = PgDatabase(scram_server, "shop")
    right = scram_server.dsn("shop", user="app", password="right-secret")
    with psycopg.connect(right, autocommit=True) as conn:  # the role owns the tables and the publication
        conn.execute(DDL)
    good = settings(right, tmp_path / "lake")
    snapshot_tables(parse_config(good), SparkDeltaDestination(spark, None), None)  # the right password works
    pg.execute(PENDING)
    state = State(pg, tmp_path / "lake")
    wrong = scram_server.dsn("shop", user="app", password="wrong-secret")

    line = cli_fails(run_changes(wrong), "password authentication failed for app@127.0.0.1", "fix the password")
    assert "wrong-secret" not in line
    bad = write(tmp_path, settings(wrong, tmp_path / "lake", tables=["public.orders", "public.notes"]))
    message = failed_step(bad)
    one_line(message, "password authentication failed", "fix the password in the DSN")
    assert "wrong-secret" not in message
    # Without a table list the code location cannot even load: the same line.
    with pytest.raises(ConfigurationError) as load:
        build_definitions(write(tmp_path, settings(wrong, tmp_path / "lake"), "discover.yaml"))
    one_line(str(load.value), "password authentication failed")
    state.assert_unmoved()


def test_role_without_replication_privilege_fails_naming_the_grant(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    prepare(pg, tmp_path, spark)
    pg.execute("CREATE ROLE plain_reader LOGIN; GRANT SELECT ON orders, notes TO plain_reader")
    state = State(pg, tmp_path / "lake")
    plain = pg.server.dsn(pg.name, user="plain_reader")
    message = failed_step(write(tmp_path, settings(plain, tmp_path / "lake")))
    one_line(message, "missing privilege", "ALTER ROLE", "REPLICATION")
    state.assert_unmoved()


@NEWEST_POSTGRES_ONLY  # nothing listens: libpq's failure, no server's; the server only holds the state
def test_unreachable_host_is_a_connection_failure(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    """Nothing listens: the run fails at once with a ConnectionFailure (the only error Dagster retries)."""
    prepare(pg, tmp_path, spark)
    state = State(pg, tmp_path / "lake")
    closed = settings("postgresql://postgres@127.0.0.1:1/x", tmp_path / "lake")
    with pytest.raises(ConnectionFailure) as failure:
        run_incremental(parse_config(closed), SparkDeltaDestination(spark, None))
    one_line(str(failure.value), "cannot reach PostgreSQL at postgres@127.0.0.1:1/x", "retry")
    cli_fails(run_changes("postgresql://postgres@127.0.0.1:1/x"), "cannot reach PostgreSQL", "check host, port")
    state.assert_unmoved()


@pytest.fixture
def silent_host() -> Iterator[str]:
    """A TCP port that completes the handshake and then never says a word (a hung or firewalled host)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=16)
    try:
        yield f"postgresql://postgres@127.0.0.1:{listener.getsockname()[1]}/x"
    finally:
        listener.close()


@pytest.mark.slow  # waits out the connect timeout
def test_silent_host_fails_within_the_connect_timeout_not_after_minutes(
    silent_host: str, tmp_path: Path, spark: SparkSession
) -> None:
    """A host that accepts TCP and never answers fails the incremental run within pgcdc's connect_timeout
    (not psycopg's 130 s default): a ConnectionFailure in one line naming the timeout."""
    config = parse_config(settings(silent_host, tmp_path / "lake"))
    outcome: list[BaseException] = []
    began = time.monotonic()

    def drain() -> None:
        try:
            run_incremental(config, lake_destination(spark, config))
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            outcome.append(error)

    worker = threading.Thread(target=drain, daemon=True)
    worker.start()
    # pgcdc's connect_timeout against psycopg's 130 s: six times the former (a loaded machine
    # stretches it), still half the latter; the message says which timeout fired.
    worker.join(6 * CONNECT_TIMEOUT_SECONDS)
    waited = time.monotonic() - began
    if worker.is_alive():
        pytest.fail(
            f"run_incremental still connecting to a silent host after {waited:.0f} s "
            f"(connect_timeout is {CONNECT_TIMEOUT_SECONDS} s)"
        )
    assert outcome and isinstance(outcome[0], ConnectionFailure), outcome
    one_line(str(outcome[0]), "cannot reach PostgreSQL", "timeout expired")


def test_missing_database_fails_naming_dbname(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    prepare(pg, tmp_path, spark)
    state = State(pg, tmp_path / "lake")
    missing = pg.server.dsn("no_such_database")
    message = failed_step(
        write(tmp_path, settings(missing, tmp_path / "lake", tables=["public.orders", "public.notes"]))
    )
    one_line(message, "database missing", "no_such_database", "fix dbname in the DSN")
    state.assert_unmoved()


# --------------------------------------------------------------------------- server configuration


@pytest.fixture(scope="module")
def replica_server() -> Iterator[LocalPostgres]:
    """A server that cannot decode logically; tables and a publication (allowed, with a warning) exist."""
    server = start_local_postgres(max(POSTGRES_VERSIONS), {"wal_level": "replica"})
    try:
        with psycopg.connect(server.dsn(), autocommit=True) as admin:
            admin.execute(DDL)
        yield server
    finally:
        server.destroy()


def test_wal_level_replica_fails_the_snapshot_job_naming_wal_level(
    replica_server: LocalPostgres, tmp_path: Path
) -> None:
    config_file = write(tmp_path, settings(replica_server.dsn(), tmp_path / "lake"))
    message = failed_step(config_file, "pgcdc_snapshot")
    one_line(message, "wal_level", "logical", "restart PostgreSQL")
    assert not (tmp_path / "lake").exists() or not any((tmp_path / "lake").rglob("_delta_log"))
    assert replica_server_slots(replica_server) == []
    cli_fails(run_changes(replica_server.dsn()), "wal_level is 'replica'", "ALTER SYSTEM SET wal_level")


def test_wal_level_replica_fails_the_incremental_job_naming_wal_level(
    replica_server: LocalPostgres, tmp_path: Path
) -> None:
    """At wal_level=replica the incremental job's step fails with the wal_level line the CLI prints (naming
    wal_level and logical), not with a missing slot and the snapshot job."""
    message = failed_step(write(tmp_path, settings(replica_server.dsn(), tmp_path / "lake")))
    one_line(message, "wal_level", "logical")


def replica_server_slots(server: LocalPostgres) -> list[tuple]:
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        return conn.execute("SELECT slot_name FROM pg_replication_slots").fetchall()


def test_server_version_check_against_a_real_server(pg: PgDatabase) -> None:
    """No PostgreSQL older than 15 is available here, so the refusal itself cannot be exercised for
    real; this checks the bound and that a real supported server passes the check."""
    assert MIN_SERVER_VERSION_NUM == 150000
    with ReplicationConnection(pg.dsn) as conn:
        assert conn.server_version_num >= MIN_SERVER_VERSION_NUM
        assert conn.server_version_num // 10000 == pg.major
        check_server(conn)


# --------------------------------------------------------------------------- publication and tables


def test_missing_publication_fails_naming_create_publication(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    good = prepare(pg, tmp_path, spark)
    state = State(pg, tmp_path / "lake")
    listed = write(tmp_path, {**good, "publication": "nope", "tables": ["public.orders"]})
    one_line(failed_step(listed), 'publication "nope" does not exist', "CREATE PUBLICATION")
    with pytest.raises(ConfigurationError) as load:
        build_definitions(write(tmp_path, {**good, "publication": "nope"}, "discover.yaml"))
    one_line(str(load.value), '"nope"', "CREATE PUBLICATION")
    state.assert_unmoved()


def test_a_publication_emptied_with_changes_pending_drains_them_and_says_why_the_tables_left(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """Every table dropped from the publication while its changes wait in the slot: as PostgreSQL's subscriber
    does, the changes committed before the ALTER land (pgoutput decodes them with the catalog of their time),
    later ones are not published; the drain names each table and why it left, with the fix, in one line each."""
    good = prepare(pg, tmp_path, spark)
    pg.execute("ALTER PUBLICATION pub DROP TABLE orders, notes")  # the publication exists but publishes nothing
    pg.execute("INSERT INTO orders VALUES (1000, 7)")
    said: list[str] = []
    result = run_incremental(parse_config(good), SparkDeltaDestination(spark, None), log=said.append)
    assert sorted(result.departed) == ["public.notes", "public.orders"], result.departed
    left = [line for line in said if "removed from the publication" in line]
    assert len(left) == 2 and all("\n" not in line and "ALTER PUBLICATION" in line for line in left), said
    pg.execute("DELETE FROM orders WHERE id = 1000")  # the one change the publication no longer sends
    for table in ("orders", "notes"):
        assert_delta_equals_postgres(pg.dsn, f"public.{table}", parse_config(good).table_path("public", table))


def test_table_in_config_but_not_published_fails_naming_it(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    good = prepare(pg, tmp_path, spark)
    pg.execute("CREATE TABLE hidden (id int PRIMARY KEY)")
    state = State(pg, tmp_path / "lake")
    config_file = write(tmp_path, {**good, "tables": ["public.orders", "public.hidden"]})
    one_line(failed_step(config_file), 'public.hidden not published by "pub"', "ALTER PUBLICATION")
    state.assert_unmoved()


def test_slot_of_another_output_plugin_fails_naming_pgoutput(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    good = prepare(pg, tmp_path, spark)
    pg.execute("SELECT pg_create_logical_replication_slot('decoding', 'test_decoding')")
    pg.execute("INSERT INTO orders VALUES (52, 2)")
    ((before,),) = pg.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'decoding'")
    state = State(pg, tmp_path / "lake")
    config_file = write(tmp_path, {**good, "slot": "decoding"})
    one_line(failed_step(config_file), '"decoding"', "test_decoding", "pgoutput")
    cli_fails(run_changes(pg.dsn, slot="decoding"), "output plugin 'test_decoding'", "pgoutput")
    ((after,),) = pg.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'decoding'")
    assert after == before
    state.assert_unmoved()


# --------------------------------------------------------------------------- the configuration file


MALFORMED = {
    "unknown key": ({"publicaton": "pub"}, "unknown key 'publicaton'"),
    "wrong type": ({"snapshot": {"parallel_tables": "many"}}, "'snapshot.parallel_tables'"),
    "tables not a list": ({"tables": {"public.orders": 1}}, "'tables'"),
    "bad slot name": ({"slot": "Bad-Slot"}, "'slot'"),
    "bad table name": ({"tables": ["orders"]}, "'orders' is not schema.table"),
    "bad spark.remote": ({"spark": {"remote": "http://127.0.0.1:15002"}}, "'spark.remote'"),
    "missing dsn": ({"postgres": {}}, "'postgres.dsn' is required"),
}


def test_each_malformed_key_fails_the_load_with_one_line_naming_it(pg: PgDatabase, tmp_path: Path) -> None:
    pg.execute(DDL)
    good = settings(pg.dsn, tmp_path / "lake")
    for case, (override, fragment) in MALFORMED.items():
        config_file = write(tmp_path, {**good, **override}, f"{case.replace(' ', '_')}.yaml")
        with pytest.raises(ConfigurationError) as failure:
            build_definitions(config_file)
        one_line(str(failure.value), fragment, "fix the keys named")
    assert pg.execute("SELECT count(*) FROM pg_replication_slots") == [(0,)]


@pytest.mark.slow  # the Dagster CLI in child processes
def test_malformed_config_fails_the_dagster_cli_with_the_line(pg: PgDatabase, tmp_path: Path) -> None:
    config_file = write(tmp_path, {**settings(pg.dsn, tmp_path / "lake"), "slot": "Bad-Slot"})
    home = tmp_path / "dagster_home"
    home.mkdir()
    done = subprocess.run(
        [DAGSTER, "job", "execute", "-m", "pgcdc_assets.definitions", "-j", "pgcdc_incremental"],
        cwd=REPO, env={**os.environ, CONFIG_ENV_VAR: str(config_file), "DAGSTER_HOME": str(home)},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    expected = f"invalid config {config_file}: 'slot': Value error, slot names use only lower-case letters"
    assert expected in done.stderr, done.stderr[-3000:]


# --------------------------------------------------------------------------- Delta and Spark


def test_unwritable_delta_root_fails_the_snapshot_naming_the_location(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    pg.execute(DDL)
    blocker = tmp_path / "a_file"  # tests run as root, where chmod stops nothing: a path under a file
    blocker.write_text("not a directory")
    config_file = write(tmp_path, settings(pg.dsn, blocker / "lake"))
    message = failed_step(config_file, "pgcdc_snapshot")
    one_line(message, f"into {blocker / 'lake' / 'public' / 'orders'}: Not a directory", "the Delta location")


def test_unwritable_delta_root_fails_the_incremental_run_with_one_line(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """With delta.root under a regular file, the incremental run fails with a PgcdcError in one line naming
    the location and delta.root (not the engine's raw error), and the slot does not move."""
    good = prepare(pg, tmp_path, spark)
    state = State(pg, tmp_path / "lake")
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    broken = {**good, "delta": {"root": str(blocker / "lake")}}
    try:
        run_incremental(parse_config(broken), SparkDeltaDestination(spark, None))
        outcome: BaseException | None = None
    except BaseException as error:  # noqa: BLE001 - asserted below
        outcome = error
    state.assert_unmoved()
    assert isinstance(outcome, PgcdcError), f"not a PgcdcError: {type(outcome).__name__}: {str(outcome)[:300]}"
    one_line(str(outcome), str(blocker / "lake"), "delta.root")


def test_delta_root_without_any_snapshot_does_not_advance_the_slot(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """delta.root pointing at the wrong (empty, writable) directory, e.g. a typo or an unmounted volume,
    where no published table was snapshotted: the incremental run refuses in one line naming delta.root
    and the snapshot job, leaves the slot, and a run on the right root then applies the pending changes."""
    good = prepare(pg, tmp_path, spark)
    state = State(pg, tmp_path / "lake")
    (tmp_path / "empty").mkdir()
    wrong = {**good, "delta": {"root": str(tmp_path / "empty")}}
    try:
        run_incremental(parse_config(wrong), SparkDeltaDestination(spark, None))
        outcome: BaseException | None = None
    except BaseException as error:  # noqa: BLE001 - asserted below
        outcome = error
    moved = state.read() != state.before
    good_run = run_incremental(
        parse_config(good), SparkDeltaDestination(spark, None)
    )  # back on the right root: is the lake still exact?
    exact = good_run.changes > 0
    assert not moved and exact, "the slot moved past the pending changes: the right lake never gets them"
    assert isinstance(outcome, PgcdcError)
    one_line(str(outcome), "delta.root", "pgcdc_snapshot")


SPARK_STEP = """
import sys
from dagster import DagsterInstance
from pgcdc_assets.builder import build_definitions
defs = build_definitions(sys.argv[1])
with DagsterInstance.ephemeral() as instance:
    result = defs.resolve_job_def("pgcdc_incremental").execute_in_process(instance=instance, raise_on_error=False)
(failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
print("STEP_FAILURE " + failure.step_failure_data.error.message.strip().replace("\\n", " | "))
"""


@pytest.mark.slow  # Dagster runs that wait for an engine that never answers
def test_unreachable_spark_connect_fails_the_step_quickly_with_one_line(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """spark.remote naming a Spark Connect server nobody listens on fails the step at once with
    one line naming spark.remote (the Spark Connect client alone would retry for minutes), and
    nothing moves. Run in a child process killed after 60 s so a hang cannot stall the suite."""
    good = prepare(pg, tmp_path, spark)
    state = State(pg, tmp_path / "lake")
    config_file = write(tmp_path, {**good, "spark": {"remote": "sc://127.0.0.1:1"}}, "remote.yaml")
    try:
        done = subprocess.run(
            [sys.executable, "-c", SPARK_STEP, str(config_file)],
            cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("the incremental step was still waiting for sc://127.0.0.1:1 after 60 s")
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("STEP_FAILURE ")]
    one_line(line, "sc://127.0.0.1:1", "spark.remote")
    state.assert_unmoved()
