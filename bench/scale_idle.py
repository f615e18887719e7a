"""``python -m bench.scale idle``: a drain's fixed cost per table, alone and through Dagster.

For each table count (default 1, 100 and 500) a database of its own holds that many small
keyed tables (10 rows each), one publication and one slot; all of them are snapshotted into a
lake of their own first (``snapshot_tables``, the real snapshot path, so the pgcdc state table
is what a snapshot leaves). Then, one count at a time, after warm-up drains (not measured):

* **idle**: a drain with nothing to apply (the WAL the other counts' set-up wrote is behind the
  warm-up);
* **1-change**: one row of one table updated, then a drain; Delta is checked against PostgreSQL
  for that table afterwards.

Each is measured three ways, ``--repeat`` times each, median reported as the ratio against the
first (1-table) count in the same run:

* ``run_incremental``: its ``IncrementalResult.duration_s`` (preflight, state read, drain, state
  write, confirm);
* **through Dagster**, the code location's own ``pgcdc_incremental`` job (what the schedule
  launches), ``execute_in_process`` on a Dagster instance, wall time of the whole run (run
  creation, planned events, the step, its events): on a **SQLite** instance (a bare
  ``DAGSTER_HOME``) and on a **PostgreSQL**-backed one (the dagster.yaml of docs/deployment.md,
  on a database of the benchmark's server). Each Dagster run asserts what it materialized: the
  slot asset only, or the slot asset and the changed table.

All drains share one Sail server (``--engine sc://...``, or one started here): the Dagster runs
reach it in remote mode, so a run's engine start (a constant) is not in the figures.
Goal: an idle drain over 500 tables, and a drain changing 1 of 500, within 3x of one table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, ExitStack
from pathlib import Path

import psycopg
import yaml
from dagster import AssetKey, DagsterInstance

from bench.lakes import add_arguments, bench_lake, lake_storage
from pgcdc_assets.builder import build_definitions
from resources.config import parse_config, PgcdcConfig
from resources.delta.spark_destination import lake_destination
from resources.engines.engine import EMBEDDED_ENVIRONMENT, SparkEngine
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.dagster_instance import postgres_instance, sqlite_instance
from resources.testing.local_postgres import LocalPostgres, start_local_postgres
from resources.testing.verify import assert_delta_equals_postgres

GOAL_RATIO = 3.0
SLOT_ASSET = AssetKey(["pgcdc", "slot"])
#: One drain: a function taking the round's number, returning its time in seconds.
Drain = Callable[[int], float]


def create_tables(dsn: str, count: int) -> None:
    """``count`` tables of 10 rows and a publication of them, in one transaction."""
    statements = [
        f"CREATE TABLE t{i} (id int PRIMARY KEY, n int); INSERT INTO t{i} SELECT g, 0 FROM generate_series(1, 10) g;"
        for i in range(count)
    ]
    with psycopg.connect(dsn) as conn:
        conn.execute("".join(statements))
        conn.execute(f"CREATE PUBLICATION pub FOR TABLE {', '.join(f't{i}' for i in range(count))}")


def changed_table(count: int) -> str:
    return f"t{count // 2}"


def update_one_row(config: PgcdcConfig, count: int, value: int) -> None:
    with psycopg.connect(config.postgres.dsn, autocommit=True) as conn:
        conn.execute(f"UPDATE {changed_table(count)} SET n = %s WHERE id = 1", (value,))


def measure(
    config: PgcdcConfig, count: int, repeat: int, idle: Drain, change: Drain
) -> tuple[list[float], list[float]]:
    """Idle and 1-change drain times (s) over ``count`` tables, by ``idle``/``change``; Delta exact after."""
    # Warm-up, not measured: drains the WAL written since the slot was created (or since the
    # previous way of draining), and makes the session's first MERGE on this count's lake.
    update_one_row(config, count, -1)
    change(-1)
    idle(-1)
    idle_times = [idle(round_) for round_ in range(repeat)]
    change_times: list[float] = []
    for round_ in range(repeat):
        update_one_row(config, count, round_ + 1)
        change_times.append(change(round_))
    table = changed_table(count)
    assert_delta_equals_postgres(
        config.postgres.dsn, f"public.{table}", config.table_path("public", table), key=("id",)
    )
    return idle_times, change_times


def incremental_drains(config: PgcdcConfig, spark: object, count: int) -> tuple[Drain, Drain]:
    """``run_incremental`` alone: its own duration."""

    def idle(_: int) -> float:
        return run_incremental(config, lake_destination(spark, config)).duration_s

    def change(_: int) -> float:
        result = run_incremental(config, lake_destination(spark, config))
        assert result.tables[f"public.{changed_table(count)}"].updated == 1, result.tables
        return result.duration_s

    return idle, change


def dagster_drains(config_file: Path, instance: DagsterInstance, count: int) -> tuple[Drain, Drain]:
    """The code location's ``pgcdc_incremental`` job on ``instance``: wall time of the run."""
    job = build_definitions(config_file).resolve_job_def("pgcdc_incremental")
    table_key = AssetKey(["pgcdc", "public", changed_table(count)])

    def run(expected: set[AssetKey]) -> float:
        began = time.monotonic()
        result = job.execute_in_process(instance=instance)
        elapsed = time.monotonic() - began
        assert result.success
        materialized = {event.asset_key for event in result.get_asset_materialization_events()}
        assert materialized == expected, materialized
        return elapsed

    return (lambda _: run({SLOT_ASSET})), (lambda _: run({SLOT_ASSET, table_key}))


