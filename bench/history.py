"""What a changelog costs a drain: the same backlog drained with ``history: none`` and with ``changelog``.

Run ``python -m bench.history [--major 18] [--inserts N] [--updates N] [--deletes N] [--chunk N]``.
It starts a throwaway PostgreSQL with the table of ``bench/cdc.py``, snapshots it into four lakes
(each with its own slot, so every drain reads the same backlog: plain, changelog, changelog,
plain), builds the backlog once, then drains the four in that order, each with a fresh embedded
engine (the order evens out a warming cache). It prints each drain's time and the ratio of the
changelog drains to the plain ones, and checks each changelog folded whole against its table.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import psycopg

from bench.cdc import BASE_ROWS, build_backlog, DDL, PUBLICATION, ROWS
from resources.config import parse_config, PgcdcConfig
from resources.delta.engine import SparkEngine
from resources.delta.reads import read_rows
from resources.history import read_as_of
from resources.runs.incremental import run_incremental
from resources.postgres.catalog import TableName
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
    args = parser.parse_args()
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
            name: parse_config({
                "postgres": {"dsn": dsn}, "publication": PUBLICATION, "slot": f"bench_{name}",
                "delta": {"root": str(work / name)}, "history": {"default": mode},
            })  # fmt: skip
            for name, mode in runs
        }
        for config in configs.values():
            with SparkEngine.embedded() as engine:
                snapshot_tables(config, engine.spark)
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
        return run_incremental(config, engine.spark, max_chunk_changes=chunk).duration_s


def check(config: PgcdcConfig) -> None:
    """The changelog folded whole equals the table (same rows, by a sorted comparison of ids and amounts)."""
    with SparkEngine.embedded() as engine:
        folded = read_as_of(engine.spark, config, TableName("public", "orders"))
        table = read_rows(engine.spark, config.table_path("public", "orders"), None)
    pairs = sorted(zip(folded.column("id").to_pylist(), folded.column("amount").to_pylist()))
    assert pairs == sorted(zip(table.column("id").to_pylist(), table.column("amount").to_pylist()))
    print(f"check: the changelog folded whole equals the table ({len(pairs):,} rows)")


if __name__ == "__main__":
    main()
