"""A busy drain: every transaction changes each of several tables, so each chunk commits all of them,
side by side with ``spark.write_concurrency`` (``resources/cdc/writer.py``). Shared by the embedded
engine's tests (tests/test_concurrent_drain.py) and the managed Spark engine's (tests/test_engines.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import deltalake

from resources.config import PgcdcConfig
from resources.testing.verify import assert_delta_equals_postgres
from tests.support.postgres import PgDatabase

KEYED = ("k0", "k1", "k2", "k3")
BUSY_TABLES = {**{f"public.{name}": ("id",) for name in KEYED}, "public.feed": (), "public.bag": ()}
"""Each table and the key the oracle matches it by: four keyed tables, a keyless one, a REPLICA IDENTITY
FULL one with identical rows (a change applied twice would show in either)."""

BUSY_DDL = (
    "".join(
        f"CREATE TABLE {name} (id int PRIMARY KEY, n int, note text);"
        f"INSERT INTO {name} SELECT g, 0, 'start' FROM generate_series(1, 10) g;"
        for name in KEYED
    )
    + """
    CREATE TABLE feed (entry int, note text);
    CREATE TABLE bag (k int, note text);
    ALTER TABLE bag REPLICA IDENTITY FULL;
    INSERT INTO bag VALUES (0, 'seed'), (0, 'seed');
    CREATE PUBLICATION pub FOR TABLE k0, k1, k2, k3, feed, bag;
    """
)


def with_write_concurrency(config: PgcdcConfig, writes: int) -> PgcdcConfig:
    return config.model_copy(update={"spark": config.spark.model_copy(update={"write_concurrency": writes})})


def busy_workload(pg: PgDatabase, transactions: int, offset: int = 0) -> None:
    """``transactions`` transactions, each an update, an insert (a delete every third) in every keyed table,
    two identical rows appended to ``feed`` and one added to (one in four: removed from) ``bag``."""
    with pg.connect() as conn:
        for i in range(offset, offset + transactions):
            with conn.transaction():
                for name in KEYED:
                    conn.execute(f"UPDATE {name} SET n = n + 1, note = %s WHERE id = %s", (f"u{i}", i % 10 + 1))
                    conn.execute(f"INSERT INTO {name} VALUES (%s, %s, 'new')", (100 + i, i))
                    if i % 3 == 2:
                        conn.execute(f"DELETE FROM {name} WHERE id = %s", (100 + i - 1,))
                conn.execute("INSERT INTO feed VALUES (%s, 'same'), (%s, 'same')", (i % 4, i % 4))
                if i % 4 == 3:
                    conn.execute("DELETE FROM bag WHERE ctid = (SELECT min(ctid) FROM bag WHERE k = 0)")
                else:
                    conn.execute("INSERT INTO bag VALUES (0, 'seed')")


def assert_busy_exact(pg: PgDatabase, config: PgcdcConfig, tables: dict[str, tuple[str, ...]] = BUSY_TABLES) -> None:
    for table, key in tables.items():
        schema, _, name = table.partition(".")
        assert_delta_equals_postgres(pg.dsn, table, config.table_path(schema, name), key=key)


def refuse_nulls_in(config: PgcdcConfig, table: str) -> None:
    """Give ``table``'s Delta table a NOT NULL column PostgreSQL does not have (as another writer might):
    pgcdc writes NULL to such a column, which the engine refuses at the table's next write, an analysis
    error of that table alone (its quarantine) that only the write itself can meet."""
    schema, _, name = table.partition(".")
    delta = deltalake.DeltaTable(config.table_path(schema, name))
    delta.alter.add_columns([deltalake.Field("legacy", "long", nullable=False)])


def settle(
    config: PgcdcConfig,
    tables: dict[str, tuple[str, ...]] = BUSY_TABLES,
    quiet: float = 15.0,
    histories: Sequence[str] = (),
) -> None:
    """Until no table's Delta log (nor the history table of one of ``histories``) has grown for ``quiet`` seconds:
    the writes a killed client had sent to a Spark Connect server run on in the server and may still commit. A
    run racing one fails on Delta's conflict check (ConcurrentAppendException: a failed run, retried, never a
    wrong table); the next scheduled run starts minutes later, but a test's re-run seconds later must wait."""
    paths = [config.table_path(*table.split(".")) for table in tables]
    paths += [path for table in histories if (path := config.history_path(*table.split("."))) is not None]
    logs = [Path(path) / "_delta_log" for path in paths]
    seen: list[int] = []
    stable_since = time.monotonic()
    deadline = stable_since + 120
    while time.monotonic() < deadline:
        now = [len(list(log.glob("*.json"))) for log in logs]
        if now != seen:
            seen, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since >= quiet:
            return
        time.sleep(0.2)
    raise AssertionError("the Delta logs kept growing for two minutes after the client died")
