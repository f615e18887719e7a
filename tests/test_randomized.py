"""Randomized workloads ("Prove it"): thousands of seeded random operations on PostgreSQL 15 and 18,
interleaved with incremental runs; after every run each snapshotted table must equal PostgreSQL exactly.

The workload (``tests/support/workload.py``) covers inserts, updates (key changes, unchanged TOAST),
changes to one copy among identical rows of a REPLICA IDENTITY FULL table (NULLs, TOAST),
deletes, TRUNCATE, rolled-back transactions, savepoints rolled back inside committed ones,
streamed transactions (committed, aborted, left open across a run), two-phase commit and
rollback (also a prepared transaction pending across a run), ADD/DROP COLUMN and a widening
mid-stream (also inside transactions that roll back), a table added to the publication
mid-stream and snapshotted later, and re-snapshots in the middle; runs use random small
``max_chunk_changes``.

Modes:

* default (CI): ``DEFAULT_SEEDS`` with ``DEFAULT_OPS`` operations each, per PostgreSQL version;
* long: ``PGCDC_LONG=1`` or ``pytest --pgcdc-long``: ``PGCDC_LONG_SEEDS`` (default 10) fresh
  random seeds with ``LONG_OPS`` operations each;
* replay: ``PGCDC_SEED=<seed>[,<seed>...]`` (and ``PGCDC_OPS=<n>``, as printed on failure).

Every case prints its seed first; a failure names the seed, the step and the SQL that led there,
and writes the whole workload to ``workload-<seed>.sql`` in the test's tmp_path.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import deltalake
import psycopg
import pytest
from pyspark.sql import SparkSession

from resources.postgres.catalog import TableName
from resources.config import PgcdcConfig, parse_config
from resources.postgres.connections import libpq_options
from resources.runs.incremental import run_incremental
from resources.pgtypes import SESSION_SETTINGS
from resources.runs.snapshot import snapshot_tables
from tests.support.deletion_vectors import assert_deletion_vectors
from tests.support.postgres import PgDatabase
from tests.support.workload import DDL, Step, generate

from resources.testing.verify import assert_buckets_right, assert_delta_equals_postgres, compare_table

pytest_plugins = ["tests.support.spark_fixtures"]
pytestmark = pytest.mark.slow  # long seeded workloads; tiers: docs/testing.md

#: Tables of the workload on copy-on-write (``delta.deletion_vectors_tables``) and with deletion vectors.
COPY_ON_WRITE = ("public.k_comp", "public.full_t")
DELETION_VECTORS = ("public.k_int", "public.k_uuid", "public.dup_t")
DEFAULT_SEEDS = [20240601, 7]
DEFAULT_OPS = 350
LONG_OPS = 3000


def _long(config: pytest.Config) -> bool:
    option = config.getoption("--pgcdc-long", default=False)
    return bool(option) or os.environ.get("PGCDC_LONG", "") not in ("", "0")


def _cases(config: pytest.Config) -> list[tuple[int, int]]:
    long = _long(config)
    ops = int(os.environ.get("PGCDC_OPS", LONG_OPS if long else DEFAULT_OPS))
    if os.environ.get("PGCDC_SEED"):
        return [(int(seed), ops) for seed in os.environ["PGCDC_SEED"].split(",")]
    if long:
        count = int(os.environ.get("PGCDC_LONG_SEEDS", "10"))
        return [(random.SystemRandom().randrange(10**9), ops) for _ in range(count)]
    return [(seed, ops) for seed in DEFAULT_SEEDS]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        cases = _cases(metafunc.config)
        metafunc.parametrize("case", cases, ids=[f"seed{seed}-ops{ops}" for seed, ops in cases])


class WorkloadFailure(AssertionError):
    pass


class Replay:
    """Executes steps; on any failure says how to replay and what led there."""

    def __init__(self, pg: PgDatabase, tmp_path: Path, spark: SparkSession, seed: int, ops: int) -> None:
        self.pg, self.spark, self.seed, self.ops = pg, spark, seed, ops
        self.slot = f"rand_{pg.name}"
        self.config: PgcdcConfig = parse_config({
            "postgres": {"dsn": pg.dsn},
            "publication": "pub",
            "slot": self.slot,
            "tables": [],
            # Small buckets, so key changes and TOAST-keeping updates move rows between them;
            # the other tables get the layout their size gives them (one bucket at this size).
            # A composite-key table and a REPLICA IDENTITY FULL one copy-on-write (the opt-out), the
            # other keyed and FULL tables with deletion vectors (the default): both in every run.
            "delta": {"root": str(tmp_path / "lake"), "buckets": {"tables": {
                "public.k_int": {"width": 64}, "public.k_comp": {"count": 2}, "public.late": {"count": 2},
            }}, "deletion_vectors_tables": {name: False for name in COPY_ON_WRITE}},
        })
        self.log_file = tmp_path / f"workload-{seed}.sql"
        self.run_log: list[str] = []
        self.runs = 0
        self.oracle_checks = 0
        self.run_times: list[str] = []  # changes@max_chunk_changes:duration per run
        self.most_duplicates = 0  # most identical copies beyond the first in dup_t at an oracle check

    def replay_hint(self) -> str:
        return (f"PGCDC_SEED={self.seed} PGCDC_OPS={self.ops} PGCDC_TEST_VERSIONS={self.pg.major} "
                f".venv/bin/pytest tests/test_randomized.py")

    def fail(self, steps: list[Step], index: int, error: BaseException) -> WorkloadFailure:
        recent = "\n".join(f"  #{i}: {steps[i].render()[:600]}" for i in range(max(0, index - 25), index + 1))
        runlog = "\n".join(f"    {line}" for line in self.run_log[-15:])
        return WorkloadFailure(
            f"seed {self.seed} (PostgreSQL {self.pg.major}) failed at step #{index} of {len(steps)}: "
            f"{type(error).__name__}: {error}\n"
            f"replay: {self.replay_hint()}\nfull workload: {self.log_file}\n"
            f"steps before it:\n{recent}\nlast run_incremental log:\n{runlog}"
        )

    def execute(self, steps: list[Step]) -> None:
        self.log_file.write_text(
            f"-- seed {self.seed}, {self.ops} ops\n{DDL}\n"
            + "\n".join(f"-- #{i}\n{step.render()};" for i, step in enumerate(steps)) + "\n"
        )
        self.pg.execute(DDL)
        snapshot_tables(self.config, self.spark)  # creates the slot; `late` is not published yet
        assert_deletion_vectors(self.config, {**{name: True for name in DELETION_VECTORS}, **{name: False for name in COPY_ON_WRITE}})
        with self.pg.connect() as main, self.pg.connect() as second:
            conns = [main, second]
            for index, step in enumerate(steps):
                try:
                    self.step(step, conns)
                except Exception as exc:
                    raise self.fail(steps, index, exc) from exc

    def step(self, step: Step, conns: list[psycopg.Connection]) -> None:
        if step.kind == "sql":
            conn = conns[step.conn]
            for statement in step.statements:
                conn.execute(statement)
        elif step.kind == "snapshot":
            snapshot_tables(self.config, self.spark, [TableName("public", step.table)])
        elif step.kind == "run":
            self.run_log = []
            started = time.monotonic()
            result = run_incremental(self.config, self.spark, log=self.run_log.append, max_chunk_changes=step.chunk)
            self.runs += 1
            self.run_times.append(f"{result.changes}@{step.chunk}:{time.monotonic() - started:.1f}s")
            assert result.confirmed_flush_lsn >= result.end_lsn, (result.confirmed_flush_lsn, result.end_lsn)
            for name, (key, lingering) in step.checks.items():
                self.oracle(name, key, lingering)
            unsnapshotted = set(result.tables_without_snapshot)
            checked = {f"public.{name}" for name in step.checks}
            assert unsnapshotted == set(result.tables) - checked, (unsnapshotted, sorted(result.tables), sorted(checked))
        else:  # pragma: no cover
            raise ValueError(step.kind)

    def oracle(self, name: str, key: list[str], lingering: list[str]) -> None:
        """Delta equals PostgreSQL, exactly.

        One allowance: a column added in PostgreSQL reaches Delta with the first change of the
        table after it (pgoutput announces columns in Relation messages, sent before a change), so
        until then Delta may lack it, provided PostgreSQL holds only NULLs in it (nothing has been
        written to it that pgcdc could have missed). The rest is compared through a temporary view.
        """
        path = self.config.table_path("public", name)
        delta_columns = {f.name for f in deltalake.DeltaTable(path).schema().fields}
        with psycopg.connect(self.pg.dsn, autocommit=True, options=libpq_options(SESSION_SETTINGS)) as conn:
            pg_columns = [c for (c,) in conn.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped"
                " ORDER BY attnum", (f"public.{name}",)).fetchall()]
            missing = [c for c in pg_columns if c not in delta_columns]
            target = f"public.{name}"
            if missing:
                for column in missing:
                    (written,), = conn.execute(f'SELECT count(*) FROM public.{name} WHERE "{column}" IS NOT NULL').fetchall()
                    assert written == 0, (
                        f"public.{name}: column {column} holds {written} non-NULL values in PostgreSQL but is not in Delta"
                    )
                present = ", ".join(f'"{c}"' for c in pg_columns if c in delta_columns)
                conn.execute(f"CREATE TEMP VIEW cmp_{name} AS SELECT {present} FROM public.{name}")
                target = f"pg_temp.cmp_{name}"
            compare_table(conn, target, path, key=key, extra_delta_columns=lingering)
            if missing:
                # Dropped now: a backend drops its temporary objects after the client has left, and
                # the view would block the workload's next DROP COLUMN until then.
                conn.execute(f"DROP VIEW pg_temp.cmp_{name}")
            assert_buckets_right(path)
            if name == "dup_t":
                (copies,), = conn.execute("SELECT count(*) - count(DISTINCT d.*) FROM public.dup_t d").fetchall()
                self.most_duplicates = max(self.most_duplicates, copies)
        self.oracle_checks += 1


def test_randomized_workload_matches_postgres_after_every_run(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, case: tuple[int, int]
) -> None:
    seed, ops = case
    print(f"randomized workload: seed {seed}, {ops} ops, PostgreSQL {pg.major}")
    started = time.monotonic()
    steps = generate(seed, ops)
    replay = Replay(pg, tmp_path, spark, seed, ops)
    print(f"replay with: {replay.replay_hint()}")
    replay.execute(steps)
    (streamed,), = pg.execute("SELECT stream_txns FROM pg_stat_replication_slots WHERE slot_name = %s", (replay.slot,))
    if any(step.note.startswith("large") for step in steps):
        assert streamed > 0, "no transaction was streamed: the workload no longer exercises streaming"
    print(f"seed {seed}: {streamed} streamed transactions, up to {replay.most_duplicates} duplicate rows in dup_t")
    assert replay.most_duplicates > 0, "dup_t never held identical rows: the workload no longer exercises them"
    print(f"seed {seed}: {len(steps)} steps, {replay.runs} runs, {replay.oracle_checks} table comparisons, "
          f"{time.monotonic() - started:.1f}s; runs {' '.join(replay.run_times)}")


# --------------------------------------------------------------------------- findings (regression tests)


def _single_table(pg: PgDatabase, tmp_path: Path, spark: SparkSession, ddl: str) -> PgcdcConfig:
    pg.execute(ddl)
    config = parse_config({
        "postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": f"rand_{pg.name}", "tables": [],
        "delta": {"root": str(tmp_path / "lake")},
    })
    snapshot_tables(config, spark)
    return config


def test_walsender_keeps_the_connection_while_one_transaction_is_applied_in_many_chunks(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """Regression (seed 7, 450 ops, PostgreSQL 15 and 18, chunk 3): the walsender dropped the
    connection ("server closed the connection unexpectedly") while one transaction was applied
    in many chunks, since nothing answered it while the run waited for Delta commits. The waits
    now send status updates (same durable position) at a quarter of wal_sender_timeout. Here:
    wal_sender_timeout 1 s, a 40-row transaction, max_chunk_changes=1 (about 2 s of Delta commits).
    """
    config = _single_table(pg, tmp_path, spark, """
        CREATE TABLE w (id int PRIMARY KEY, v text);
        INSERT INTO w VALUES (0, 'seed');
        CREATE PUBLICATION pub FOR TABLE w;
    """)
    pg.execute(f"ALTER DATABASE \"{pg.name}\" SET wal_sender_timeout = '1s'")  # the walsender of this database
    pg.execute("INSERT INTO w SELECT g, 'v' || g FROM generate_series(1, 40) g")
    run_incremental(config, spark, max_chunk_changes=1)
    assert assert_delta_equals_postgres(pg.dsn, "public.w", config.table_path("public", "w"), key=("id",)) == 41


def test_added_column_with_default_reaches_existing_rows_in_delta(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """Regression: ``ALTER TABLE ... ADD COLUMN c ... DEFAULT x`` gives every existing row ``x`` in
    PostgreSQL without any row change in the WAL (a non-volatile default is stored once in
    pg_attribute.attmissingval). Delta had NULL there for every untouched row; now the rows
    already in Delta get the missing value when the column first appears in a Relation message.
    """
    config = _single_table(pg, tmp_path, spark, """
        CREATE TABLE d (id int PRIMARY KEY, v text);
        INSERT INTO d SELECT g, 'v' FROM generate_series(1, 3) g;
        CREATE PUBLICATION pub FOR TABLE d;
    """)
    pg.execute("ALTER TABLE d ADD COLUMN status text NOT NULL DEFAULT 'new'")
    pg.execute("UPDATE d SET v = 'changed' WHERE id = 1")  # the Relation message announcing status
    run_incremental(config, spark)
    assert assert_delta_equals_postgres(pg.dsn, "public.d", config.table_path("public", "d"), key=("id",)) == 3
