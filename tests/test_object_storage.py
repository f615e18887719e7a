"""The lake on object storage (``delta.root: s3://bucket/prefix``) against a local S3 (moto, started
by ``tests/support/s3_fixtures.py``), real PostgreSQL (the newest: the store does not depend on it;
the bad storage settings alternate between 15 and 18) and the embedded Sail engine (Apache
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

import signal
import time
from pathlib import Path

import deltalake
import pyarrow as pa
import pytest
from pyspark.sql import SparkSession

from resources.config import parse_config
from resources.delta import snapshot_writes
from resources.delta.lake_storage import LakeStorage, object_store_options, open_lake, remove_tree, storage_client
from resources.delta.snapshot_writes import write_snapshot
from resources.delta.spark_destination import lake_destination
from resources.delta.staging import STAGING_DIRECTORY
from resources.engines.s3a import s3a_settings
from resources.errors import ConfigurationError
from resources.locations import StorageSettings
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from tests.support.incremental_runs import run_child
from tests.support.object_storage_lifecycle import all_same, DDL, lifecycle, settings, SLOT, staged_objects
from tests.support.postgres import NEWEST_POSTGRES_ONLY, one_version_each, PgDatabase
from tests.support.s3_fixtures import BUCKET, RecordingHttpProxy, S3Server, TEST_SECRET

pytest_plugins = ["tests.support.s3_fixtures"]


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


@NEWEST_POSTGRES_ONLY
def test_lifecycle_on_s3_matches_postgres(
    pg: PgDatabase, s3_server: S3Server, s3_root: str, s3_spark: SparkSession
) -> None:
    lifecycle(pg, s3_server, s3_root, s3_spark, copy_on_write="public.dups")


@pytest.mark.slow  # drains in child processes, one SIGKILLed
@NEWEST_POSTGRES_ONLY  # the store, not the server, is what this case adds to the crash tests
def test_a_drain_killed_between_two_delta_writes_on_s3_replays_exactly(
    pg: PgDatabase, s3_server: S3Server, s3_root: str, s3_spark: SparkSession, tmp_path: Path
) -> None:
    """The crash matrix's case on an ``s3://`` lake: killed after the drain's second Delta write (the keyed
    table's MERGE is in, the FULL and the keyless table's writes are not), the next drain is exact."""
    pg.execute(DDL)
    config = parse_config(settings(pg, s3_root, s3_server.storage()))
    snapshot_tables(config, lake_destination(s3_spark, config))
    for i in range(3):
        pg.execute(
            f"UPDATE orders SET amount = amount + 1 WHERE id <= {10 * (i + 1)}; INSERT INTO dups VALUES (1, 'x'), (3, 'y');"
            f" DELETE FROM dups WHERE ctid = (SELECT min(ctid) FROM dups WHERE a = 2); INSERT INTO events VALUES ('new', {i})"
        )
    killed = run_child(config, tmp_path, "after_table_commit:2", 100_000)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr[-3000:]
    finished = run_child(config, tmp_path, None, 100_000)
    assert finished.returncode == 0, finished.stdout + finished.stderr[-3000:]
    all_same(pg, s3_server, s3_root)


def test_chunked_snapshot_on_s3_leaves_no_staging_objects(
    s3_server: S3Server, s3_root: str, s3_spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    lake = open_lake(s3_root, s3_server.lake(s3_root).settings)
    removed: list[str] = []
    monkeypatch.setattr(
        snapshot_writes, "remove_tree", lambda location, lake: (removed.append(location), remove_tree(location, lake))
    )
    schema = pa.schema([("id", pa.int64())])
    batches = (pa.record_batch([pa.array(range(i * 100, i * 100 + 100), pa.int64())], schema=schema) for i in range(4))
    path = f"{s3_root}/public/t"
    options = s3_server.lake(s3_root).object_store_options()
    assert (
        write_snapshot(s3_spark, batches, schema, path, "m", chunk_bytes=800, lake=lake) == 1
    )  # version 0: delta-rs's create
    assert sorted(
        deltalake.DeltaTable(path, storage_options=options).to_pyarrow_table().column("id").to_pylist()
    ) == list(range(400))
    assert removed == []  # streamed into the table by delta-rs, nothing staged
    # A key range of a snapshot in key ranges goes through the engine, staged: a chunk per batch.
    again = (pa.record_batch([pa.array(range(i * 100, i * 100 + 100), pa.int64())], schema=schema) for i in range(2, 4))
    assert (
        write_snapshot(s3_spark, again, schema, path, "r", chunk_bytes=800, replace_where="id >= 200", lake=lake) == 2
    )
    table = deltalake.DeltaTable(path, storage_options=options)
    assert sorted(table.to_pyarrow_table().column("id").to_pylist()) == list(range(400))
    assert [location.startswith(f"{path}/{STAGING_DIRECTORY}/") for location in removed] == [True]
    assert staged_objects(s3_server, s3_root.removeprefix(f"s3://{BUCKET}/")) == []


def test_an_object_store_location_is_reached_only_through_the_lake_passed_with_it(tmp_path: Path) -> None:
    """Credentials travel with the lake a caller passes, never through a registry: an object-store
    location gets the settings of the lake holding it; without a lake, or outside the one passed, it is
    refused with the fix; a local location needs none."""
    lake = LakeStorage("s3://bucket/lake", StorageSettings(endpoint="http://127.0.0.1:9", region="r1", allow_http=True))
    inside = object_store_options("s3://bucket/lake/public/t", lake)
    assert (inside["AWS_ENDPOINT_URL"], inside["AWS_REGION"], inside["AWS_ALLOW_HTTP"]) == (
        "http://127.0.0.1:9",
        "r1",
        "true",
    )
    assert storage_client("s3://bucket/lake/public/t", lake)[1] == "bucket/lake/public/t"
    for location, given in (
        ("s3://bucket/lake/t", None),
        ("s3://bucket/lakeside/t", lake),
        ("s3://other/lake/t", lake),
    ):
        with pytest.raises(ConfigurationError, match="outside the lake pgcdc was given") as refused:
            object_store_options(location, given)
        assert "open_lake(delta.root, delta.storage)" in refused.value.fix
    local = tmp_path / "staging" / "x"
    local.mkdir(parents=True)
    assert object_store_options(str(local), lake) == {} and storage_client(str(local), None)[1] == str(local)
    remove_tree(str(local), None)
    assert not (tmp_path / "staging").exists()  # the emptied parent goes too


# --------------------------------------------------------------------------- bad input


BAD_STORAGE = {
    "wrong bucket": ("s3://no-such-bucket/lake", {}, ("no-such-bucket", "fix delta.root")),
    "unset credential variable": (
        None,
        {"secret_access_key": "${PGCDC_TEST_UNSET}"},
        ("delta.storage.secret_access_key", "PGCDC_TEST_UNSET"),
    ),
    "no credentials": (
        None,
        {"access_key_id": None, "secret_access_key": None},
        ("no S3 credentials", "delta.storage.access_key_id"),
    ),
    "unreachable endpoint": (None, {"endpoint": "http://127.0.0.1:9"}, ("unreachable", "delta.storage.endpoint")),
}


@one_version_each("case", list(BAD_STORAGE))
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
    snapshot_tables(good, lake_destination(s3_spark, good))
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
    for run in (
        lambda: run_incremental(bad, lake_destination(s3_spark, bad)),
        lambda: snapshot_tables(bad, lake_destination(s3_spark, bad)),
    ):
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


def test_path_style_false_addresses_the_bucket_in_the_host_name(
    s3_server: S3Server, s3_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``delta.storage.path_style: false`` (docs/configuration.md): pgcdc's preflight passes and delta-rs
    (the snapshot writer, the oracle) writes and reads a table with every request naming the bucket in the
    host (``lake.localhost``), none in the path; the engine is given the same endpoint and S3A
    ``path.style.access`` false. The requests reach moto through a recording HTTP proxy (``lake.localhost``
    resolves nowhere here), which shows the addressing the client really used."""
    port = int(s3_server.endpoint.rsplit(":", 1)[1])
    proxy = RecordingHttpProxy(port)
    for name in ("HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(name, proxy.url)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    lake = LakeStorage(
        s3_root, StorageSettings(**s3_server.storage(endpoint=f"http://localhost:{port}", path_style=False))
    )
    assert lake.engine_environment()["AWS_ENDPOINT_URL"] == f"http://{BUCKET}.localhost:{port}"
    assert lake.engine_environment()["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] == "true"
    assert s3a_settings(lake)["spark.hadoop.fs.s3a.path.style.access"] == "false"
    try:
        lake.check()
        path, options = f"{s3_root}/public/t", lake.object_store_options()
        deltalake.write_deltalake(path, pa.table({"id": [1, 2, 3]}), storage_options=options)
        deltalake.write_deltalake(path, pa.table({"id": [4]}), mode="append", storage_options=options)
        assert sorted(
            deltalake.DeltaTable(path, storage_options=options).to_pyarrow_table().column("id").to_pylist()
        ) == [1, 2, 3, 4]
    finally:
        proxy.close()
    prefix = s3_root.split("/", 3)[3]
    assert any(line.startswith("PUT ") for line, _ in proxy.requests)
    assert {host for _, host in proxy.requests} == {f"{BUCKET}.localhost:{port}"}
    paths = [line.split(" ")[1].removeprefix(f"http://{BUCKET}.localhost:{port}") for line, _ in proxy.requests]
    assert all(path.startswith((f"/{prefix}/", "/?")) for path in paths), paths[:5]
    assert sorted(s3_server.keys(prefix))[0].startswith(f"{prefix}/public/t/")  # in the bucket, at the prefix
