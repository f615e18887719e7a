"""bench.scale part (b): a drain costs what its changes cost, not what the table costs.

Run ``python -m bench.scale big`` or ``python -m bench.scale_big [--sizes 100000,1000000,10000000]
[--rounds 3] [--major 18] [--target-rows N] [--unbucketed | --both | --copy-on-write | --vs-copy-on-write |
--vs-update-merge | --vs-no-key-list] [--engine sail|spark|sc://host:port] [--spark-conf KEY=VALUE]``.
It starts a throwaway PostgreSQL and one engine (``--engine``, ``bench/lakes.py``: embedded Sail by
default, ``spark`` for the Apache Spark with Delta that pgcdc manages; ``--spark-conf`` adds settings to it),
loads one table per size (``id bigint`` primary key, about 100 bytes a row), ANALYZEs them and
snapshots each into Delta with the layout its size gives it and deletion vectors (pgcdc's defaults;
``--unbucketed``: no buckets, as pgcdc wrote tables before layouts; ``--copy-on-write``:
``delta.deletion_vectors: false``, as pgcdc wrote tables before deletion vectors; ``--both``: a
bucketed and an unbucketed table per size, ``--vs-copy-on-write``: a table with and one without
deletion vectors per size, ``--vs-update-merge``: two tables with pgcdc's defaults per size, the
second drained with the MERGE pgcdc ran before (an UPDATE of matched rows, no key list:
``resources/delta/merge.py``, ``merge_statement``), ``--vs-no-key-list``: the second drained with
pgcdc's MERGE without the key list in its ON clause (``KEY_LIST_MOST_VALUES``), drained in turn,
so the two compare in the same run). Each table has its own publication and slot, so a drain reads only its
table's changes. Then, per table and round, two timed drains (after an untimed warm-up drain of each):

* newest: 100 updates of the 100 newest keys plus 100 inserts of new keys (a table whose recent
  rows are the busy ones);
* random: 200 updates of uniformly random keys.

It prints each drain's median wall time and the median bytes of data files its commits added, its
ratio to the smallest table's (the goals: the largest within 1.5x for ``newest``, 2x for ``random``), the buckets the
table has and the files the last MERGE rewrote, then
checks Delta against PostgreSQL by row count and a checksum. Ratios are measured in one run on one
machine; figures from a busy machine vary from run to run.
"""

from __future__ import annotations

import argparse
import functools
import json
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

from bench.lakes import open_engine
from resources.config import DEFAULT_TARGET_ROWS, parse_config, PgcdcConfig
from resources.delta import merge
from resources.delta.reads import delta_rs_rows
from resources.delta.spark_destination import lake_destination
from resources.engines.engine import SparkEngine
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.local_postgres import start_local_postgres

DEFAULT_SIZES = (100_000, 1_000_000, 10_000_000)
NEWEST_UPDATES = NEWEST_INSERTS = 100
RANDOM_UPDATES = 200
LOAD_BATCH = 1_000_000


BUCKETED, UNBUCKETED, COPY_ON_WRITE, UPDATE_MERGE, NO_KEY_LIST = (
    "bucketed",
    "unbucketed",
    "copy-on-write",
    "update-merge",
    "no-key-list",
)

#: One benchmarked table: (rows, kind): BUCKETED (pgcdc's defaults), UNBUCKETED, COPY_ON_WRITE,
#: UPDATE_MERGE (pgcdc's defaults, drained with an UPDATE MERGE listing no keys) or NO_KEY_LIST
#: (pgcdc's defaults and MERGE, without the key list in its ON clause).
Table = tuple[int, str]


def table_name(table: Table) -> str:
    rows, kind = table
    return f"t{rows}" + ("" if kind == BUCKETED else "_" + kind.replace("-", "_"))


def describe(table: Table) -> str:
    return f"{table[0]:>11,} rows{'' if table[1] == BUCKETED else ' ' + table[1]}"


def load(dsn: str, table: Table) -> None:
    name, rows = table_name(table), table[0]
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


def config_for(dsn: str, table: Table, root: Path, target_rows: int) -> PgcdcConfig:
    name = table_name(table)
    tables = {f"public.{name}": {"bucketed": False}} if table[1] == UNBUCKETED else {}
    return parse_config(
        {
            "postgres": {"dsn": dsn},
            "publication": f"pub_{name}",
            "slot": f"slot_{name}",
            "tables": [f"public.{name}"],
            "delta": {
                "root": str(root),
                "buckets": {"target_rows": target_rows, "tables": tables},
                "deletion_vectors": table[1] != COPY_ON_WRITE,
            },
        }
    )


def newest_changes(dsn: str, table: Table, round_number: int) -> None:
    """100 updates of the newest keys and 100 inserts after them (the table grows by 100 a round)."""
    name, rows = table_name(table), table[0]
    top = rows + round_number * NEWEST_INSERTS
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"UPDATE {name} SET status = 'paid', amount = amount + 1 WHERE id > %s", (top - NEWEST_UPDATES,))
        conn.execute(
            f"INSERT INTO {name} SELECT g, g %% 10000, 'new', 1, 'late ' || g FROM generate_series(%s::bigint, %s::bigint) g",
            (top + 1, top + NEWEST_INSERTS),
        )


