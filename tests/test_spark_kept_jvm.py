"""The managed Spark JVM kept between runs (``spark.keep_alive_s``, ``resources/engines/kept_spark.py``).

Real processes throughout: runs in this process and in child processes, a JVM started by the first
run and reused by the next ones, leases the kernel releases when a run is SIGKILLed, a supervisor
that stops the JVM's whole process group when idle and takes it along when it dies itself. Each
JVM start costs 5-15 s here, so one scenario walks them all on three servers; the state lives in
the test's own directory (``$PGCDC_SPARK_SERVERS``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from dagster import build_init_resource_context

from pgcdc_assets.dagster_resources import SparkDeltaResource
from resources.config import parse_config, PgcdcConfig, SparkSettings
from resources.delta.spark_destination import lake_destination
from resources.engines.engine import SparkEngine
from resources.engines.kept_spark import ANSWER_TIMEOUT_ENV, SERVERS_DIR_ENV, stop_all
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.verify import assert_delta_equals_postgres
from tests.support.engine_fixtures import group_alive
from tests.support.fault_runs import REPO, SLOT, write_config
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase

pytestmark = pytest.mark.spark  # Spark JVMs; tiers: docs/testing.md

DDL = """
    CREATE TABLE acct (id int PRIMARY KEY, balance int, note text);
    CREATE TABLE dup (k int, v text);
    ALTER TABLE dup REPLICA IDENTITY FULL;
    INSERT INTO acct SELECT g, 0, 'start' FROM generate_series(1, 200) g;
    INSERT INTO dup VALUES (1, 'a'), (1, 'a'), (2, 'b');
    CREATE PUBLICATION pub FOR TABLE acct, dup;
"""

PATIENT_S = 120
"""How long the test's runs wait for a live kept JVM to answer (``$PGCDC_SPARK_ANSWER_TIMEOUT``)."""

RUN_CHILD = """
import sys
from resources.config import load_config
from resources.engines.engine import SparkEngine
engine = SparkEngine.from_config(load_config(sys.argv[1]).spark)
engine.spark.sql("SELECT 1").collect()
print("engine up", engine.server_pid, flush=True)
sys.stdin.read()
engine.close()
"""
"""A run that takes the engine, uses it, and holds it (and its lease) until its stdin closes."""


class LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def kept_config(pg: PgDatabase, tmp_path: Path, keep_alive_s: int) -> PgcdcConfig:
    return parse_config({
        "postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": SLOT, "delta": {"root": str(tmp_path / "lake")},
        "spark": {"engine": "spark", "keep_alive_s": keep_alive_s},
    })  # fmt: skip


def assert_lake_exact(pg: PgDatabase, config: PgcdcConfig) -> None:
    assert_delta_equals_postgres(pg.dsn, "public.acct", config.table_path("public", "acct"), key=("id",))
    assert_delta_equals_postgres(pg.dsn, "public.dup", config.table_path("public", "dup"))


def writes(pg: PgDatabase, round_: int) -> None:
    with pg.connect() as conn:
        for i in range(20):
            with conn.transaction():
                conn.execute("UPDATE acct SET balance = balance + 1, note = %s WHERE id = %s", (f"r{round_}", 1 + i))
                conn.execute("INSERT INTO dup VALUES (%s, 'x'), (%s, 'x')", (i % 3, i % 3))
        conn.execute("DELETE FROM acct WHERE id = %s", (100 + round_,))


def drain(config: PgcdcConfig) -> str:
    """One run: its own engine (and lease), a drain, the engine closed; returns the run's start note."""
    with SparkEngine.from_config(config.spark) as engine:
        run_incremental(config, lake_destination(engine.spark, config))
        assert engine.start_note is not None
        return engine.start_note


def use_engine(settings: SparkSettings) -> str:
    """A run that only asks the engine a question; returns the run's start note."""
    with SparkEngine.from_config(settings) as engine:
        assert engine.spark.range(3).count() == 3
        assert engine.start_note is not None
        return engine.start_note


def wait_until(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.2)
    return condition()


def start_run_child(config_path: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", RUN_CHILD, str(config_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, text=True,
    )  # fmt: skip


def child_jvm(child: subprocess.Popen[str]) -> int:
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.startswith("engine up "), (line, child.poll())
    return int(line.split()[2])


def state_of(directory: Path) -> dict[str, float]:
    return json.loads((directory / "server.json").read_text())


