"""Runs killed at a named crash point (one child process per run) and what the fault tests check
around them: a backlog to drain, the slot's confirmed position, a drain caught in its middle,
the one-line failure, exact convergence on the rerun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml
from pyspark.sql import SparkSession

from resources.config import PgcdcConfig
from resources.crash_points import FAULT_POINT_ENV
from resources.delta.spark_destination import lake_destination
from resources.lsn import LSN
from resources.runs.incremental import IncrementalResult, run_incremental
from resources.testing.verify import assert_buckets_right, assert_delta_equals_postgres
from tests.support.postgres import PgDatabase

REPO = Path(__file__).resolve().parents[2]

SLOT = "pgcdc_slot"

#: Changes per chunk while a drain is interrupted: many chunks, so there is a "middle".
SMALL_CHUNK = 200

NEVER_TRUNCATED_DDL = """
    CREATE TABLE ledger (entry int, note text);
    CREATE TABLE tally (k int, note text);
    ALTER TABLE tally REPLICA IDENTITY FULL;
    INSERT INTO tally VALUES (0, 'same'), (0, 'same');
"""
"""Tables :func:`backlog` writes in every transaction and never truncates (``journal`` is truncated
halfway): a keyless one and a REPLICA IDENTITY FULL one with identical rows, so a change inside a
crash window that is applied twice stays visible to the oracle. Also in tests/test_engines.py."""

NEVER_TRUNCATED = ("ledger", "tally")

FAULT_DDL = (
    NEVER_TRUNCATED_DDL
    + """
    CREATE TABLE acct (id int PRIMARY KEY, balance int, note text);
    CREATE TABLE journal (entry int, note text);
    INSERT INTO acct SELECT g, 0, 'start' FROM generate_series(1, 400) g;
    INSERT INTO journal VALUES (-1, 'seed');
    CREATE PUBLICATION pub FOR TABLE acct, journal, ledger, tally;
"""
)
"""The tables of this module's oracle (:func:`assert_exact`) and of :func:`backlog`."""


def write_config(config: PgcdcConfig, tmp_path: Path) -> Path:
    path = tmp_path / "pgcdc.yaml"
    path.write_text(yaml.safe_dump(config.model_dump()), encoding="utf-8")
    return path


def backlog(pg: PgDatabase, transactions: int = 150) -> None:
    """Small transactions touching every table, one large (streamed) transaction, a truncate of
    ``journal``; ``ledger`` and ``tally`` change in every transaction and are never truncated."""
    one_tally_copy = "ctid = (SELECT min(ctid) FROM tally WHERE k = %s AND note = 'same')"
    with pg.connect() as conn:
        for i in range(transactions):
            with conn.transaction():
                conn.execute("UPDATE acct SET balance = balance + 1, note = %s WHERE id %% 20 = %s", (f"t{i}", i % 20))
                conn.execute("INSERT INTO journal SELECT %s, 'e' || g FROM generate_series(1, 10) g", (i,))
                conn.execute("INSERT INTO ledger VALUES (%s, 'same'), (%s, 'same')", (i % 4, i % 4))
                conn.execute("INSERT INTO tally VALUES (%s, 'same')", (i % 3,))
                if i % 2:  # one of several identical copies changes, or goes
                    conn.execute(f"UPDATE tally SET note = 'changed' WHERE {one_tally_copy}", (i % 3,))
                elif i % 4 == 2:
                    conn.execute(f"DELETE FROM tally WHERE {one_tally_copy}", (i % 3,))
                if i % 50 == 49:
                    conn.execute("DELETE FROM acct WHERE id = %s", (i,))
                    conn.execute("INSERT INTO acct VALUES (%s, 7, 'reborn')", (1000 + i,))
            if i == transactions // 3:
                conn.execute("INSERT INTO journal SELECT -2, repeat('L', 200) FROM generate_series(1, 3000)")
            if i == transactions // 2:
                conn.execute("TRUNCATE journal")


def confirmed(pg: PgDatabase) -> LSN:
    ((value,),) = pg.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (SLOT,))
    return LSN.parse(value)


def flush_lsn(pg: PgDatabase) -> LSN:
    ((value,),) = pg.execute("SELECT pg_current_wal_flush_lsn()::text")
    return LSN.parse(value)


def slot_active_pid(pg: PgDatabase) -> int | None:
    rows = pg.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (SLOT,))
    return rows[0][0] if rows else None


