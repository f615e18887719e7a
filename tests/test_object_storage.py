"""The lake on object storage (``delta.root: s3://bucket/prefix``) against a local S3 (moto, started
by ``tests/support/s3_fixtures.py``), real PostgreSQL 15 and 18 and the embedded Sail engine (Apache
Spark with Delta runs the same :func:`lifecycle` through S3A in ``tests/test_engines.py``, on the
JVM engine those tests start anyway).

The lifecycle runs on s3:// as it does on a local directory: snapshot, drains while PostgreSQL
is being written, TRUNCATE, a REPLICA IDENTITY FULL table with duplicate rows and a keyless
table, each step compared with PostgreSQL by the oracle reading the store with delta-rs. pgcdc's
staging data is removed through the storage client, since the engine's files are not on
pgcdc's disk. A wrong bucket, missing credentials or an unreachable endpoint fail in seconds
with one line naming the key to fix, before anything is written or confirmed; the secret shows
up in no log line, error, configuration repr or Delta commit.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import deltalake
import pyarrow as pa
import pytest
from pyspark.sql import SparkSession

from resources.delta import snapshot_writes
from resources.config import parse_config
from pgcdc_assets.dagster_resources import SparkDeltaResource
from resources.delta.marker_reads import read_commit_metadata
from resources.delta.state_table import read_state, state_path
from resources.delta.snapshot_writes import STAGING_DIRECTORY, write_snapshot
from resources.errors import ConfigurationError
from resources.runs.incremental import run_incremental
from resources.delta.lake_storage import LakeStorage, open_lake, remove_tree
from resources.runs.snapshot import snapshot_tables
from tests.support.deletion_vectors import assert_deletion_vectors
from tests.support.postgres import PgDatabase
from resources.testing.verify import assert_delta_equals_postgres
from tests.support.s3_fixtures import BUCKET, TEST_SECRET, S3Server

pytest_plugins = ["tests.support.s3_fixtures"]

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
    return {"postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": SLOT, "delta": {"root": root, "storage": storage}}


def all_same(pg: PgDatabase, s3: S3Server, root: str) -> None:
    config = parse_config(settings(pg, root, s3.storage()))
    options = LakeStorage(config.delta.root, config.delta.storage).object_store_options()
    for table, key in TABLES.items():
        schema, _, name = table.partition(".")
        assert_delta_equals_postgres(pg.dsn, table, config.table_path(schema, name), key=key, storage_options=options)


def staged_objects(s3: S3Server, prefix: str) -> list[str]:
    """Objects left in staging directories (not counting the empty marker of the directory itself)."""
    return [key for key in s3.keys(prefix) if STAGING_DIRECTORY in key and not key.endswith(f"{STAGING_DIRECTORY}/")]


# --------------------------------------------------------------------------- configuration


def test_table_locations_on_object_storage_and_local_roots() -> None:
    base = {"postgres": {"dsn": "dbname=x"}, "publication": "pub"}
    on_s3 = parse_config({**base, "delta": {"root": "s3://bucket/some/prefix/"}})
    assert on_s3.table_path("public", "Mixed Case") == "s3://bucket/some/prefix/public/Mixed-20Case"
    on_s3a = parse_config({**base, "delta": {"root": "s3a://bucket"}})
    assert on_s3a.table_path("s", "t") == "s3a://bucket/s/t"
    local = parse_config({**base, "delta": {"root": "./lake"}})
    assert local.table_path("public", "orders") == str(Path("./lake").resolve() / "public" / "orders")
    with pytest.raises(ConfigurationError, match=r"delta.root gs://b/p is not a supported lake location"):
        parse_config({**base, "delta": {"root": "gs://b/p"}}).table_path("s", "t")


def test_storage_settings_refuse_literal_secrets_and_plain_http_without_saying_the_secret() -> None:
    base = {"postgres": {"dsn": "dbname=x"}, "publication": "pub"}
    literal = {"root": "s3://b/p", "storage": {"access_key_id": "AKIA", "secret_access_key": "hunter2-secret"}}
    with pytest.raises(ConfigurationError) as refused:
        parse_config({**base, "delta": literal})
    assert "delta.storage.secret_access_key" in str(refused.value) and "${NAME}" in str(refused.value)
    assert "hunter2-secret" not in str(refused.value)
    http = {"root": "s3://b/p", "storage": {"endpoint": "http://127.0.0.1:9000"}}
    with pytest.raises(ConfigurationError, match=r"set delta.storage.allow_http: true"):
        parse_config({**base, "delta": http})


# --------------------------------------------------------------------------- lifecycle


def test_lifecycle_on_s3_matches_postgres(pg: PgDatabase, s3_server: S3Server, s3_root: str, s3_spark: SparkSession) -> None:
    lifecycle(pg, s3_server, s3_root, s3_spark, copy_on_write="public.dups")


def lifecycle(
    pg: PgDatabase, s3_server: S3Server, s3_root: str, s3_spark: SparkSession, copy_on_write: str,
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
    snapshot_tables(config, s3_spark)
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
            run_incremental(config, s3_spark, log=messages.append)
    finally:
        stop.set()
        writer.join()
    assert not writer_failures, writer_failures
    run_incremental(config, s3_spark, log=messages.append)
    all_same(pg, s3_server, s3_root)
    steps["drains under writes"] = time.monotonic() - started - sum(steps.values())

    # Duplicates of a REPLICA IDENTITY FULL table change one copy at a time; TRUNCATE empties.
    with pg.connect() as conn:
        conn.execute("UPDATE dups SET b = 'changed' WHERE ctid = (SELECT min(ctid) FROM dups WHERE a = 1)")
        conn.execute("DELETE FROM dups WHERE ctid = (SELECT min(ctid) FROM dups WHERE a = 2)")
        conn.execute("TRUNCATE orders")
        conn.execute("INSERT INTO orders VALUES (1, 2.5, 'after truncate')")
        conn.execute("INSERT INTO events VALUES ('dup', 1), ('dup', 1)")
    result = run_incremental(config, s3_spark, log=messages.append)
    assert result.tables["public.orders"].truncates == 1
    all_same(pg, s3_server, s3_root)
    steps["duplicates, truncate"] = time.monotonic() - started - sum(steps.values())
    print("lifecycle seconds:", {step: round(seconds, 1) for step, seconds in steps.items()})

    prefix = s3_root.removeprefix(f"s3://{BUCKET}/") + "/"
    assert staged_objects(s3_server, prefix) == []
    assert all(key.startswith((prefix + "public/", prefix + "_pgcdc/state/")) for key in s3_server.keys(prefix))
    state = read_state(state_path(s3_root, SLOT))  # the state table lives on the store too
    assert {table: row.log.version for table, row in state.items()} == {
        table: deltalake.DeltaTable(config.table_path(*table.split(".")), storage_options=LakeStorage(config.delta.root, config.delta.storage).object_store_options()).version()
        for table in TABLES
    }
    orders = config.table_path("public", "orders")
    commits = read_commit_metadata(s3_spark, orders)
    assert commits and all(TEST_SECRET not in (commit.user_metadata or "") for commit in commits)
    assert messages and all(TEST_SECRET not in message for message in messages)
    assert TEST_SECRET not in repr(config) and TEST_SECRET not in str(SparkDeltaResource.from_pgcdc_config(config))


def test_chunked_snapshot_on_s3_leaves_no_staging_objects(
    s3_server: S3Server, s3_root: str, s3_spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    open_lake(s3_root, s3_server.lake(s3_root).settings)
    removed: list[str] = []
    monkeypatch.setattr(snapshot_writes, "remove_tree", lambda location: (removed.append(location), remove_tree(location)))
    schema = pa.schema([("id", pa.int64())])
    batches = (pa.record_batch([pa.array(range(i * 100, i * 100 + 100), pa.int64())], schema=schema) for i in range(4))
    path = f"{s3_root}/public/t"
    options = s3_server.lake(s3_root).object_store_options()
    assert write_snapshot(s3_spark, batches, schema, path, "m", chunk_bytes=800) == 1  # version 0: delta-rs's create
    assert sorted(deltalake.DeltaTable(path, storage_options=options).to_pyarrow_table().column("id").to_pylist()) == list(range(400))
    assert removed == []  # streamed into the table by delta-rs, nothing staged
    # A key range of a snapshot in key ranges goes through the engine, staged: a chunk per batch.
    again = (pa.record_batch([pa.array(range(i * 100, i * 100 + 100), pa.int64())], schema=schema) for i in range(2, 4))
    assert write_snapshot(s3_spark, again, schema, path, "r", chunk_bytes=800, replace_where="id >= 200") == 2
    table = deltalake.DeltaTable(path, storage_options=options)
    assert sorted(table.to_pyarrow_table().column("id").to_pylist()) == list(range(400))
    assert [location.startswith(f"{path}/{STAGING_DIRECTORY}/") for location in removed] == [True]
    assert staged_objects(s3_server, s3_root.removeprefix(f"s3://{BUCKET}/")) == []


# --------------------------------------------------------------------------- bad input


BAD_STORAGE = {
    "wrong bucket": ("s3://no-such-bucket/lake", {}, ("no-such-bucket", "fix delta.root")),
    "unset credential variable": (None, {"secret_access_key": "${PGCDC_TEST_UNSET}"}, ("delta.storage.secret_access_key", "PGCDC_TEST_UNSET")),
    "no credentials": (None, {"access_key_id": None, "secret_access_key": None}, ("no S3 credentials", "delta.storage.access_key_id")),
    "unreachable endpoint": (None, {"endpoint": "http://127.0.0.1:9"}, ("unreachable", "delta.storage.endpoint")),
}


@pytest.mark.parametrize("case", list(BAD_STORAGE))
def test_bad_storage_is_one_line_naming_the_key_and_moves_nothing(
    case: str,
    pg: PgDatabase,
    s3_server: S3Server,
    s3_root: str,
    s3_spark: SparkSession,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    pg.execute(DDL)
    good = parse_config(settings(pg, s3_root, s3_server.storage()))
    snapshot_tables(good, s3_spark)
    pg.execute("INSERT INTO orders VALUES (5000, 1, 'pending')")
    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws/credentials to fall back on

    def state() -> tuple[object, ...]:
        slot = pg.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (SLOT,))
        options = LakeStorage(good.delta.root, good.delta.storage).object_store_options()
        versions = tuple(
            deltalake.DeltaTable(good.table_path("public", name), storage_options=options).version()
            for name in ("orders", "dups", "events")
        )
        return slot, versions, len(s3_server.keys(""))

    before = state()
    root, overrides, fragments = BAD_STORAGE[case]
    storage = {key: value for key, value in {**s3_server.storage(), **overrides}.items() if value is not None}
    bad = parse_config(settings(pg, root or s3_root, storage))
    for run in (lambda: run_incremental(bad, s3_spark), lambda: snapshot_tables(bad, s3_spark)):
        started = time.monotonic()
        with pytest.raises(ConfigurationError) as failure:
            run()
        # Several times what connect_timeout and two attempts allow (seconds), a fraction of the
        # AWS SDK's and object_store's default retries (minutes), which is what this guards against.
        assert time.monotonic() - started < 60
        message = str(failure.value).strip()
        assert "\n" not in message, message
        assert all(fragment in message for fragment in fragments), message
        assert TEST_SECRET not in message
    assert state() == before, "the slot, a Delta table or the store changed on bad input"
