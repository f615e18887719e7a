"""``python -m bench.scale idle``: a drain's fixed cost per table (issue 13, point 5a).

For each table count (default 1, 100 and 500) a database of its own holds that many small
keyed tables (10 rows each), one publication and one slot; all of them are snapshotted into a
lake of their own first (``snapshot_tables``, the real snapshot path, so the pgcdc state table
is what a snapshot leaves). Then, one count at a time, after one warm-up drain:

* **idle**: ``run_incremental`` with nothing to apply (the WAL the other counts' set-up wrote is
  behind the warm-up);
* **1-change**: one row of one table updated, then ``run_incremental``; Delta is checked
  against PostgreSQL for that table afterwards.

Each is repeated ``--repeat`` times (after a warm-up drain of each kind, not measured); the median of ``IncrementalResult.duration_s`` (the whole
run: preflight, state read, drain, state write, confirm) is reported, as the ratio against the
1-table count measured in the same run. Goal (issue 13): an idle drain over 500 tables within
3x an idle drain over 1 table. All runs share one engine (a Dagster run starts its own, a
constant that does not depend on the table count).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import psycopg

from bench.lakes import add_arguments, bench_lake, open_engine
from resources.config import PgcdcConfig, parse_config
from resources.incremental import run_incremental
from resources.snapshot import snapshot_tables
from resources.testing.local_postgres import start_local_postgres
from resources.testing.verify import assert_delta_equals_postgres

GOAL_IDLE_RATIO = 3.0


def create_tables(dsn: str, count: int) -> None:
    """``count`` tables of 10 rows and a publication of them, in one transaction."""
    statements = [
        f"CREATE TABLE t{i} (id int PRIMARY KEY, n int); INSERT INTO t{i} SELECT g, 0 FROM generate_series(1, 10) g;"
        for i in range(count)
    ]
    with psycopg.connect(dsn) as conn:
        conn.execute("".join(statements))
        conn.execute(f"CREATE PUBLICATION pub FOR TABLE {', '.join(f't{i}' for i in range(count))}")


def measure(config: PgcdcConfig, spark: object, count: int, repeat: int) -> tuple[list[float], list[float]]:
    """Idle and 1-change run times (s) over ``count`` tables; the changed table is exact after each."""
    table = f"t{count // 2}"
    # Warm-up, not measured: drains the WAL written since the slot was created, and makes the
    # session's first MERGE (slower than any later one) on this count's lake.
    run_incremental(config, spark)
    with psycopg.connect(config.postgres.dsn, autocommit=True) as conn:
        conn.execute(f"UPDATE {table} SET n = -1 WHERE id = 2")
    run_incremental(config, spark)
    idle = [run_incremental(config, spark).duration_s for _ in range(repeat)]
    changed: list[float] = []
    for round_ in range(repeat):
        with psycopg.connect(config.postgres.dsn, autocommit=True) as conn:
            conn.execute(f"UPDATE {table} SET n = %s WHERE id = 1", (round_ + 1,))
        result = run_incremental(config, spark)
        assert result.tables[f"public.{table}"].updated == 1, result.tables[f"public.{table}"]
        changed.append(result.duration_s)
    assert_delta_equals_postgres(config.postgres.dsn, f"public.{table}", config.table_path("public", table), key=("id",))
    return idle, changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale idle", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", default="1,100,500", help="table counts, comma-separated; the first is the baseline")
    parser.add_argument("--repeat", type=int, default=5, help="drains per measurement (median reported)")
    parser.add_argument("--major", type=int, default=18, help="PostgreSQL major version (15 or 18)")
    parser.add_argument("--parallel", type=int, default=4, help="snapshot.parallel_tables for the set-up")
    add_arguments(parser)
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.tables.split(",")]
    work = Path(tempfile.mkdtemp(prefix="pgcdc-bench-scale-idle-"))
    server = start_local_postgres(args.major, {"max_wal_size": "1GB"}, base_dir=work / "pg")
    try:
        with bench_lake(args.lake, work) as (root, storage):
            configs: dict[int, PgcdcConfig] = {}
            with open_engine(args.engine, root, storage) as engine:
                for count in counts:
                    with psycopg.connect(server.dsn(), autocommit=True) as admin:
                        admin.execute(f"CREATE DATABASE tables_{count}")
                    dsn = server.dsn(f"tables_{count}")
                    create_tables(dsn, count)
                    configs[count] = parse_config({
                        "postgres": {"dsn": dsn}, "publication": "pub", "slot": f"scale_{count}",
                        "delta": {"root": f"{root.rstrip('/')}/tables_{count}", "storage": storage},
                        "snapshot": {"parallel_tables": args.parallel},
                    })
                    began = time.monotonic()
                    snapshot_tables(configs[count], engine.spark)
                    print(f"set-up: {count} tables snapshotted in {time.monotonic() - began:.1f} s", flush=True)
                figures = {count: measure(configs[count], engine.spark, count, args.repeat) for count in counts}
        base_idle, base_change = (statistics.median(values) for values in figures[counts[0]])
        print(f"\nPostgreSQL {args.major}, engine {args.engine}, lake {args.lake or 'local directory'}; "
              f"median of {args.repeat} drains each (run time of run_incremental)")
        print(f"{'tables':>7} {'idle s':>8} {'ratio':>7} {'1-change s':>11} {'ratio':>7}")
        for count in counts:
            idle, change = (statistics.median(values) for values in figures[count])
            print(f"{count:>7} {idle:>8.3f} {idle / base_idle:>6.2f}x {change:>11.3f} {change / base_change:>6.2f}x")
        largest = max(counts)
        ratio = statistics.median(figures[largest][0]) / base_idle
        verdict = "met" if ratio <= GOAL_IDLE_RATIO else "NOT met"
        print(f"goal: idle drain over {largest} tables within {GOAL_IDLE_RATIO:.0f}x of {counts[0]} table(s): "
              f"{ratio:.2f}x, {verdict}")
        return 0
    finally:
        server.destroy()
        shutil.rmtree(work, ignore_errors=True)
