"""Random workloads run step by step against PostgreSQL and Delta, saying on a failure how to
replay them."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import deltalake
import psycopg
from pyspark.sql import SparkSession

from resources.config import parse_config, PgcdcConfig
from resources.delta.spark_destination import lake_destination
from resources.pgtypes import SESSION_SETTINGS
from resources.postgres.catalog import TableName
from resources.postgres.connections import libpq_options
from resources.runs.incremental import run_incremental
from resources.runs.quarantine import Quarantine
from resources.runs.snapshot import snapshot_tables
from resources.testing.verify import assert_buckets_right, compare_table
from tests.support.deletion_vectors import assert_deletion_vectors
from tests.support.postgres import PgDatabase
from tests.support.workload import DDL, Step

#: Tables of the workload on copy-on-write (``delta.deletion_vectors_tables``) and with deletion vectors.
COPY_ON_WRITE = ("public.k_comp", "public.full_t")
DELETION_VECTORS = ("public.k_int", "public.k_uuid", "public.dup_t")


class WorkloadFailure(AssertionError):
    pass


class Replay:
    """Executes steps; on any failure says how to replay and what led there."""

    def __init__(self, pg: PgDatabase, tmp_path: Path, spark: SparkSession, seed: int, ops: int) -> None:
        self.pg, self.spark, self.seed, self.ops = pg, spark, seed, ops
        self.slot = f"rand_{pg.name}"
        self.config: PgcdcConfig = parse_config(
            {
                "postgres": {"dsn": pg.dsn},
                "publication": "pub",
                "slot": self.slot,
                "tables": [],
                # Small buckets, so key changes and TOAST-keeping updates move rows between them;
                # the other tables get the layout their size gives them (one bucket at this size).
                # A composite-key table and a REPLICA IDENTITY FULL one copy-on-write (the opt-out), the
                # other keyed and FULL tables with deletion vectors (the default): both in every run.
                "delta": {
                    "root": str(tmp_path / "lake"),
                    "buckets": {
                        "tables": {
                            "public.k_int": {"width": 64},
                            "public.k_comp": {"count": 2},
                            "public.late": {"count": 2},
                        }
                    },
                    "deletion_vectors_tables": {name: False for name in COPY_ON_WRITE},
                },
            }
        )
        self.log_file = tmp_path / f"workload-{seed}.sql"
        self.run_log: list[str] = []
        self.runs = 0
        #: Tables re-snapshotted because a drain could not tell a rename (:meth:`resnapshot_ambiguous`).
        self.resnapshots = 0
        self.oracle_checks = 0
        self.run_times: list[str] = []  # changes@max_chunk_changes:duration per run
        self.most_duplicates = 0  # most identical copies beyond the first in dup_t at an oracle check

    def replay_hint(self) -> str:
        return (
            f"PGCDC_SEED={self.seed} PGCDC_OPS={self.ops} PGCDC_TEST_VERSIONS={self.pg.major} "
            f".venv/bin/pytest tests/test_randomized.py"
        )

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
            + "\n".join(f"-- #{i}\n{step.render()};" for i, step in enumerate(steps))
            + "\n"
        )
        self.pg.execute(DDL)
        snapshot_tables(
            self.config, lake_destination(self.spark, self.config)
        )  # creates the slot; `late` is not published yet
        assert_deletion_vectors(
            self.config, {**{name: True for name in DELETION_VECTORS}, **{name: False for name in COPY_ON_WRITE}}
        )
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
            snapshot_tables(self.config, lake_destination(self.spark, self.config), [TableName("public", step.table)])
        elif step.kind == "run":
            self.run_log = []
            started = time.monotonic()
            result = run_incremental(
                self.config,
                lake_destination(self.spark, self.config),
                log=self.run_log.append,
                max_chunk_changes=step.chunk,
            )
            self.runs += 1
            self.run_times.append(f"{result.changes}@{step.chunk}:{time.monotonic() - started:.1f}s")
            assert result.confirmed_flush_lsn >= result.end_lsn, (result.confirmed_flush_lsn, result.end_lsn)
            self.resnapshot_ambiguous(result.quarantined.values())
            for name, (key, lingering) in step.checks.items():
                self.oracle(name, key, lingering)
            unsnapshotted = set(result.tables_without_snapshot)
            checked = {f"public.{name}" for name in step.checks}
            assert unsnapshotted == set(result.tables) - checked, (
                unsnapshotted,
                sorted(result.tables),
                sorted(checked),
            )
        else:  # pragma: no cover
            raise ValueError(step.kind)

    def resnapshot_ambiguous(self, quarantines: Iterable[Quarantine]) -> None:
        """Re-snapshot, as its fix says, a table a drain set aside because a column was added and another
        dropped between two drains so that no one can tell a rename (the workload's random DDL makes that
        now and then): the oracle then holds the table to PostgreSQL after the re-snapshot. Any other
        quarantine is a finding and fails the replay."""
        for quarantine in quarantines:
            assert quarantine.fault == "schema" and "cannot be told" in quarantine.cause, quarantine.describe()
            self.run_log.append(f"(replay) re-snapshot of {quarantine.table}, as its fix says")
            snapshot_tables(self.config, lake_destination(self.spark, self.config), [TableName.parse(quarantine.table)])
            self.resnapshots += 1

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
            pg_columns = [
                c
                for (c,) in conn.execute(
                    "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped"
                    " ORDER BY attnum",
                    (f"public.{name}",),
                ).fetchall()
            ]
            missing = [c for c in pg_columns if c not in delta_columns]
            target = f"public.{name}"
            if missing:
                for column in missing:
                    ((written,),) = conn.execute(
                        f'SELECT count(*) FROM public.{name} WHERE "{column}" IS NOT NULL'
                    ).fetchall()
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
                ((copies,),) = conn.execute("SELECT count(*) - count(DISTINCT d.*) FROM public.dup_t d").fetchall()
                self.most_duplicates = max(self.most_duplicates, copies)
        self.oracle_checks += 1