@contextmanager
def sail_url(environment: dict[str, str]) -> Iterator[str]:
    """A Sail server (``resources.engines.sail_server``) for every drain of the benchmark."""
    server = subprocess.Popen(
        [sys.executable, "-m", "resources.engines.sail_server"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**EMBEDDED_ENVIRONMENT, **os.environ, **environment},
    )
    assert server.stdin is not None and server.stdout is not None
    try:
        yield f"sc://127.0.0.1:{int(server.stdout.readline())}"
    finally:
        server.stdin.close()
        server.wait(timeout=60)


def set_up(
    server: LocalPostgres, count: int, root: str, storage: dict, url: str, parallel: int, work: Path
) -> tuple[PgcdcConfig, Path]:
    """One count's database, publication, slot and snapshotted lake; its configuration and configuration file."""
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE tables_{count}")
    dsn = server.dsn(f"tables_{count}")
    create_tables(dsn, count)
    settings = {
        "postgres": {"dsn": dsn}, "publication": "pub", "slot": f"scale_{count}",
        "delta": {"root": f"{root.rstrip('/')}/tables_{count}", "storage": storage},
        "snapshot": {"parallel_tables": parallel}, "spark": {"remote": url},
    }  # fmt: skip
    config_file = work / f"pgcdc_{count}.yaml"
    config_file.write_text(yaml.safe_dump(settings), encoding="utf-8")
    return parse_config(settings), config_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale idle", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tables", default="1,100,500", help="table counts, comma-separated; the first is the baseline"
    )
    parser.add_argument("--repeat", type=int, default=5, help="drains per measurement (median reported)")
    parser.add_argument("--major", type=int, default=18, help="PostgreSQL major version (15 or 18)")
    parser.add_argument("--parallel", type=int, default=4, help="snapshot.parallel_tables for the set-up")
    add_arguments(parser)
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.tables.split(",")]
    work = Path(tempfile.mkdtemp(prefix="pgcdc-bench-scale-idle-"))
    server = start_local_postgres(args.major, {"max_wal_size": "1GB"}, base_dir=work / "pg")
    ways = ["run_incremental", "Dagster, SQLite", "Dagster, PostgreSQL"]
    figures: dict[str, dict[int, tuple[list[float], list[float]]]] = {way: {} for way in ways}
    try:
        with bench_lake(args.lake, work) as (root, storage), ExitStack() as stack:
            url = args.engine if args.engine.startswith("sc://") else None
            if url is None:
                if args.engine != "sail":
                    raise SystemExit("--engine: sail or sc://host:port (the Dagster runs reach it in remote mode)")
                url = stack.enter_context(sail_url(lake_storage(root, storage).engine_environment()))
            engine = stack.enter_context(SparkEngine.remote(url))
            with psycopg.connect(server.dsn(), autocommit=True) as admin:
                admin.execute("CREATE DATABASE dagster_storage")
            instances = {
                "Dagster, SQLite": stack.enter_context(sqlite_instance(work / "dagster_sqlite")),
                "Dagster, PostgreSQL": stack.enter_context(
                    postgres_instance(work / "dagster_postgres", server, "dagster_storage")
                ),
            }
            for count in counts:
                config, config_file = set_up(server, count, root, storage, url, args.parallel, work)
                began = time.monotonic()
                snapshot_tables(config, lake_destination(engine.spark, config))
                print(f"set-up: {count} tables snapshotted in {time.monotonic() - began:.1f} s", flush=True)
                drains = {"run_incremental": incremental_drains(config, engine.spark, count)}
                for way, instance in instances.items():
                    began = time.monotonic()
                    drains[way] = dagster_drains(config_file, instance, count)
                    print(
                        f"  {way}: definitions of {count} tables built in {time.monotonic() - began:.1f} s", flush=True
                    )
                for way in ways:
                    figures[way][count] = measure(config, count, args.repeat, *drains[way])
                    print(f"  {way}: measured", flush=True)
        print(
            f"\nPostgreSQL {args.major}, engine {args.engine}, lake {args.lake or 'local directory'}; median of "
            f"{args.repeat} drains each (run_incremental: its duration; Dagster: wall time of execute_in_process)"
        )
        print(f"{'way':<20} {'tables':>7} {'idle s':>8} {'ratio':>7} {'1-change s':>11} {'ratio':>7}")
        verdicts = []
        for way in ways:
            base_idle, base_change = (statistics.median(values) for values in figures[way][counts[0]])
            for count in counts:
                idle, change = (statistics.median(values) for values in figures[way][count])
                print(
                    f"{way:<20} {count:>7} {idle:>8.3f} {idle / base_idle:>6.2f}x {change:>11.3f} "
                    f"{change / base_change:>6.2f}x"
                )
            largest = max(counts)
            for kind, base, values in (("idle", base_idle, figures[way][largest][0]),
                                       ("1-change", base_change, figures[way][largest][1])):  # fmt: skip
                ratio = statistics.median(values) / base
                verdicts.append(
                    f"{way}, {kind} over {largest} tables: {ratio:.2f}x ({'met' if ratio <= GOAL_RATIO else 'NOT met'})"
                )
        print(f"goal: within {GOAL_RATIO:.0f}x of {counts[0]} table(s)")
        for verdict in verdicts:
            print(f"  {verdict}")
        return 0
    finally:
        server.destroy()
        shutil.rmtree(work, ignore_errors=True)
