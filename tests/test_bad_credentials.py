"""Wrong S3 credentials against a store that checks them: moto's server with its IAM checks on (every
request signed by a known key whose policy allows it), real PostgreSQL 15 and 18, embedded Sail engines
started with the credentials of each run, as a Dagster run starts its own.

A wrong secret is refused by pgcdc's preflight before anything is written; a key that may read the lake
but not write it passes the preflight and is refused at the first write, mid-drain or mid-snapshot.
Either way: one line naming the credentials' keys (never the secret), nothing confirmed past Delta,
nothing in the store a later run cannot take over, and exact once the right key is back. Credentials
are no table's own fault: the whole run fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import deltalake
import pyarrow as pa
import pytest
import requests

from resources.config import parse_config, PgcdcConfig
from resources.delta.lake_storage import LakeStorage
from resources.delta.spark_destination import lake_destination
from resources.delta.staging import STAGING_DIRECTORY
from resources.engines.engine import SparkEngine
from resources.errors import PgcdcError
from resources.locations import StorageSettings
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from tests.support.bad_storage import (
    assert_exact,
    assert_nothing_confirmed_past_delta,
    confirmed,
    DDL,
    one_line,
    PENDING,
    settings,
)
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase
from tests.support.s3_fixtures import _free_port, _wait_for_port

BUCKET, REGION = "lake", "us-east-1"
KEY, SECRET = "PGCDC_TEST_IAM_KEY", "PGCDC_TEST_IAM_SECRET"
READ_ONLY = {"s3:Get*", "s3:List*", "s3:Head*"}


@dataclass(frozen=True)
class CheckingStore:
    """A moto server that refuses any request not signed by one of its IAM users' keys, or not allowed
    by that user's policy. ``keys``: (access key id, secret) of a user allowed everything
    (``writer``) and of one that may only read (``reader``)."""

    endpoint: str
    keys: dict[str, tuple[str, str]]

    def storage(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint, "region": REGION, "allow_http": True,
            "access_key_id": f"${{{KEY}}}", "secret_access_key": f"${{{SECRET}}}",
        }  # fmt: skip

    def objects(self, prefix: str) -> list[str]:
        key, secret = self.keys["writer"]
        client = boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=key, aws_secret_access_key=secret, region_name=REGION
        )
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


def _user(iam: Any, name: str, actions: set[str] | str) -> tuple[str, str]:
    iam.create_user(UserName=name)
    policy = {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Action": sorted(actions) if isinstance(actions, set) else actions, "Resource": "*"}
        ],
    }
    iam.put_user_policy(UserName=name, PolicyName="lake", PolicyDocument=json.dumps(policy))
    created = iam.create_access_key(UserName=name)["AccessKey"]
    return created["AccessKeyId"], created["SecretAccessKey"]


@pytest.fixture(scope="module")
def checking_store() -> Iterator[CheckingStore]:
    """Set up (bucket, users, keys) while moto accepts anything, then turn its checks on."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_for_port(port, server)
        endpoint = f"http://127.0.0.1:{port}"
        anyone = {
            "endpoint_url": endpoint,
            "aws_access_key_id": "setup",
            "aws_secret_access_key": "setup",
            "region_name": REGION,
        }
        boto3.client("s3", **anyone).create_bucket(Bucket=BUCKET)
        iam = boto3.client("iam", **anyone)
        keys = {"writer": _user(iam, "writer", "*"), "reader": _user(iam, "reader", READ_ONLY)}
        requests.post(f"{endpoint}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()
        yield CheckingStore(endpoint, keys)
    finally:
        server.terminate()
        server.wait(timeout=30)


def tables_and_commits(objects: list[str]) -> list[str]:
    return [key for key in objects if not key.endswith((f"/{STAGING_DIRECTORY}/", "/position.json"))]


@pytest.fixture
def credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws/credentials to fall back on
    yield


Run = Callable[..., Any]


@pytest.fixture
def run_with(checking_store: CheckingStore, credentials: None) -> Iterator[Run]:
    """``run_with(config, key, what, engine_key=key)``: a snapshot or a drain as a Dagster run makes it, the
    key pair in pgcdc's environment and an engine started with ``engine_key`` (one engine per key pair)."""
    engines: dict[tuple[str, str], SparkEngine] = {}
    with ExitStack() as stack:

        def run(config: PgcdcConfig, key: tuple[str, str], what: str, engine_key: tuple[str, str] | None = None) -> Any:
            engine_key = engine_key or key
            try:
                if engine_key not in engines:
                    os.environ[KEY], os.environ[SECRET] = engine_key
                    environment = LakeStorage(config.delta.root, config.delta.storage).engine_environment()
                    engines[engine_key] = stack.enter_context(SparkEngine.embedded(storage_environment=environment))
                os.environ[KEY], os.environ[SECRET] = key
                destination = lake_destination(engines[engine_key].spark, config)
                if what == "snapshot":
                    return snapshot_tables(config, destination)
                return run_incremental(config, destination)
            finally:  # the test's own reads use the writer's key
                os.environ[KEY], os.environ[SECRET] = checking_store.keys["writer"]

        yield run


@NEWEST_POSTGRES_ONLY  # the store's answers do not depend on PostgreSQL's version
def test_wrong_and_read_only_s3_keys_fail_in_one_line_and_the_right_key_is_exact(
    checking_store: CheckingStore, run_with: Run, pg: PgDatabase
) -> None:
    prefix = uuid.uuid4().hex[:12]
    root = f"s3://{BUCKET}/{prefix}"
    pg.execute(DDL + "CREATE PUBLICATION pub FOR TABLE orders, notes, tally")
    config = parse_config(settings(pg.dsn, root, delta={"root": root, "storage": checking_store.storage()}))
    writer, reader = checking_store.keys["writer"], checking_store.keys["reader"]
    wrong = (writer[0], "not-the-secret-Qp77")
    refused = ("S3 refused access", "delta.storage.access_key_id / secret_access_key")
    read_only = ("the object store refused a write", "delta.storage.access_key_id / secret_access_key", "s3:PutObject")
    for key, fragments in ((wrong, refused), (reader, read_only)):
        with pytest.raises(PgcdcError) as failure:
            run_with(config, key, "snapshot")
        one_line(failure.value, *fragments, "run the snapshot again" if key is reader else "", secret=key[1])
        assert checking_store.objects(prefix) == []
    run_with(config, writer, "snapshot")
    pg.execute(PENDING)
    before, objects = confirmed(pg), checking_store.objects(prefix)
    # The last: pgcdc's key is right, its engine's (started with an older key, say) may only read.
    for key, engine_key, fragments in (
        (wrong, wrong, refused),
        (reader, reader, read_only),
        (writer, reader, read_only),
    ):
        with pytest.raises(PgcdcError) as failure:
            run_with(config, key, "drain", engine_key)
        one_line(failure.value, *fragments, secret=engine_key[1])
        assert_nothing_confirmed_past_delta(pg, config, before)
        # Beyond the slot's record (its position now, where no drain recorded one yet) and Arrow's empty
        # marker of a removed staging directory, nothing was written.
        assert tables_and_commits(checking_store.objects(prefix)) == tables_and_commits(objects)
    run_with(config, writer, "drain")
    options = LakeStorage(config.delta.root, config.delta.storage).object_store_options()
    assert_exact(pg, config, storage_options=options)


TOKEN = "PGCDC_TEST_IAM_TOKEN"


def _assumed_role(store: CheckingStore) -> tuple[str, str, str]:
    """Temporary credentials (key, secret, session token) of a role allowed everything, assumed by the writer."""
    key, secret = store.keys["writer"]
    signed = {"endpoint_url": store.endpoint, "aws_access_key_id": key, "aws_secret_access_key": secret}
    iam, sts = boto3.client("iam", region_name=REGION, **signed), boto3.client("sts", region_name=REGION, **signed)
    name = f"lake-{uuid.uuid4().hex[:8]}"
    trust = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"}],
    }
    role = iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(trust))["Role"]
    allowed = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
    iam.put_role_policy(RoleName=name, PolicyName="lake", PolicyDocument=json.dumps(allowed))
    assumed = sts.assume_role(RoleArn=role["Arn"], RoleSessionName="pgcdc")["Credentials"]
    return assumed["AccessKeyId"], assumed["SecretAccessKey"], assumed["SessionToken"]


