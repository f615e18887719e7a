"""A pipeline's life on an S3 lake: snapshot, drains while PostgreSQL is written, and every table
compared with PostgreSQL after each step (run on every engine)."""

from __future__ import annotations

import threading
import time
from typing import Any

import deltalake
from pyspark.sql import SparkSession

from pgcdc_assets.dagster_resources import SparkDeltaResource
from resources.config import parse_config
from resources.delta.lake_storage import LakeStorage
from resources.delta.spark_destination import lake_destination
from resources.delta.staging import STAGING_DIRECTORY
from resources.delta.state_table import read_state, state_path
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.verify import assert_delta_equals_postgres
from tests.support.deletion_vectors import assert_deletion_vectors
from tests.support.marker_reads import read_commit_metadata
from tests.support.postgres import PgDatabase
from tests.support.s3_fixtures import BUCKET, S3Server, TEST_SECRET

SLOT = "pgcdc_slot"

DDL = """
    CREATE TABLE orders (id int PRIMARY KEY, amount numeric(10,2), note text);
    CREATE TABLE dups (a int, b text);
    ALTER TABLE dups REPLICA IDENTITY FULL;
    CREATE TABLE events (kind text, n int);
    INSERT INTO orders SELECT g, g * 1.5, 'n' || g FROM generate_series(1, 2000) g;
    INSERT INTO dups VALUES (1, 'x'), (1, 'x'), (1, 'x'), (2, NULL), (2, NULL);
    INSERT INTO events VALUES ('old', 1), ('old', 1);
    CREATE PUBLICATION pub FOR TABLE orders, dups, events;
"""

TABLES = {"public.orders": ("id",), "public.dups": (), "public.events": ()}


def settings(pg: PgDatabase, root: str, storage: dict[str, Any]) -> dict[str, Any]:
    return {
        "postgres": {"dsn": pg.dsn},
        "publication": "pub",
        "slot": SLOT,
        "delta": {"root": root, "storage": storage},
    }


def all_same(pg: PgDatabase, s3: S3Server, root: str) -> None:
    config = parse_config(settings(pg, root, s3.storage()))
    options = LakeStorage(config.delta.root, config.delta.storage).object_store_options()
    for table, key in TABLES.items():
        schema, _, name = table.partition(".")
        assert_delta_equals_postgres(pg.dsn, table, config.table_path(schema, name), key=key, storage_options=options)


def staged_objects(s3: S3Server, prefix: str) -> list[str]:
    """Objects left in staging directories (not counting the empty marker of the directory itself)."""
    return [key for key in s3.keys(prefix) if STAGING_DIRECTORY in key and not key.endswith(f"{STAGING_DIRECTORY}/")]


def lifecycle(
    pg: PgDatabase,
    s3_server: S3Server,
    s3_root: str,
    s3_spark: SparkSession,
    copy_on_write: str,
    drains_under_writes: int = 2,
) -> None:
    """Snapshot, drains under writes, duplicates and TRUNCATE on ``s3://``; the table ``copy_on_write``
    (``orders`` or ``dups``) opted out of deletion vectors, the other with them."""
    steps: dict[str, float] = {}
    started = time.monotonic()
    pg.execute(DDL)
    options = settings(pg, s3_root, s3_server.storage())
    options["delta"]["deletion_vectors_tables"] = {copy_on_write: False}
    config = parse_config(options)
    messages: list[str] = []
    snapshot_tables(config, lake_destination(s3_spark, config))
    assert_deletion_vectors(config, {name: name != copy_on_write for name in ("public.orders", "public.dups")})
    all_same(pg, s3_server, s3_root)
    steps["snapshot"] = time.monotonic() - started

    # Drains while PostgreSQL is being written: each drain is exact up to where it started.
    stop = threading.Event()
    writer_failures: list[BaseException] = []

    def write_while_draining() -> None:
        try:
            write_until_stopped()
        except BaseException as failure:  # handed to the test thread
            writer_failures.append(failure)

    def write_until_stopped() -> None:
        n = 0
        with pg.connect() as conn:
            while not stop.is_set():
                n += 1
                conn.execute("UPDATE orders SET amount = amount + 1 WHERE id %% 50 = %s", (n % 50,))
                conn.execute("INSERT INTO orders VALUES (%s, 1, 'w')", (10_000 + n,))
                conn.execute("DELETE FROM orders WHERE id = %s", (n,))
                conn.execute("INSERT INTO dups VALUES (1, 'x'), (3, 'y')")
                conn.execute("INSERT INTO events VALUES ('w', %s), ('w', %s)", (n, n))
                time.sleep(0.02)

    writer = threading.Thread(target=write_while_draining)
    writer.start()
    try:
        for _ in range(drains_under_writes):
            run_incremental(config, lake_destination(s3_spark, config), log=messages.append)
    finally:
        stop.set()
        writer.join()
    assert not writer_failures, writer_failures
    run_incremental(config, lake_destination(s3_spark, config), log=messages.append)
    all_same(pg, s3_server, s3_root)
    steps["drains under writes"] = time.monotonic() - started - sum(steps.values())

    # Duplicates of a REPLICA IDENTITY FULL table change one copy at a time; TRUNCATE empties.
    with pg.connect() as conn:
        conn.execute("UPDATE dups SET b = 'changed' WHERE ctid = (SELECT min(ctid) FROM dups WHERE a = 1)")
        conn.execute("DELETE FROM dups WHERE ctid = (SELECT min(ctid) FROM dups WHERE a = 2)")
        conn.execute("TRUNCATE orders")
        conn.execute("INSERT INTO orders VALUES (1, 2.5, 'after truncate')")
        conn.execute("INSERT INTO events VALUES ('dup', 1), ('dup', 1)")
    result = run_incremental(config, lake_destination(s3_spark, config), log=messages.append)
    assert result.tables["public.orders"].truncates == 1
    all_same(pg, s3_server, s3_root)
    steps["duplicates, truncate"] = time.monotonic() - started - sum(steps.values())
    print("lifecycle seconds:", {step: round(seconds, 1) for step, seconds in steps.items()})

    prefix = s3_root.removeprefix(f"s3://{BUCKET}/") + "/"
    assert staged_objects(s3_server, prefix) == []
    # the tables, pgcdc's state table and the slot's record (resources/runs/slot_guard.py), nothing else
    kept = (prefix + "public/", prefix + "_pgcdc/state/", prefix + "_pgcdc/slots/")
    assert all(key.startswith(kept) for key in s3_server.keys(prefix)), sorted(s3_server.keys(prefix))
    state = read_state(state_path(s3_root, SLOT), s3_server.lake(s3_root))  # the state table lives on the store too
    assert {table: row.log.version for table, row in state.items()} == {
        table: deltalake.DeltaTable(
            config.table_path(*table.split(".")),
            storage_options=LakeStorage(config.delta.root, config.delta.storage).object_store_options(),
        ).version()
        for table in TABLES
    }
    orders = config.table_path("public", "orders")
    commits = read_commit_metadata(s3_spark, orders)
    assert commits and all(TEST_SECRET not in (commit.user_metadata or "") for commit in commits)
    assert messages and all(TEST_SECRET not in message for message in messages)
    assert TEST_SECRET not in repr(config) and TEST_SECRET not in str(SparkDeltaResource.from_pgcdc_config(config))