def assert_never_truncated_exact(pg: PgDatabase, config: PgcdcConfig) -> None:
    """The oracle on ``ledger`` and ``tally``: a change applied twice anywhere in a backlog shows here."""
    for table in NEVER_TRUNCATED:
        assert_delta_equals_postgres(pg.dsn, f"public.{table}", config.table_path("public", table))


def assert_exact(pg: PgDatabase, config: PgcdcConfig) -> None:
    """The oracle on every table (acct has 400 rows throughout; journal, ledger are keyless, tally FULL)."""
    root = Path(config.delta.root)
    assert assert_delta_equals_postgres(pg.dsn, "public.acct", str(root / "public" / "acct"), key=("id",)) == 400
    assert assert_buckets_right(str(root / "public" / "acct")) is not None
    assert_delta_equals_postgres(pg.dsn, "public.journal", str(root / "public" / "journal"))
    assert_never_truncated_exact(pg, config)


def rerun_converges(
    pg: PgDatabase,
    config: PgcdcConfig,
    spark: SparkSession,
    exact: Callable[[PgDatabase, PgcdcConfig], None] | None = None,
) -> IncrementalResult:
    """Re-run in this process; the slot ends at the re-run's position, the data is exact
    (by ``exact``, default :func:`assert_exact` for this module's tables)."""
    before = flush_lsn(pg)
    result = run_incremental(config, lake_destination(spark, config), log=print)
    after = flush_lsn(pg)
    assert result.confirmed_flush_lsn == confirmed(pg)
    # The re-run confirms its end position: the flush LSN when it started, which background
    # WAL (checkpoints, autovacuum) may have moved past the workload's end.
    assert before <= result.end_lsn <= result.confirmed_flush_lsn <= after
    (exact or assert_exact)(pg, config)
    return result


class Child:
    """``tests.support.fault_child`` draining in the background, output in files (pipes could fill up)."""

    def __init__(
        self,
        config_file: Path,
        chunk: int | str = SMALL_CHUNK,
        env: dict[str, str] | None = None,
        ends: Sequence[LSN] = (),
    ) -> None:
        """``ends``: the child drains in runs ending at each of these positions, then in one to the end."""
        self.out = config_file.with_suffix(".out")
        self.err = config_file.with_suffix(".err")
        environment = {k: v for k, v in os.environ.items() if k != FAULT_POINT_ENV}
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.support.fault_child", str(config_file), str(chunk)]
                + ([",".join(map(str, ends))] if ends else []),
                stdout=out, stderr=err, cwd=REPO, env={**environment, **(env or {})},
            )  # fmt: skip

    def wait(self, timeout: float = 120) -> int:
        return self.process.wait(timeout)

    def output(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def error_lines(self) -> list[str]:
        """stderr without Sail's own log lines."""
        return [line for line in self.err.read_text().splitlines() if line.strip() and " sail_" not in line]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def killed_at(config_file: Path, fault: str, chunk: int, ends: Sequence[LSN] = ()) -> str:
    """A drain child (in runs ending at ``ends``, then to the end) that must be SIGKILLed at the crash point
    ``fault`` (one it does not reach fails); its standard output (the drain's log lines)."""
    child = Child(config_file, chunk=chunk, env={FAULT_POINT_ENV: fault}, ends=ends)
    try:
        code = child.wait(timeout=300)
        assert code == -signal.SIGKILL, f"the drain was not killed at {fault} (exit {code}):\n{child.output()}"
    finally:
        child.kill()
    return child.out.read_text()


def wait_mid_drain(pg: PgDatabase, child: Child, start: LSN, timeout: float = 90) -> LSN:
    """Until the child has confirmed at least one chunk and is still streaming; returns that position."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert child.process.poll() is None, f"the drain ended before it could be interrupted:\n{child.output()}"
        position = confirmed(pg)
        if position > start and slot_active_pid(pg) is not None:
            return position
        time.sleep(0.02)
    child.kill()
    raise AssertionError(f"no chunk confirmed within {timeout} s:\n{child.output()}")


def assert_one_line_failure(child: Child, kind: str, *fragments: str) -> str:
    code = child.wait()
    lines = child.error_lines()
    assert code == 2 and len(lines) == 1, f"exit {code}:\n{child.output()}"
    (line,) = lines
    assert line.startswith(f"pgcdc: {kind}: "), line
    for fragment in fragments:
        assert fragment in line, line
    return line
