"""`pgcdc changes` end to end: the console script against real PostgreSQL 15 and 18 (what it decodes,
streamed and two-phase transactions, the errors PostgreSQL words by version), the newest only for what
reads the slot the same way in every version (advance, an end LSN, a slot in use).

These tests run the installed console script in a subprocess and assert its JSON
lines exactly, so they check the contract users (and the acceptance of the
replication core) rely on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from resources.lsn import LSN
from resources.testing.local_postgres import start_local_postgres
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase

pytestmark = pytest.mark.slow  # the CLI in child processes; tiers: docs/testing.md

PGCDC = str(Path(sys.executable).parent / "pgcdc")
BIG = "(SELECT string_agg(md5(g::text), '') FROM generate_series(1, 20000) g)"  # 640 kB, incompressible


def run_changes(dsn: str, *args: str, slot: str = "s", publication: str = "pub") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PGCDC, "changes", "--dsn", dsn, "--slot", slot, "--publication", publication, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def changes(dsn: str, *args: str, **kwargs: str) -> list[dict]:
    result = run_changes(dsn, *args, **kwargs)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return [json.loads(line) for line in result.stdout.splitlines()]


def confirmed_flush(pg: PgDatabase, slot: str = "s") -> LSN:
    ((lsn,),) = pg.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (slot,))
    return LSN.parse(lsn)


def xid(conn: psycopg.Connection) -> int:
    (value,) = conn.execute("SELECT txid_current()").fetchone()
    return int(value) & 0xFFFFFFFF


@pytest.fixture
def shop(pg: PgDatabase) -> PgDatabase:
    pg.execute(
        "CREATE TYPE mood AS ENUM ('ok', 'sad');"
        "CREATE TABLE items (id int PRIMARY KEY, name text, mood mood, blob text);"
        "CREATE TABLE audit (at int, note text);"
        "ALTER TABLE audit REPLICA IDENTITY FULL;"
        "CREATE PUBLICATION pub FOR TABLE items, audit;"
    )
    assert changes(pg.dsn, "--create-slot") == []
    return pg


def test_row_changes_print_exactly(shop: PgDatabase) -> None:
    with shop.connect() as conn:
        with conn.transaction():
            first_xid = xid(conn)
            conn.execute(f"INSERT INTO items VALUES (1, 'ünï', 'ok', {BIG}), (2, NULL, 'sad', 'b')")
        conn.execute("UPDATE items SET name = 'renamed' WHERE id = 1")  # blob stays an unchanged TOAST value
        conn.execute("UPDATE items SET id = 3 WHERE id = 2")  # key change: the old key is sent
        conn.execute("DELETE FROM items WHERE id = 3")
        conn.execute("INSERT INTO audit VALUES (7, 'x'); UPDATE audit SET note = 'y'")
        conn.execute("TRUNCATE items, audit RESTART IDENTITY")
        conn.execute("SELECT pg_logical_emit_message(true, 'pfx', 'héllo')")
        big = conn.execute(f"SELECT {BIG}").fetchone()[0]

    out = changes(shop.dsn, "--messages")
    rows = [
        {k: v for k, v in m.items() if k in ("type", "relation", "new", "key", "old", "unchanged")}
        for m in out
        if m["type"] in ("insert", "update", "delete")
    ]
    assert rows == [
        {"type": "insert", "relation": "public.items", "new": {"id": "1", "name": "ünï", "mood": "ok", "blob": big}},
        {"type": "insert", "relation": "public.items", "new": {"id": "2", "name": None, "mood": "sad", "blob": "b"}},
        {
            "type": "update",
            "relation": "public.items",
            "new": {"id": "1", "name": "renamed", "mood": "ok"},
            "unchanged": ["blob"],
        },
        {
            "type": "update",
            "relation": "public.items",
            "new": {"id": "3", "name": None, "mood": "sad", "blob": "b"},
            "key": {"id": "2"},
        },
        {"type": "delete", "relation": "public.items", "key": {"id": "3"}},
        {"type": "insert", "relation": "public.audit", "new": {"at": "7", "note": "x"}},
        {
            "type": "update",
            "relation": "public.audit",
            "new": {"at": "7", "note": "y"},
            "old": {"at": "7", "note": "x"},
        },
    ]
    kinds = [m["type"] for m in out]
    assert kinds[:5] == ["begin", "type", "relation", "insert", "insert"]
    begin, commit = out[0], out[kinds.index("commit")]
    assert begin["xid"] == first_xid
    assert begin["final_lsn"] == commit["commit_lsn"]
    assert LSN.parse(commit["end_lsn"]) > LSN.parse(commit["commit_lsn"])
    assert begin["commit_time"] == commit["commit_time"] and begin["commit_time"].endswith("+00:00")
    assert out[1] == {"type": "type", "lsn": "0/0", "oid": out[1]["oid"], "namespace": "public", "name": "mood"}
    relation = out[2]
    assert (relation["relation"], relation["replica_identity"]) == ("public.items", "d")
    assert [(c["name"], c["key"]) for c in relation["columns"]] == [
        ("id", True),
        ("name", False),
        ("mood", False),
        ("blob", False),
    ]
    (truncate,) = [m for m in out if m["type"] == "truncate"]
    assert sorted(truncate["relations"]) == ["public.audit", "public.items"]
    assert (truncate["cascade"], truncate["restart_identity"]) == (False, True)
    (message,) = [m for m in out if m["type"] == "message"]
    assert (message["prefix"], message["content"], message["transactional"]) == ("pfx", "héllo", True)
    assert all(LSN.parse(m["lsn"]) >= LSN(0) for m in out)


@NEWEST_POSTGRES_ONLY  # the slot's SQL functions, alike in every version
def test_reading_does_not_move_the_slot_and_advance_does(shop: PgDatabase) -> None:
    before = confirmed_flush(shop)
    shop.execute("INSERT INTO items VALUES (1, 'a', 'ok', 'x')")
    first = changes(shop.dsn)
    assert [m["type"] for m in first] == ["begin", "type", "relation", "insert", "commit"]
    assert confirmed_flush(shop) == before
    assert changes(shop.dsn) == first  # the same changes again: nothing was confirmed

    ((end,),) = shop.execute("SELECT pg_current_wal_lsn()::text")
    advanced = run_changes(shop.dsn, "--advance")
    assert advanced.returncode == 0, advanced.stderr
    assert [json.loads(line) for line in advanced.stdout.splitlines()] == first
    moved = confirmed_flush(shop)
    assert advanced.stderr == (
        f'pgcdc: warning: moving replication slot "s" from {before} to {moved}: if a pgcdc pipeline drains this'
        " slot, these changes never reach its Delta tables and its next drain refuses until every table is"
        " re-snapshotted (the pgcdc_resnapshot job with no table list)\n"
    )
    assert confirmed_flush(shop) >= LSN.parse(first[-1]["end_lsn"])
    assert confirmed_flush(shop) >= LSN.parse(end)
    assert changes(shop.dsn) == []


@NEWEST_POSTGRES_ONLY
def test_end_lsn_stops_at_a_transaction_boundary(shop: PgDatabase) -> None:
    shop.execute("INSERT INTO items VALUES (1, 'a', 'ok', 'x')")
    ((between,),) = shop.execute("SELECT pg_current_wal_lsn()::text")
    shop.execute("INSERT INTO items VALUES (2, 'b', 'ok', 'y')")
    out = changes(shop.dsn, "--end-lsn", between)
    assert [m["new"]["id"] for m in out if m["type"] == "insert"] == ["1"]
    assert len(changes(shop.dsn)) > len(out)


def test_streamed_transactions_carry_xids(shop: PgDatabase) -> None:
    with shop.connect() as conn:
        with conn.transaction():
            streamed_xid = xid(conn)
            conn.execute("INSERT INTO items SELECT g, 'n' || g, 'ok', 'b' FROM generate_series(1, 3000) g")
    out = changes(shop.dsn, "--streaming")
    kinds = [m["type"] for m in out]
    assert "begin" not in kinds and kinds[0] == "stream_start" and kinds[-1] == "stream_commit"
    inserts = [m for m in out if m["type"] == "insert"]
    assert [m["new"]["id"] for m in inserts] == [str(g) for g in range(1, 3001)]
    assert {m["xid"] for m in out if m["type"] in ("insert", "stream_start", "stream_commit")} == {streamed_xid}
    assert out[0]["first_segment"] is True
    assert kinds.count("stream_start") == kinds.count("stream_stop") > 1


def test_aborted_streamed_transaction_prints_stream_abort(shop: PgDatabase) -> None:
    # Streamed while open, aborted, then read: PostgreSQL 16+ skips transactions it finds
    # already aborted unless told to stream at once, which a session option does.
    dsn = shop.dsn + ("?options=-c%20debug_logical_replication_streaming%3Dimmediate" if shop.major >= 16 else "")
    with shop.connect() as conn:
        conn.execute("BEGIN")
        aborted_xid = xid(conn)
        conn.execute("INSERT INTO items SELECT g, 'n', 'ok', 'b' FROM generate_series(1, 3000) g")
        ((end,),) = shop.execute("SELECT pg_current_wal_lsn()::text")
        conn.execute("ROLLBACK")
    ((after,),) = shop.execute("SELECT pg_current_wal_lsn()::text")
    assert LSN.parse(after) >= LSN.parse(end)
    shop.execute("INSERT INTO items VALUES (9, 'after', 'ok', 'x')")
    out = changes(dsn, "--streaming")
    aborts = [m for m in out if m["type"] == "stream_abort"]
    assert [(a["xid"], a["subxid"]) for a in aborts] == [(aborted_xid, aborted_xid)]
    # With immediate streaming (16+) even the small transaction arrives streamed, under its own xid.
    assert [m["new"]["id"] for m in out if m["type"] == "insert" and m.get("xid") != aborted_xid] == ["9"]


def test_two_phase_transactions(pg: PgDatabase) -> None:
    pg.execute("CREATE TABLE items (id int PRIMARY KEY); CREATE PUBLICATION pub FOR TABLE items")
    assert changes(pg.dsn, "--create-slot", "--two-phase") == []
    with pg.connect() as conn:
        conn.execute("BEGIN")
        prepared_xid = xid(conn)
        conn.execute("INSERT INTO items VALUES (1); PREPARE TRANSACTION 'gid-1'")
        conn.execute("COMMIT PREPARED 'gid-1'")
        conn.execute("BEGIN; INSERT INTO items VALUES (2); PREPARE TRANSACTION 'gid-2'")
        conn.execute("ROLLBACK PREPARED 'gid-2'")
    out = changes(pg.dsn, "--two-phase")
    kinds = [m["type"] for m in out]
    assert kinds == [
        "begin_prepare",
        "relation",
        "insert",
        "prepare",
        "commit_prepared",
        "begin_prepare",
        "insert",
        "prepare",
        "rollback_prepared",
    ]
    assert [m["gid"] for m in out if "gid" in m] == ["gid-1"] * 3 + ["gid-2"] * 3
    assert out[0]["xid"] == prepared_xid


# -------------------------------------------------------------------- errors: one line, exit 2


def assert_fails(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_bad_input_is_one_line_with_the_fix(shop: PgDatabase) -> None:
    before = confirmed_flush(shop)
    assert_fails(run_changes(shop.dsn, publication="nope"), 'publication "nope" does not exist', "CREATE PUBLICATION")
    assert_fails(run_changes(shop.dsn, slot="missing"), 'slot "missing" does not exist', "--create-slot")
    assert_fails(run_changes("host=127.0.0.1 port=1 dbname=x"), "cannot reach PostgreSQL", "check host, port")
    assert_fails(run_changes("not a dsn"), "invalid connection string")
    assert_fails(run_changes(shop.dsn.replace(shop.name, "no_such_db")), "database", "fix dbname")

    shop.execute("SELECT pg_create_logical_replication_slot('other', 'test_decoding')")
    assert_fails(run_changes(shop.dsn, slot="other"), "output plugin 'test_decoding'", "pgoutput")

    shop.execute("CREATE ROLE plain LOGIN")
    plain = shop.server.dsn(shop.name, user="plain")
    assert_fails(run_changes(plain), "REPLICATION")
    assert confirmed_flush(shop) == before


@NEWEST_POSTGRES_ONLY
def test_slot_in_use_fails_fast(shop: PgDatabase) -> None:
    holder = subprocess.Popen(
        [PGCDC, "changes", "--dsn", shop.dsn, "--slot", "s", "--publication", "pub", "--end-lsn", "FFFFFFFF/0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(200):
            if shop.execute("SELECT active FROM pg_replication_slots WHERE slot_name = 's'") == [(True,)]:
                break
            subprocess.run(["sleep", "0.05"], check=True)
        assert_fails(run_changes(shop.dsn), 'slot "s" is in use by PID', "stop the other consumer")
    finally:
        holder.kill()
        holder.wait()


@pytest.fixture(scope="module")
def replica_level_server() -> Iterator[str]:
    server = start_local_postgres(15, {"wal_level": "replica"})
    try:
        yield server.dsn()
    finally:
        server.destroy()


def test_wal_level_not_logical(replica_level_server: str) -> None:
    assert_fails(
        run_changes(replica_level_server, "--create-slot"), "wal_level is 'replica'", "ALTER SYSTEM SET wal_level"
    )