@NEWEST_POSTGRES_ONLY
@pytest.mark.timeout(1800)
def test_runs_share_a_kept_jvm_that_stops_when_idle(
    pg: PgDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs starting at once share one JVM; the runs after them reuse it (same pid) and are
    exact; a run SIGKILLed while holding its lease releases it, and keep_alive_s after the last lease
    the JVM's process group is gone and its state removed. Then a new run starts a new JVM; its
    supervisor SIGKILLed takes the JVM with it; the next run finds the stale state, cleans it and
    starts another; that one stopped (SIGSTOP: its port takes connections, it answers nothing), the
    next run replaces it too, and ``pgcdc spark-server --stop`` stops the last (these runs only query the engine:
    a drain on a fresh JVM costs a minute here and shows nothing the first ones do not)."""
    servers = tmp_path / "servers"
    monkeypatch.setenv(SERVERS_DIR_ENV, str(servers))
    # The JVMs must answer the runs' probes until the one stopped on purpose: the suite's other worker loads the
    # two cores, and a JVM taken for silent would be replaced under the runs using it.
    monkeypatch.setenv(ANSWER_TIMEOUT_ENV, str(PATIENT_S))
    pg.execute(DDL)
    quick = kept_config(pg, tmp_path, keep_alive_s=3)
    children = [start_run_child(write_config(quick, tmp_path)) for _ in range(2)]
    try:
        jvms = {child_jvm(child) for child in children}
        assert len(jvms) == 1, jvms  # one server for both
        (jvm,) = jvms
        (directory,) = [path for path in servers.iterdir() if path.is_dir()]
        assert stat.S_IMODE(servers.stat().st_mode) == stat.S_IMODE(directory.stat().st_mode) == 0o700
        state = state_of(directory)
        assert state["jvm_pid"] == jvm and state["keep_alive_s"] == 3
        assert set(state) == {
            "port",
            "jvm_pid",
            "jvm_start",
            "supervisor_pid",
            "supervisor_start",
            "started_at",
            "keep_alive_s",
        }

        context = build_init_resource_context()
        logged = LogLines()
        context.log.addHandler(logged)  # the step's log in a Dagster run
        with SparkDeltaResource.from_pgcdc_config(quick).yield_for_execution(context) as resource:
            snapshot_tables(quick, resource.snapshot_destination())
            assert resource._engine is not None and resource._engine.server_pid == jvm
        jvm_lines = [line for line in logged.lines if "Spark JVM" in line]
        assert len(jvm_lines) == 1 and f"reused the Spark JVM pid {jvm}, started " in jvm_lines[0], logged.lines
        assert_lake_exact(pg, quick)
        writes(pg, 1)
        assert drain(quick).startswith(f"reused the Spark JVM pid {jvm}, ")
        assert_lake_exact(pg, quick)

        assert children[0].stdin is not None
        children[0].stdin.close()
        assert children[0].wait(timeout=120) == 0
        assert group_alive(jvm)  # the SIGKILLed run's lease below is the last one
        children[1].kill()
        children[1].wait()
        assert wait_until(lambda: not group_alive(jvm) and not directory.exists(), 120), (
            "the kept JVM (or its state) outlived keep_alive_s without a lease"
        )

        kept = kept_config(pg, tmp_path, keep_alive_s=600).spark  # runs that only use the engine from here on
        note = use_engine(kept)
        second = int(state_of(directory)["jvm_pid"])
        assert second != jvm and note.startswith(f"started a Spark JVM (pid {second}) in ")
        os.kill(int(state_of(directory)["supervisor_pid"]), signal.SIGKILL)
        assert wait_until(lambda: not group_alive(second), 60), "the JVM outlived its supervisor"
        assert state_of(directory)["jvm_pid"] == second  # stale: its supervisor died before cleaning up

        note = use_engine(kept)
        third = int(state_of(directory)["jvm_pid"])
        assert third not in (jvm, second) and note.startswith(f"started a Spark JVM (pid {third}) in ")
        assert group_alive(third)  # kept: 600 s

        os.kill(third, signal.SIGSTOP)  # alive, its port still taking connections, but silent
        monkeypatch.setenv(ANSWER_TIMEOUT_ENV, "3")  # it never answers: no need to wait the default 10 s
        note = use_engine(kept)
        fourth = int(state_of(directory)["jvm_pid"])
        assert fourth not in (jvm, second, third) and note.startswith(f"started a Spark JVM (pid {fourth}) in ")
        assert not group_alive(third)

        stopped = subprocess.run(
            [sys.executable, "-m", "resources.runs.cli", "spark-server", "--stop"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert stopped.stdout == f"pgcdc: stopped 1 kept Spark JVM(s) (pid {fourth})\n", stopped
        assert wait_until(lambda: not group_alive(fourth) and not directory.exists(), 30)
    finally:
        for child in children:
            child.kill()
            child.wait()
        stop_all()
