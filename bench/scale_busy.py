"""``python -m bench.scale busy``: a busy drain, N tables with M changes each, against one changed table.

A drain's engine work follows the tables it changes: on Delta on Spark each table's commit is mostly
fixed cost (2.1 s per changed table measured with its writes one after another, docs/engine-notes.md),
which committing the tables of a chunk side by side (``spark.write_concurrency``) overlaps. For each
engine (``--engines``: ``sail``, embedded in each run; ``spark``, the managed engine with its JVM kept
between runs, ``spark.keep_alive_s``) a database of its own holds ``--tables`` keyed tables of 10 rows,
one publication and one slot, snapshotted into a lake of its own. Then, for each write concurrency
(``--writes``), through the code location's own ``pgcdc_incremental`` job (what the schedule launches,
``execute_in_process`` on a SQLite Dagster instance, wall time of the run), after one warm-up drain:

* **one table**: ``--changes`` rows of one table updated (one transaction), then a drain;
* **busy**: ``--changes`` rows of every table updated (a transaction per table), then a drain.

Each ``--repeat`` times, median reported: the busy drain per changed table, and as a ratio against the
one-table drain of the same engine and concurrency, and against concurrency 1 of the same engine; with
Sail measured, every Spark figure also as a ratio against Sail's same drain. ``--spark-variants``
measures the managed engine in several variants, each with a database, lake and JVM of its own
(``bench/spark_variants.py``: pgcdc as built, and each of its small-table choices undone). Each
Dagster run asserts what it materialized; Delta is checked against PostgreSQL at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import yaml
from dagster import AssetKey, DagsterInstance

from bench.lakes import bench_lake, lake_storage
from bench.scale_idle import create_tables
from bench.spark_variants import variant_config, variant_set_up
from pgcdc_assets.builder import build_definitions
from resources.config import parse_config, PgcdcConfig
from resources.delta.spark_destination import lake_destination
from resources.engines.engine import SparkEngine
from resources.engines.kept_spark import SERVERS_DIR_ENV, stop_all
from resources.engines.s3a import s3a_settings
from resources.runs.snapshot import snapshot_tables
from resources.testing.dagster_instance import sqlite_instance
from resources.testing.local_postgres import LocalPostgres, start_local_postgres
from resources.testing.verify import assert_delta_equals_postgres

KEEP_ALIVE_S = 600
SLOT_ASSET = AssetKey(["pgcdc", "slot"])


def update_rows(dsn: str, tables: list[int], changes: int, value: int) -> None:
    """``changes`` rows of each table in ``tables`` (ids 1.. cycling over its 10 rows), a transaction per table."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in tables:
            with conn.transaction():
                for change in range(changes):
                    conn.execute(f"UPDATE t{table} SET n = %s WHERE id = %s", (value * 1000 + change, change % 10 + 1))


def engine_settings(engine: str, writes: int, extra: dict[str, str] | None = None) -> dict[str, object]:
    """The ``spark`` section a user would write for ``engine``, with ``writes`` tables committed at once
    (``extra``: settings of the managed engine's variant)."""
    if engine == "sail":
        return {"engine": "sail", "write_concurrency": writes}
    return {"engine": "spark", "keep_alive_s": KEEP_ALIVE_S, "write_concurrency": writes, "config": extra or {}}


@contextmanager
def snapshot_engine(engine: str, root: str, storage: dict, extra: dict[str, str]) -> Iterator[SparkEngine]:
    """The engine the set-up snapshots with: embedded Sail, or the managed Spark engine kept for the runs."""
    lake = lake_storage(root, storage)
    if engine == "sail":
        with SparkEngine.embedded(storage_environment=lake.engine_environment()) as sail:
            yield sail
        return
    spark = SparkEngine.managed_spark(
        {**s3a_settings(lake), **extra}, storage_environment=lake.engine_environment(), keep_alive_s=KEEP_ALIVE_S
    )
    with spark:
        yield spark


def set_up(
    server: LocalPostgres, run: str, count: int, root: str, storage: dict, extra: dict[str, str], variant: str
) -> PgcdcConfig:
    """The run's database (``count`` tables), publication, slot and snapshotted lake (``run``: the engine,
    or ``spark_<variant>``, whose settings ``extra`` are and whose set-up ``variant`` makes)."""
    engine = run.split("_", 1)[0]
    name = "busy_" + run.replace("-", "_")
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    dsn = server.dsn(name)
    create_tables(dsn, count)
    settings = {
        "postgres": {"dsn": dsn}, "publication": "pub", "slot": name,
        "delta": {"root": f"{root.rstrip('/')}/{name}", "storage": storage},
        "snapshot": {"parallel_tables": 4}, "spark": engine_settings(engine, 1, extra),
    }  # fmt: skip
    config = parse_config(settings)
    began = time.monotonic()
    with snapshot_engine(engine, root, storage, extra) as snapshotting, variant_set_up(variant):
        snapshot_tables(config, lake_destination(snapshotting.spark, config))
    print(f"set-up: {run}: {count} tables snapshotted in {time.monotonic() - began:.1f} s", flush=True)
    return config