def random_changes(dsn: str, table: Table, keys: list[int]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"UPDATE {table_name(table)} SET amount = amount + 1 WHERE id = ANY(%s)", (keys,))


def timed_drain(
    config: PgcdcConfig, engine: SparkEngine, path: str, written: list[int] | None = None, kind: str = BUCKETED
) -> float:
    """The drain's wall time; appends the bytes of the data files its commits added to ``written``.
    For :data:`UPDATE_MERGE` the drain's MERGEs update matched rows and list no keys, for
    :data:`NO_KEY_LIST` they list no keys."""
    before = deltalake.DeltaTable(path).version()
    most_values, statement = merge.KEY_LIST_MOST_VALUES, merge.merge_statement
    if kind in (UPDATE_MERGE, NO_KEY_LIST):
        merge.KEY_LIST_MOST_VALUES = 0
    if kind == UPDATE_MERGE:
        merge.merge_statement = functools.partial(statement, delete_and_insert=False)
    try:
        started = time.perf_counter()
        run_incremental(config, lake_destination(engine.spark, config))
        elapsed = time.perf_counter() - started
    finally:
        merge.KEY_LIST_MOST_VALUES, merge.merge_statement = most_values, statement
    if written is not None:
        written.append(added_bytes(path, before))
    return elapsed


def added_bytes(path: str, after_version: int) -> int:
    """Bytes of the data files the table's commits after ``after_version`` added (a file given a
    deletion vector is added again: not written, not counted)."""
    total = 0
    for commit in (Path(path) / "_delta_log").glob("*.json"):
        if int(commit.name[:20]) > after_version:
            actions = [json.loads(line) for line in commit.read_text().splitlines() if line.strip()]
            removed = {action["remove"]["path"] for action in actions if "remove" in action}
            total += sum(
                action["add"]["size"] for action in actions if "add" in action and action["add"]["path"] not in removed
            )
    return total


def merge_files(path: str) -> tuple[int, int, int]:
    """(data files, partitions, files the newest MERGE removed) of the Delta table."""
    table = deltalake.DeltaTable(path)
    files = table.file_uris()
    partitions = len({uri.rsplit("/", 1)[0] for uri in files})
    removed = next(
        (
            int(commit["operationMetrics"].get("numTargetFilesRemoved", 0))
            for commit in table.history()
            if commit["operation"] == "MERGE"
        ),
        0,
    )
    return len(files), partitions, removed


