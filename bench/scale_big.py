"""bench.scale part (b): a drain costs what its changes cost, not what the table costs.

Run ``python -m bench.scale big`` or ``python -m bench.scale_big [--sizes 100000,1000000,10000000]
[--rounds 3] [--major 18] [--target-rows N] [--unbucketed]``. It starts a throwaway PostgreSQL and one embedded engine,
loads one table per size (``id bigint`` primary key, about 100 bytes a row), ANALYZEs them and
snapshots each into Delta with the layout its size gives it (``--unbucketed``: none, as pgcdc wrote
tables before layouts). Each table has its own publication and slot, so a drain reads only its
table's changes. Then, per table and round, two timed drains (after one untimed warm-up):

* newest: 100 updates of the 100 newest keys plus 100 inserts of new keys (a table whose recent
  rows are the busy ones);
* random: 200 updates of uniformly random keys.

It prints each drain's median wall time, its ratio to the smallest table's (the goal: the largest
within 1.5x for ``newest``), the buckets the table has and the files the last MERGE rewrote, then
checks Delta against PostgreSQL by row count and a checksum. Ratios are measured in one run on one
machine; figures from a busy machine vary from run to run.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import deltalake
import psycopg
import pyarrow.compute as pc

from resources.config import parse_config, PgcdcConfig
from resources.delta.engine import SparkEngine
from resources.delta.layout import DEFAULT_TARGET_ROWS
from resources.incremental import run_incremental
from resources.snapshot import snapshot_tables
from resources.testing.local_postgres import start_local_postgres

DEFAULT_SIZES = (100_000, 1_000_000, 10_000_000)
NEWEST_UPDATES = NEWEST_INSERTS = 100
RANDOM_UPDATES = 200
LOAD_BATCH = 1_000_000


def table_name(rows: int) -> str:
    return f"t{rows}"


def load(dsn: str, rows: int) -> None:
    name = table_name(rows)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {name} (id bigint PRIMARY KEY, customer int, status text, amount numeric(12,2), note text)"
        )
        for start in range(1, rows + 1, LOAD_BATCH):
            conn.execute(
                f"INSERT INTO {name} SELECT g, g %% 10000, 'new', (g %% 100000) / 100.0, 'order ' || g"
                " FROM generate_series(%s::bigint, %s::bigint) g",
                (start, min(rows, start + LOAD_BATCH - 1)),
            )
        conn.execute(f"ANALYZE {name}")
        conn.execute(f"CREATE PUBLICATION pub_{name} FOR TABLE {name}")


def config_for(dsn: str, rows: int, root: Path, unbucketed: bool, target_rows: int) -> PgcdcConfig:
    name = table_name(rows)
    tables = {f"public.{name}": {"bucketed": False}} if unbucketed else {}
    return parse_config({
        "postgres": {"dsn": dsn}, "publication": f"pub_{name}", "slot": f"slot_{name}", "tables": [f"public.{name}"],
        "delta": {"root": str(root), "buckets": {"target_rows": target_rows, "tables": tables}},
    })


def newest_changes(dsn: str, rows: int, round_number: int) -> None:
    """100 updates of the newest keys and 100 inserts after them (the table grows by 100 a round)."""
    name = table_name(rows)
    top = rows + round_number * NEWEST_INSERTS
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"UPDATE {name} SET status = 'paid', amount = amount + 1 WHERE id > %s", (top - NEWEST_UPDATES,))
        conn.execute(
            f"INSERT INTO {name} SELECT g, g %% 10000, 'new', 1, 'late ' || g FROM generate_series(%s::bigint, %s::bigint) g",
            (top + 1, top + NEWEST_INSERTS),
        )


def random_changes(dsn: str, rows: int, rng: random.Random) -> None:
    keys = rng.sample(range(1, rows + 1), RANDOM_UPDATES)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"UPDATE {table_name(rows)} SET amount = amount + 1 WHERE id = ANY(%s)", (keys,))


def timed_drain(config: PgcdcConfig, engine: SparkEngine) -> float:
    started = time.perf_counter()
    run_incremental(config, engine.spark)
    return time.perf_counter() - started


def merge_files(path: str) -> tuple[int, int, int]:
    """(data files, partitions, files the newest MERGE removed) of the Delta table."""
    table = deltalake.DeltaTable(path)
    files = table.file_uris()
    partitions = len({uri.rsplit("/", 1)[0] for uri in files})
    removed = next(
        (int(commit["operationMetrics"].get("numTargetFilesRemoved", 0)) for commit in table.history() if commit["operation"] == "MERGE"),
        0,
    )
    return len(files), partitions, removed


def check(dsn: str, rows: int, config: PgcdcConfig) -> None:
    name = table_name(rows)
    delta = deltalake.DeltaTable(config.table_path("public", name)).to_pyarrow_table(columns=["id", "amount"])
    with psycopg.connect(dsn, autocommit=True) as conn:
        (count, amount), = conn.execute(f"SELECT count(*), sum(amount) FROM {name}").fetchall()
    assert (delta.num_rows, pc.sum(delta.column("amount")).as_py()) == (count, amount), (name, delta.num_rows, count)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale big", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="table sizes in rows, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="timed drains per table and kind")
    parser.add_argument("--major", type=int, default=18)
    parser.add_argument("--target-rows", type=int, default=DEFAULT_TARGET_ROWS, help="delta.buckets.target_rows")
    parser.add_argument("--unbucketed", action="store_true", help="snapshot without buckets (the layout before pgcdc chose one)")
    args = parser.parse_args(argv)
    sizes = sorted(int(size) for size in args.sizes.split(","))
    work = Path(tempfile.mkdtemp(prefix="pgcdc-bench-big-"))
    server = start_local_postgres(args.major, base_dir=work / "pg")
    rng = random.Random(13)
    try:
        dsn = server.dsn()
        for rows in sizes:
            started = time.perf_counter()
            load(dsn, rows)
            print(f"loaded {rows:,} rows in {time.perf_counter() - started:.1f}s", flush=True)
        configs = {rows: config_for(dsn, rows, work / "lake", args.unbucketed, args.target_rows) for rows in sizes}
        results: dict[int, dict[str, float]] = {}
        with SparkEngine.embedded() as engine:
            for rows in sizes:
                started = time.perf_counter()
                (snapshot,) = snapshot_tables(configs[rows], engine.spark)
                layout = snapshot.layout.describe() if snapshot.layout else "unbucketed"
                print(f"snapshot of {rows:,} rows: {time.perf_counter() - started:.1f}s ({layout})", flush=True)
            for rows in sizes:
                config = configs[rows]
                newest_changes(dsn, rows, 0)
                timed_drain(config, engine)  # warm-up
                newest = []
                for round_number in range(1, args.rounds + 1):
                    newest_changes(dsn, rows, round_number)
                    newest.append(timed_drain(config, engine))
                files, partitions, newest_removed = merge_files(config.table_path("public", table_name(rows)))
                uniform = []
                for _ in range(args.rounds):
                    random_changes(dsn, rows, rng)
                    uniform.append(timed_drain(config, engine))
                _, _, random_removed = merge_files(config.table_path("public", table_name(rows)))
                check(dsn, rows, config)
                results[rows] = {"newest": statistics.median(newest), "random": statistics.median(uniform)}
                print(
                    f"{rows:>11,} rows: newest {results[rows]['newest']:.2f}s (last MERGE rewrote {newest_removed} "
                    f"file(s)), random {results[rows]['random']:.2f}s (rewrote {random_removed}); "
                    f"{files} files in {partitions} partition(s)",
                    flush=True,
                )
        base = results[sizes[0]]
        print(f"\nratios against {sizes[0]:,} rows (one run; the machine may be shared, figures vary):")
        for rows in sizes:
            print(
                f"{rows:>11,} rows: newest {results[rows]['newest'] / base['newest']:.2f}x, "
                f"random {results[rows]['random'] / base['random']:.2f}x"
            )
        ratio = results[sizes[-1]]["newest"] / base["newest"]
        print(f"goal: newest at {sizes[-1]:,} rows within 1.5x of {sizes[0]:,}: {'met' if ratio <= 1.5 else 'NOT met'} ({ratio:.2f}x)")
    finally:
        server.destroy()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