def measure(
    config: PgcdcConfig, run_name: str, writes: int, args: argparse.Namespace, instance: DagsterInstance, work: Path
) -> tuple[float, float]:
    """Median one-table and busy drain times (s) through the incremental job, ``writes`` tables at once."""
    settings = config.model_dump()
    settings["spark"] = {**settings["spark"], "write_concurrency": writes}
    config_file = work / f"pgcdc_{run_name}_{writes}.yaml"
    config_file.write_text(yaml.safe_dump(settings), encoding="utf-8")
    job = build_definitions(config_file).resolve_job_def("pgcdc_incremental")
    everything = list(range(args.tables))

    def run(tables: list[int], value: int) -> float:
        update_rows(config.postgres.dsn, tables, args.changes, value)
        began = time.monotonic()
        result = job.execute_in_process(instance=instance)
        elapsed = time.monotonic() - began
        assert result.success
        materialized = {event.asset_key for event in result.get_asset_materialization_events()}
        assert materialized == {SLOT_ASSET} | {AssetKey(["pgcdc", "public", f"t{t}"]) for t in tables}, materialized
        return elapsed

    run(everything, writes * 100)  # warm-up, not measured: the definitions' first run, every table's first MERGE
    one = [run([0], writes * 100 + 1 + round_) for round_ in range(args.repeat)]
    busy = [run(everything, writes * 100 + 50 + round_) for round_ in range(args.repeat)]
    return statistics.median(one), statistics.median(busy)


def report(figures: dict[tuple[str, int], tuple[float, float]], args: argparse.Namespace) -> None:
    print(
        f"\n{args.tables} tables x {args.changes} changes each (busy) against {args.changes} changes in one table; "
        f"median of {args.repeat} runs of the incremental job (wall time of execute_in_process, SQLite instance); "
        f"load average now {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'engine':<22} {'writes':>6} {'one s':>8} {'busy s':>8} {'per table':>10} {'vs one':>8} {'vs writes 1':>12}"
        f" {'one/sail':>9} {'busy/sail':>10}"
    )
    for (run, writes), (one, busy) in figures.items():
        serial = figures.get((run, 1), (one, busy))[1]
        sail = figures.get(("sail", writes))
        against = f" {one / sail[0]:>8.2f}x {busy / sail[1]:>9.2f}x" if sail else ""
        print(
            f"{run:<22} {writes:>6} {one:>8.2f} {busy:>8.2f} {busy / args.tables:>9.3f}s {busy / one:>7.2f}x "
            f"{busy / serial:>11.2f}x{against}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale busy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", type=int, default=50, help="tables changed in a busy drain")
    parser.add_argument("--changes", type=int, default=10, help="changes per changed table")
    parser.add_argument("--engines", default="sail,spark", help="sail and/or spark, comma-separated")
    parser.add_argument("--writes", default="1,2,4", help="spark.write_concurrency values, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="drains per measurement (median reported)")
    parser.add_argument("--major", type=int, default=18, help="PostgreSQL major version (15 or 18)")
    parser.add_argument("--lake", default=None, help="directory, s3://bucket/prefix, or 's3' (default: a temp dir)")
    parser.add_argument(
        "--spark-variants",
        default="pgcdc",
        help="the managed engine's variants (bench/spark_variants.py), comma-separated",
    )
    args = parser.parse_args(argv)
    engines = args.engines.split(",")
    if not set(engines) <= {"sail", "spark"}:
        raise SystemExit("--engines: sail and/or spark")
    variants = args.spark_variants.split(",")
    runs = [
        (run, variant)
        for engine in engines
        for run, variant in (
            [("sail", "")] if engine == "sail" else [(f"spark_{v}" if v != "pgcdc" else "spark", v) for v in variants]
        )
    ]
    work = Path(tempfile.mkdtemp(prefix="pgcdc-bench-scale-busy-"))
    os.environ[SERVERS_DIR_ENV] = str(work / "spark-servers")  # the kept JVM's state, stopped at the end
    server = start_local_postgres(args.major, {"max_wal_size": "1GB"}, base_dir=work / "pg")
    figures: dict[tuple[str, int], tuple[float, float]] = {}
    try:
        with bench_lake(args.lake, work) as (root, storage), sqlite_instance(work / "dagster") as instance:
            for run, variant in runs:
                extra = variant_config(variant, work) if variant else {}
                config = set_up(server, run, args.tables, root, storage, extra, variant)
                for writes in (int(value) for value in args.writes.split(",")):
                    figures[run, writes] = measure(config, run, writes, args, instance, work)
                    print(f"  {run}, {writes} at once: measured", flush=True)
                for table in (0, args.tables - 1):
                    assert_delta_equals_postgres(
                        config.postgres.dsn, f"public.t{table}", config.table_path("public", f"t{table}"), key=("id",)
                    )
                stop_all()  # the variant's kept JVM: one at a time
        report(figures, args)
        return 0
    finally:
        stop_all()
        server.destroy()
        shutil.rmtree(work, ignore_errors=True)