def check(dsn: str, table: Table, config: PgcdcConfig) -> None:
    name = table_name(table)
    delta = delta_rs_rows(config.table_path("public", name), ["id", "amount"])
    with psycopg.connect(dsn, autocommit=True) as conn:
        ((count, amount),) = conn.execute(f"SELECT count(*), sum(amount) FROM {name}").fetchall()
    assert (delta.num_rows, pc.sum(delta.column("amount")).as_py()) == (count, amount), (name, delta.num_rows, count)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale big", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="table sizes in rows, comma-separated"
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed drains per table and kind")
    parser.add_argument("--major", type=int, default=18)
    parser.add_argument("--target-rows", type=int, default=DEFAULT_TARGET_ROWS, help="delta.buckets.target_rows")
    parser.add_argument(
        "--unbucketed", action="store_true", help="snapshot without buckets (the layout before pgcdc chose one)"
    )
    parser.add_argument("--both", action="store_true", help="a bucketed and an unbucketed table per size, same run")
    parser.add_argument("--copy-on-write", action="store_true", help="tables without deletion vectors")
    parser.add_argument(
        "--vs-copy-on-write", action="store_true", help="a table with and one without deletion vectors per size"
    )
    parser.add_argument(
        "--vs-update-merge",
        action="store_true",
        help="a table drained as now and one with pgcdc's earlier MERGE per size",
    )
    parser.add_argument(
        "--vs-no-key-list",
        action="store_true",
        help="a table drained as now and one without the MERGE's key list per size",
    )
    parser.add_argument("--engine", default="sail", help="sail (embedded), spark (managed) or sc://host:port")
    parser.add_argument(
        "--spark-conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting for the managed Spark engine (repeatable), e.g. spark.driver.memory=4g",
    )
    args = parser.parse_args(argv)
    sizes = sorted(int(size) for size in args.sizes.split(","))
    if args.both:
        kinds = [BUCKETED, UNBUCKETED]
    elif args.vs_copy_on_write:
        kinds = [BUCKETED, COPY_ON_WRITE]
    elif args.vs_update_merge:
        kinds = [BUCKETED, UPDATE_MERGE]
    elif args.vs_no_key_list:
        kinds = [BUCKETED, NO_KEY_LIST]
    else:
        kinds = [UNBUCKETED if args.unbucketed else COPY_ON_WRITE if args.copy_on_write else BUCKETED]
    tables = [(rows, unbucketed) for rows in sizes for unbucketed in kinds]
    work = Path(tempfile.mkdtemp(prefix="pgcdc-bench-big-"))
    server = start_local_postgres(args.major, base_dir=work / "pg")
    rng = random.Random(13)
    try:
        dsn = server.dsn()
        for table in tables:
            started = time.perf_counter()
            load(dsn, table)
            print(f"loaded {describe(table)} in {time.perf_counter() - started:.1f}s", flush=True)
        configs = {table: config_for(dsn, table, work / "lake", args.target_rows) for table in tables}
        results: dict[Table, dict[str, float]] = {}
        paths = {table: configs[table].table_path("public", table_name(table)) for table in tables}
        extra = dict(setting.split("=", 1) for setting in args.spark_conf)
        with open_engine(args.engine, str(work / "lake"), {}, extra) as engine:
            print(f"engine: {args.engine}", flush=True)
            for table in tables:
                started = time.perf_counter()
                (snapshot,) = snapshot_tables(configs[table], lake_destination(engine.spark, configs[table]))
                layout = snapshot.layout.describe() if snapshot.layout else "unbucketed"
                print(f"snapshot of {describe(table)}: {time.perf_counter() - started:.1f}s ({layout})", flush=True)
            for rows in sizes:
                same_size = [table for table in tables if table[0] == rows]
                newest: dict[Table, list[float]] = {table: [] for table in same_size}
                uniform: dict[Table, list[float]] = {table: [] for table in same_size}
                written: dict[Table, dict[str, list[int]]] = {
                    table: {"newest": [], "random": []} for table in same_size
                }
                warm_up_keys = rng.sample(range(1, rows + 1), RANDOM_UPDATES)
                for table in same_size:  # one untimed drain of each pattern (a JVM engine compiles its hot paths)
                    newest_changes(dsn, table, 0)
                    timed_drain(configs[table], engine, paths[table], kind=table[1])
                    random_changes(dsn, table, warm_up_keys)
                    timed_drain(configs[table], engine, paths[table], kind=table[1])
                for round_number in range(1, args.rounds + 1):  # the kinds in turn, so they share the machine's mood
                    for table in same_size:
                        newest_changes(dsn, table, round_number)
                        newest[table].append(
                            timed_drain(configs[table], engine, paths[table], written[table]["newest"], table[1])
                        )
                newest_removed = {
                    table: merge_files(configs[table].table_path("public", table_name(table)))[2] for table in same_size
                }
                for _ in range(args.rounds):
                    keys = rng.sample(range(1, rows + 1), RANDOM_UPDATES)  # the same keys in each kind's table
                    for table in same_size:
                        random_changes(dsn, table, keys)
                        uniform[table].append(
                            timed_drain(configs[table], engine, paths[table], written[table]["random"], table[1])
                        )
                for table in same_size:
                    config = configs[table]
                    files, partitions, random_removed = merge_files(config.table_path("public", table_name(table)))
                    check(dsn, table, config)
                    results[table] = {
                        "newest": statistics.median(newest[table]),
                        "random": statistics.median(uniform[table]),
                    }
                    mb = {kind: statistics.median(written[table][kind]) / 1e6 for kind in ("newest", "random")}
                    print(
                        f"{describe(table)}: newest {results[table]['newest']:.2f}s, {mb['newest']:.3f} MB written "
                        f"(last MERGE rewrote {newest_removed[table]} file(s)), random {results[table]['random']:.2f}s, "
                        f"{mb['random']:.3f} MB written (rewrote {random_removed}); {files} files in {partitions} partition(s)",
                        flush=True,
                    )
        print(
            f"\nratios against {sizes[0]:,} rows of the same kind (one run; the machine may be shared, figures vary):"
        )
        for table in tables:
            base = results[(sizes[0], table[1])]
            print(
                f"{describe(table)}: newest {results[table]['newest'] / base['newest']:.2f}x, "
                f"random {results[table]['random'] / base['random']:.2f}x"
            )
        for kind in kinds:
            for pattern, goal in (("newest", 1.5), ("random", 2.0)):
                ratio = results[(sizes[-1], kind)][pattern] / results[(sizes[0], kind)][pattern]
                print(
                    f"goal{'' if kind == BUCKETED else f' ({kind})'}: {pattern} at {sizes[-1]:,} rows within {goal}x of "
                    f"{sizes[0]:,}: {'met' if ratio <= goal else 'NOT met'} ({ratio:.2f}x)"
                )
        if len(kinds) == 2:
            for rows in sizes:
                first, second = results[(rows, kinds[0])], results[(rows, kinds[1])]
                print(
                    f"{rows:>11,} rows, {kinds[0]} / {kinds[1]}: newest {first['newest'] / second['newest']:.2f}x, "
                    f"random {first['random'] / second['random']:.2f}x"
                )
    finally:
        server.destroy()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
