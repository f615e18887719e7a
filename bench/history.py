"""What history costs a drain: the same backlog drained with ``history: none`` and with ``changelog``,
and 200 random updates drained with ``none`` and with ``scd2`` on a large table.

Run ``python -m bench.history [--major 18] [--inserts N] [--updates N] [--deletes N] [--chunk N]``.
It starts a throwaway PostgreSQL with the table of ``bench/cdc.py``, snapshots it into four lakes
(each with its own slot, so every drain reads the same backlog: plain, changelog, changelog,
plain), builds the backlog once, then drains the four in that order, each with a fresh embedded
engine (the order evens out a warming cache). It prints each drain's time and the ratio of the
changelog drains to the plain ones, and checks each changelog folded whole against its table.

Run ``python -m bench.history --scd2-rows 10000000 [--rounds 3]`` for SCD type 2 instead: one table
of that many rows (``bench/scale_big.py``'s, pgcdc's default layout and deletion vectors) snapshotted
into two lakes, ``none`` and ``scd2``, each with its own slot; an untimed warm-up drain of 200
random updates (it seeds the SCD type 2 table), then per round 200 updates of uniformly random keys,
drained into both lakes (which goes first alternates), each drain timed; prints the medians and their
ratio, then checks the current versions against the table. ``--profile`` also prints, per mode, the
engine calls of the timed drains (``bench/engine_calls.py``).
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import psycopg

from bench.cdc import BASE_ROWS, build_backlog, DDL, PUBLICATION, ROWS
from bench.engine_calls import engine_calls, EngineCall, summary
from bench.scale_big import BUCKETED, load, random_changes, RANDOM_UPDATES, table_name
from resources.config import parse_config, PgcdcConfig
from resources.delta.reads import read_rows
from resources.delta.spark_destination import lake_destination
from resources.engines.engine import SparkEngine
from resources.history.as_of import read_as_of
from resources.postgres.catalog import TableName
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.local_postgres import start_local_postgres


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--major", type=int, default=18)
    parser.add_argument("--inserts", type=int, default=100_000)
    parser.add_argument("--updates", type=int, default=50_000)
    parser.add_argument("--deletes", type=int, default=10_000)
    parser.add_argument("--per-txn", type=int, default=1_000)
    parser.add_argument("--chunk", type=int, default=200_000)
    parser.add_argument("--scd2-rows", type=int, default=0, help="measure scd2 on a table of this many rows instead")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--profile", action="store_true", help="with --scd2-rows: time each engine call of the timed drains, per mode"
    )
    args = parser.parse_args()
    if args.scd2_rows:
        scd2_cost(args.major, args.scd2_rows, args.rounds, args.profile)
        return
    work = Path(tempfile.mkdtemp(prefix="pgcdc-bench-history-"))
    server = start_local_postgres(args.major, base_dir=work / "pg")
    try:
        dsn = server.dsn()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(DDL)
            conn.execute(f"INSERT INTO orders {ROWS}", (1, BASE_ROWS))
            conn.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE orders")
        runs = [("plain_1", "none"), ("changelog_1", "changelog"), ("changelog_2", "changelog"), ("plain_2", "none")]
        configs = {
            name: parse_config(
                {
                    "postgres": {"dsn": dsn},
                    "publication": PUBLICATION,
                    "slot": f"bench_{name}",
                    "delta": {"root": str(work / name)},
                    "history": {"default": mode},
                }
            )  # fmt: skip
            for name, mode in runs
        }
        for config in configs.values():
            with SparkEngine.embedded() as engine:
                snapshot_tables(config, lake_destination(engine.spark, config))
        changes = build_backlog(dsn, args.inserts, args.updates, args.deletes, args.per_txn)
        print(f"backlog: {changes:,} changes on a table of {BASE_ROWS:,} rows")
        times = {}
        for name, _ in runs:
            times[name] = drain(configs[name], args.chunk)
            print(f"{name}: {times[name]:.2f} s, {changes / times[name]:,.0f} changes/s")
        plain = times["plain_1"] + times["plain_2"]
        with_changelog = times["changelog_1"] + times["changelog_2"]
        print(f"changelog / none: {with_changelog / plain:.2f}")
        for name in ("changelog_1", "changelog_2"):
            check(configs[name])
    finally:
        server.destroy()
        shutil.rmtree(work, ignore_errors=True)


def drain(config: PgcdcConfig, chunk: int) -> float:
    with SparkEngine.embedded() as engine:  # a fresh engine, as a Dagster run gets
        return run_incremental(config, lake_destination(engine.spark, config), max_chunk_changes=chunk).duration_s


def check(config: PgcdcConfig) -> None:
    """The changelog folded whole equals the table (same rows, by a sorted comparison of ids and amounts)."""
    with SparkEngine.embedded() as engine:
        folded = read_as_of(engine.spark, config, TableName("public", "orders"))
        table = read_rows(engine.spark, config.table_path("public", "orders"), None)
    pairs = sorted(zip(folded.column("id").to_pylist(), folded.column("amount").to_pylist()))
    assert pairs == sorted(zip(table.column("id").to_pylist(), table.column("amount").to_pylist()))
    print(f"check: the changelog folded whole equals the table ({len(pairs):,} rows)")


def scd2_cost(major: int, rows: int, rounds: int, profile: bool = False) -> None:
    """200 random updates drained with ``history: none`` and ``scd2``, same table, same run (module docstring)."""
    table = (rows, BUCKETED)
    name = table_name(table)
    work = Path(tempfile.mkdtemp(prefix="pgcdc-bench-scd2-"))
    server = start_local_postgres(major, base_dir=work / "pg")
    try:
        dsn = server.dsn()
        started = time.perf_counter()
        load(dsn, table)
        print(f"loaded {rows:,} rows in {time.perf_counter() - started:.0f} s")
        configs = {
            mode: parse_config(
                {
                    "postgres": {"dsn": dsn},
                    "publication": f"pub_{name}",
                    "slot": f"bench_{mode}",
                    "tables": [f"public.{name}"],
                    "delta": {"root": str(work / mode)},
                    "history": {"default": mode},
                }
            )  # fmt: skip
            for mode in ("none", "scd2")
        }
        rng = random.Random(24)
        with SparkEngine.embedded() as engine:
            for mode, config in configs.items():
                started = time.perf_counter()
                snapshot_tables(config, lake_destination(engine.spark, config))
                print(f"snapshot ({mode}): {time.perf_counter() - started:.0f} s")
            times: dict[str, list[float]] = {"none": [], "scd2": []}
            calls: dict[str, list[EngineCall]] = {"none": [], "scd2": []}
            for round_number in range(rounds + 1):
                random_changes(dsn, table, rng.sample(range(1, rows + 1), RANDOM_UPDATES))
                order = ["none", "scd2"] if round_number % 2 else ["scd2", "none"]
                for mode in order:
                    with engine_calls() if profile and round_number else nullcontext([]) as drain_calls:
                        started = time.perf_counter()
                        run_incremental(configs[mode], lake_destination(engine.spark, configs[mode]))
                        elapsed = time.perf_counter() - started
                    calls[mode] += drain_calls
                    if round_number:  # round 0 warms up, and seeds the SCD type 2 table
                        times[mode].append(elapsed)
                    print(f"round {round_number} {mode}: {elapsed:.2f} s")
            plain, versions = statistics.median(times["none"]), statistics.median(times["scd2"])
            print(
                f"{RANDOM_UPDATES} random updates into {rows:,} rows: none {plain:.2f} s, scd2 {versions:.2f} s (medians "
                f"of {rounds}); scd2 / none: {versions / plain:.2f}"
            )
            for mode in calls if profile else ():
                print(f"engine calls of the {rounds} timed drains, history: {mode}\n{summary(calls[mode])}")
            config = configs["scd2"]
            history = config.history_path("public", name)
            ((current, total),) = engine.spark.sql(
                f"SELECT count_if(_pgcdc_is_current), count(_pgcdc_valid_from_lsn) FROM delta.`{history}`"
            ).collect()
            with psycopg.connect(dsn, autocommit=True) as conn:
                ((count,),) = conn.execute(f"SELECT count(*) FROM {name}").fetchall()
            assert current == count and total == count + RANDOM_UPDATES * (rounds + 1), (current, total, count)
            print(f"check: {current:,} current versions (the table's rows), {total:,} versions")
    finally:
        server.destroy()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