@NEWEST_POSTGRES_ONLY  # the store's answers do not depend on PostgreSQL's version
def test_a_session_token_reaches_every_client_and_is_what_the_store_checks(
    checking_store: CheckingStore, credentials: None, pg: PgDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``delta.storage.session_token``: temporary credentials (an assumed role's key, secret and token) work
    for pgcdc's preflight, the engine's writes and delta-rs's reads only with the token they belong to; the
    same key pair with a wrong token, or without its token, is refused in one line before anything is written."""
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    key, secret, token = _assumed_role(checking_store)
    monkeypatch.setenv(KEY, key)
    monkeypatch.setenv(SECRET, secret)
    prefix = uuid.uuid4().hex[:12]
    root = f"s3://{BUCKET}/{prefix}"
    pg.execute(DDL + "CREATE PUBLICATION pub FOR TABLE orders, notes, tally")
    storage = {**checking_store.storage(), "session_token": f"${{{TOKEN}}}"}
    config = parse_config(settings(pg.dsn, root, delta={"root": root, "storage": storage}))
    without_token = parse_config(settings(pg.dsn, root, delta={"root": root, "storage": checking_store.storage()}))
    monkeypatch.setenv(TOKEN, token)
    lake = LakeStorage(root, config.delta.storage)
    environment = lake.engine_environment()
    assert (
        environment["AWS_SESSION_TOKEN"] == token
        and "AWS_SESSION_TOKEN" not in LakeStorage(root, without_token.delta.storage).engine_environment()
    )
    with SparkEngine.embedded(storage_environment=environment) as engine:
        cases = (  # the key pair alone is no key the store knows; with a wrong token S3 answers a bare 400
            (without_token, token, ("S3 refused access", "session_token for temporary ones")),
            (
                config,
                "not-the-token-Vb51",
                ("(HTTP 400): a wrong or expired session token", "delta.storage.session_token"),
            ),
        )
        for wrong, token_value, fragments in cases:
            monkeypatch.setenv(TOKEN, token_value)
            with pytest.raises(PgcdcError) as failure:
                snapshot_tables(wrong, lake_destination(engine.spark, wrong))
            one_line(failure.value, *fragments, secret=secret)
            assert token not in str(failure.value) and checking_store.objects(prefix) == []
        monkeypatch.setenv(TOKEN, token)
        snapshot_tables(config, lake_destination(engine.spark, config))
        pg.execute(PENDING)
        run_incremental(config, lake_destination(engine.spark, config))
    assert_exact(pg, config, storage_options=lake.object_store_options())
    assert tables_and_commits(checking_store.objects(prefix))


INSTANCE_METADATA_SERVER = """
import http.server, sys
served, log = sys.argv[1].encode(), open(sys.argv[2], "a", buffering=1)
roles = "/latest/meta-data/iam/security-credentials"

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # the clients keep their connection to the service

    def _answer(self, body):
        log.write(f"{self.command} {self.path}\\n")
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def do_PUT(self):
        self._answer(b"imds-session" if self.path == "/latest/api/token" else None)

    def do_GET(self):
        path = self.path.rstrip("/")
        self._answer(b"lake-role" if path == roles else served if path == roles + "/lake-role" else None)

    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


class InstanceMetadata:
    """The EC2 instance metadata service's credential endpoints (IMDSv2), serving one role's temporary
    credentials: what ``instance_credentials: true`` relies on. Records the paths asked for.

    In a process of its own: Arrow's AWS SDK asks it while building a filesystem, holding this process's
    GIL, so a server thread here could not answer and each of the SDK's attempts would wait out its
    one-second timeout."""

    def __init__(self, key: str, secret: str, token: str, log: Path) -> None:
        served = json.dumps({
            "Code": "Success", "Type": "AWS-HMAC", "AccessKeyId": key, "SecretAccessKey": secret, "Token": token,
            "LastUpdated": "2026-01-01T00:00:00Z", "Expiration": "2099-01-01T00:00:00Z",
        })  # fmt: skip
        self._log = log
        self._server = subprocess.Popen(
            [sys.executable, "-c", INSTANCE_METADATA_SERVER, served, str(log)], stdout=subprocess.PIPE, text=True
        )
        assert self._server.stdout is not None
        self.endpoint = f"http://127.0.0.1:{int(self._server.stdout.readline())}"

    @property
    def asked(self) -> list[str]:
        return self._log.read_text().splitlines() if self._log.exists() else []

    def close(self) -> None:
        self._server.kill()
        self._server.wait()


def test_instance_credentials_come_from_the_machine_and_no_key_pair_is_asked_for(
    checking_store: CheckingStore, credentials: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``delta.storage.instance_credentials: true``: with no key pair anywhere, pgcdc's preflight and delta-rs
    take a role's temporary credentials from the instance metadata service (a local one, named by the
    clients' own endpoint variables) and the store, which checks every signature, accepts them; nothing
    gives the clients a key pair. Without the setting, the preflight refuses in one line naming it."""
    for variable in ("AWS_SESSION_TOKEN", "AWS_EC2_METADATA_DISABLED"):
        monkeypatch.delenv(variable, raising=False)
    metadata = InstanceMetadata(*_assumed_role(checking_store), tmp_path / "metadata-asked.log")
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", metadata.endpoint)  # Arrow's AWS SDK
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", metadata.endpoint)  # object_store: delta-rs and Sail
    root = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    store = {"endpoint": checking_store.endpoint, "region": REGION, "allow_http": True}
    try:
        with pytest.raises(PgcdcError) as refused:
            LakeStorage(root, StorageSettings(**store)).check()
        one_line(refused.value, "no S3 credentials", "delta.storage.instance_credentials: true")
        lake = LakeStorage(root, StorageSettings(**store, instance_credentials=True))
        lake.check()
        options = lake.object_store_options()
        assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"} & set(options)
        deltalake.write_deltalake(f"{root}/public/t", pa.table({"id": [1, 2]}), storage_options=options)
        assert deltalake.DeltaTable(f"{root}/public/t", storage_options=options).to_pyarrow_table().num_rows == 2
    finally:
        metadata.close()
    assert "GET /latest/meta-data/iam/security-credentials/lake-role" in metadata.asked
    assert checking_store.objects(root.split("/", 3)[3])
