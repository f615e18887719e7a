"""Crashes and faults in the middle of an incremental drain, against real PostgreSQL 15 and 18.

Every test interrupts a drain that is really under way (a child process streaming a
backlog in small chunks, at least one chunk already confirmed), checks what the user is
told, re-runs, and ends with the oracle (Delta equals PostgreSQL value for value, keyless
rows exactly once) and the slot confirmed where the re-run says, bracketed by the WAL
flush positions around it. Tests that restart or reconfigure PostgreSQL start a server of
their own; the others use a fresh database on the shared one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import deltalake
import psycopg
import pytest
from dagster import AssetKey, DagsterInstance
from pyspark.sql import SparkSession

from pgcdc_assets.builder import build_definitions
from resources.config import CONFIG_ENV_VAR, parse_config, PgcdcConfig
from resources.crash_points import FAULT_POINT_ENV
from resources.delta.reads import delta_rs_rows
from resources.delta.spark_destination import lake_destination
from resources.errors import SlotError
from resources.lsn import LSN
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.local_postgres import LocalPostgres, start_local_postgres
from resources.testing.verify import assert_delta_equals_postgres
from tests.support.deletion_vectors import assert_deletion_vectors
from tests.support.fault_runs import (
    assert_exact,
    assert_one_line_failure,
    backlog,
    Child,
    confirmed,
    FAULT_DDL,
    flush_lsn,
    REPO,
    rerun_converges,
    SLOT,
    slot_active_pid,
    wait_mid_drain,
    write_config,
)
from tests.support.postgres import PgDatabase, POSTGRES_VERSIONS, TEST_SERVER_SETTINGS
from tests.support.tcp_proxy import TcpProxy

pytest_plugins = ["tests.support.spark_fixtures"]
pytestmark = (
    pytest.mark.slow
)  # drains killed, servers restarted, network cut, in child processes; tiers: docs/testing.md

DAGSTER = str(Path(sys.executable).with_name("dagster"))


DDL = FAULT_DDL


# --------------------------------------------------------------------------- helpers


#: Restart modes, one per version to keep the suite short: a clean shutdown and a crash.
RESTARTS = [(major, ("fast", "immediate")[i % 2]) for i, major in enumerate(POSTGRES_VERSIONS)]
if len(POSTGRES_VERSIONS) == 1:
    RESTARTS.append((POSTGRES_VERSIONS[0], "immediate"))


def new_database(server: LocalPostgres) -> PgDatabase:
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        admin.execute('CREATE DATABASE "faults"')
    return PgDatabase(server, "faults")


def setup(pg: PgDatabase, tmp_path: Path, spark: SparkSession, dsn: str | None = None) -> PgcdcConfig:
    """Tables, publication, snapshot (which creates the slot); ``dsn`` overrides how pgcdc connects."""
    pg.execute(DDL)
    config = parse_config(
        {
            "postgres": {"dsn": dsn or pg.dsn},
            "publication": "pub",
            "slot": SLOT,
            # acct in range buckets of 50 keys (its re-inserted keys open new ones), so every crash
            # below is replayed into a bucketed table; acct copy-on-write (the opt-out: the crash matrix of
            # tests/test_incremental.py runs its keyed table with deletion vectors), tally with them
            "delta": {
                "root": str(tmp_path / "lake"),
                "buckets": {"tables": {"public.acct": {"width": 50}}},
                "deletion_vectors_tables": {"public.acct": False},
            },
        }
    )
    snapshot_tables(config, lake_destination(spark, config), None)
    assert_deletion_vectors(config, {"public.acct": False, "public.tally": True})
    return config


def wait_until_inactive(pg: PgDatabase, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while slot_active_pid(pg) is not None:
        assert time.monotonic() < deadline, "the walsender still holds the slot"
        time.sleep(0.05)


# --------------------------------------------------------------------------- the server goes away


@pytest.fixture(params=RESTARTS, ids=lambda p: f"pg{p[0]}-{p[1]}")
def restart_case(request: pytest.FixtureRequest) -> Iterator[tuple[LocalPostgres, str]]:
    major, mode = request.param
    server = start_local_postgres(major, TEST_SERVER_SETTINGS)
    try:
        yield server, mode
    finally:
        server.destroy()


def test_postgres_restarted_mid_drain_fails_with_connection_failure_and_rerun_is_exact(
    restart_case: tuple[LocalPostgres, str], tmp_path: Path, spark: SparkSession
) -> None:
    """A clean shutdown (fast) and a crash (immediate: the slot may fall back to its last checkpointed position)."""
    own_server, mode = restart_case
    pg = new_database(own_server)
    config = setup(pg, tmp_path, spark)
    start = confirmed(pg)
    backlog(pg)
    child = Child(write_config(config, tmp_path))
    try:
        wait_mid_drain(pg, child, start)
        own_server.stop(mode)
        assert_one_line_failure(child, "ConnectionFailure", "retry")
    finally:
        child.kill()
        own_server.start()
    assert confirmed(pg) >= start
    rerun_converges(pg, config, spark)


def test_walsender_terminated_mid_drain_fails_with_connection_failure_and_rerun_is_exact(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    config = setup(pg, tmp_path, spark)
    start = confirmed(pg)
    backlog(pg)
    child = Child(write_config(config, tmp_path))
    try:
        wait_mid_drain(pg, child, start)
        ((terminated,),) = pg.execute(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = %s", (SLOT,)
        )
        assert terminated
        assert_one_line_failure(child, "ConnectionFailure", "retry")
    finally:
        child.kill()
    after = confirmed(pg)
    assert after > start
    result = rerun_converges(pg, config, spark)
    assert result.start_lsn == after  # resumed where the interrupted run's last confirm left it


def test_network_cut_mid_stream_then_rerun_through_the_restored_proxy_is_exact(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    with TcpProxy("127.0.0.1", pg.server.port) as proxy:
        config = setup(pg, tmp_path, spark, dsn=proxy.dsn_for(pg.dsn))
        start = confirmed(pg)
        backlog(pg)
        child = Child(write_config(config, tmp_path))
        try:
            wait_mid_drain(pg, child, start)
            assert proxy.drop_all() >= 2  # the walsender connection and the SQL connection
            assert_one_line_failure(child, "ConnectionFailure", "retry")
        finally:
            child.kill()
        wait_until_inactive(pg)  # the server saw its peer go: the slot is free again
        accepted = proxy.accepted
        rerun_converges(pg, config, spark)
        assert proxy.accepted > accepted  # the re-run went through the proxy


# --------------------------------------------------------------------------- the slot is lost


LOST_SLOT_SETTINGS = {
    **TEST_SERVER_SETTINGS,
    "max_slot_wal_keep_size": "1MB",
    "wal_keep_size": "0",
    "max_wal_size": "32MB",
    "min_wal_size": "32MB",
}


@pytest.fixture(params=POSTGRES_VERSIONS, ids=lambda v: f"pg{v}")
def keep_little_wal(request: pytest.FixtureRequest) -> Iterator[LocalPostgres]:
    server = start_local_postgres(request.param, LOST_SLOT_SETTINGS)
    try:
        yield server
    finally:
        server.destroy()


def invalidate(pg: PgDatabase) -> None:
    """Generate WAL while no consumer runs and CHECKPOINT until PostgreSQL gives the slot up."""
    pg.execute("CREATE TABLE filler (x text)")  # unpublished: only makes WAL
    for _ in range(20):
        pg.execute("INSERT INTO filler SELECT repeat('x', 100) FROM generate_series(1, 5000)")
        pg.execute("SELECT pg_switch_wal()")
        pg.execute("CHECKPOINT")
        ((status,),) = pg.execute("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (SLOT,))
        if status == "lost":
            return
    raise AssertionError(f"slot still {status} after 20 checkpoints")


def test_slot_lost_to_max_slot_wal_keep_size_fails_naming_resnapshot_and_resnapshot_restores_equality(
    keep_little_wal: LocalPostgres, tmp_path: Path, spark: SparkSession
) -> None:
    pg = new_database(keep_little_wal)
    config = setup(pg, tmp_path, spark)
    backlog(pg, transactions=30)
    invalidate(pg)
    slot_before = pg.execute("SELECT confirmed_flush_lsn, restart_lsn, wal_status FROM pg_replication_slots")
    versions = {t: deltalake.DeltaTable(f"{config.delta.root}/public/{t}").version() for t in ("acct", "journal")}

    with pytest.raises(SlotError) as lost:
        run_incremental(config, lake_destination(spark, config))
    message = str(lost.value)
    assert f'replication slot "{SLOT}" is invalidated (wal_status lost' in message, message
    assert "pgcdc_resnapshot" in message and "\n" not in message

    config_file = write_config(config, tmp_path)
    defs = build_definitions(config_file)
    with DagsterInstance.ephemeral() as instance:
        failed = defs.resolve_job_def("pgcdc_incremental").execute_in_process(instance=instance, raise_on_error=False)
        assert not failed.success
        (failure,) = [e for e in failed.all_events if e.event_type_value == "STEP_FAILURE"]
        assert failure.step_failure_data.error.message.strip().endswith(message)
        # Nothing moved: no Delta commit, the slot as PostgreSQL left it.
        assert (
            pg.execute("SELECT confirmed_flush_lsn, restart_lsn, wal_status FROM pg_replication_slots") == slot_before
        )
        for table, version in versions.items():
            assert deltalake.DeltaTable(f"{config.delta.root}/public/{table}").version() == version

        # The fix the message names.
        resnapshot = defs.resolve_job_def("pgcdc_resnapshot").execute_in_process(instance=instance)
        assert resnapshot.success
    ((status,),) = pg.execute("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (SLOT,))
    assert status in ("reserved", "extended")
    assert_exact(pg, config)
    backlog(pg, transactions=20)
    rerun_converges(pg, config, spark)


# --------------------------------------------------------------------------- two runs at once


def test_second_run_while_one_drains_fails_fast_and_the_first_finishes_exactly(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    config = setup(pg, tmp_path, spark)
    start = confirmed(pg)
    backlog(pg)
    before = flush_lsn(pg)
    child = Child(write_config(config, tmp_path))
    try:
        wait_mid_drain(pg, child, start)
        pid = slot_active_pid(pg)
        # Refused, not queued behind the first run: a second run that waited for the slot would
        # succeed once the first finished; the message names the first run's walsender.
        with pytest.raises(SlotError) as busy:
            run_incremental(config, lake_destination(spark, config))
        assert str(busy.value).startswith(
            f'replication slot "{SLOT}" is in use by PID {pid} (pgcdc_incremental pid {child.process.pid} on '
        ), busy.value
        assert str(busy.value).endswith(
            ": another run or consumer is reading it (a second drain of one slot cannot run beside the first):"
            " wait for it to finish and retry, or stop the other consumer"
        )
        assert child.wait() == 0, child.output()
    finally:
        child.kill()
    after = flush_lsn(pg)
    assert before <= confirmed(pg) <= after
    assert f"confirmed {confirmed(pg)} " in child.output()
    assert_exact(pg, config)


# --------------------------------------------------------------------------- SIGKILL


def streamed_spill_files(temporary: Path) -> list[Path]:
    """The spill files of streamed transactions the drain holds (``resources/cdc/transactions.py``:
    ``<n>-s<xid>.pickle`` in its ``pgcdc-txn-*`` directory, under the child's TMPDIR)."""
    return sorted(temporary.glob("pgcdc-txn-*/*-s*.pickle"))


def test_sigkill_while_streaming_then_rerun_is_exact(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    """Killed from outside between the fault points: mid-drain, with a streamed transaction in the spill.

    A large transaction opened before the backlog and still open while the child drains is streamed
    to it in progress (logical_decoding_work_mem is 64kB) and kept in a spill file until its commit,
    which comes only after the kill: the kill waits for that file, not for a clock."""
    config = setup(pg, tmp_path, spark)
    start = confirmed(pg)
    temporary = tmp_path / "child-tmp"
    temporary.mkdir()
    with psycopg.connect(pg.dsn) as open_txn:  # not autocommit
        open_txn.execute("INSERT INTO ledger SELECT -3, repeat('L', 200) FROM generate_series(1, 3000)")  # stays open
        backlog(pg)
        child = Child(write_config(config, tmp_path), env={"TMPDIR": str(temporary)})
        try:
            wait_mid_drain(pg, child, start)
            deadline = time.monotonic() + 90
            while not streamed_spill_files(temporary):
                assert child.process.poll() is None, f"the drain ended without the open transaction:\n{child.output()}"
                assert time.monotonic() < deadline, f"no streamed transaction spilled:\n{child.output()}"
                time.sleep(0.02)
            assert slot_active_pid(pg) is not None  # still draining
            child.process.send_signal(signal.SIGKILL)
            assert child.wait() == -signal.SIGKILL
        finally:
            child.kill()
        open_txn.commit()
    wait_until_inactive(pg)
    assert confirmed(pg) > start
    result = rerun_converges(pg, config, spark)
    assert result.tables["public.ledger"].inserted >= 3000  # the open transaction, committed after the kill


def test_sigkill_after_the_final_confirm_before_dagster_records_metadata(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """The Dagster step dies after the slot is confirmed but before any materialization is written:
    the next run finds the data in Delta and the slot past it, applies nothing, and still materializes
    the table, whose newest change lies past the last drain Dagster recorded.

    Through the real ``dagster job execute`` CLI (a SIGKILL needs its own process).
    """
    config = setup(pg, tmp_path, spark)
    config_file = write_config(config, tmp_path)
    backlog(pg, transactions=20)  # one chunk: the first confirm is the run's final one
    home = tmp_path / "dagster_home"
    home.mkdir()
    env = {**os.environ, CONFIG_ENV_VAR: str(config_file), "DAGSTER_HOME": str(home), FAULT_POINT_ENV: "after_confirm"}
    killed = subprocess.run(
        [DAGSTER, "job", "execute", "-m", "pgcdc_assets.definitions", "-j", "pgcdc_incremental"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    wait_until_inactive(pg)
    after_crash = confirmed(pg)
    assert_exact(pg, config)  # everything is in Delta and confirmed ...

    with DagsterInstance.from_config(str(home)) as instance:
        (crashed,) = instance.get_runs()
        assert crashed.status.value == "STARTED"  # ... but the run never finished
        assert instance.get_latest_materialization_event(AssetKey(["pgcdc", "public", "acct"])) is None

        result = (
            build_definitions(config_file).resolve_job_def("pgcdc_incremental").execute_in_process(instance=instance)
        )
        assert result.success
        (event,) = [
            e.event_specific_data.materialization
            for e in result.get_asset_materialization_events()
            if e.event_specific_data.materialization.asset_key.path[-1] == "acct"
        ]
    metadata = {key: value.value for key, value in event.metadata.items()}
    assert metadata["pgcdc/start_lsn"] == str(after_crash)
    assert metadata["pgcdc/changes_applied"] == 0
    assert "pgcdc/applied_lsn" not in metadata  # nothing applied by this run ...
    assert LSN.parse(metadata["pgcdc/last_applied_lsn"]) <= after_crash  # ... the killed one's newest change
    assert metadata["pgcdc/confirmed_flush_lsn"] == str(confirmed(pg))
    assert_exact(pg, config)


# --------------------------------------------------------------------------- the oracle itself


def test_oracle_compares_char_n_with_its_blank_padding(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    """Delta keeps char(n)'s blank padding (PostgreSQL's output, docs/type-mapping.md) and the oracle
    (resources/testing/verify.py) compares it with the padding, not through ``::text``, which strips it."""
    pg.execute("CREATE TABLE padded (id int PRIMARY KEY, code char(5)); INSERT INTO padded VALUES (1, 'a'), (2, NULL)")
    pg.execute("CREATE PUBLICATION pub FOR TABLE padded")
    config = parse_config({"postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": SLOT,
                           "delta": {"root": str(tmp_path / "lake")}})  # fmt: skip
    snapshot_tables(config, lake_destination(spark, config), None)
    stored = delta_rs_rows(config.table_path("public", "padded")).sort_by("id")
    assert stored.column("code").to_pylist() == ["a    ", None]  # PostgreSQL's output for char(5)
    assert assert_delta_equals_postgres(pg.dsn, "public.padded", config.table_path("public", "padded")) == 2


# --------------------------------------------------------------------------- the embedded engine dies


def test_embedded_sail_killed_mid_drain_fails_with_one_line_and_rerun_is_exact(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """The default engine (Sail in a child process of the drain, ``resources/engines/sail_server.py``)
    SIGKILLed while the drain applies chunks: the drain fails with one line naming the engine, the
    slot stays where the last durable chunk put it, and a re-run (with a new engine) is exact."""
    config = setup(pg, tmp_path, spark)
    start = confirmed(pg)
    backlog(pg)
    child = Child(write_config(config, tmp_path))
    try:
        wait_mid_drain(pg, child, start)
        engine_pid = int(child.out.read_text().split("engine up ", 1)[1].split()[0])
        os.kill(engine_pid, signal.SIGKILL)
        assert_one_line_failure(child, "EngineUnavailable", "stopped answering (")
    finally:
        child.kill()
    wait_until_inactive(pg)
    after_failure = confirmed(pg)
    assert after_failure > start
    result = rerun_converges(pg, config, spark)
    assert result.start_lsn == after_failure
