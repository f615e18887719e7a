"""pgoutput decoder: raw bytes from real PostgreSQL 15 and 18, plus crafted bytes for every layout.

The live tests read the slot with ``pg_logical_slot_peek_binary_changes`` (no
streaming client involved), decode every row and check the decoded fields
exactly against what the workload did.
"""

from __future__ import annotations

import struct
from datetime import datetime, timedelta, timezone

import psycopg
import pytest

from resources.errors import ProtocolError
from resources.lsn import LSN
from resources.pgoutput.decoder import PgOutputDecoder
from resources.pgoutput.messages import (
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    Message,
    Origin,
    pg_timestamp,
    Prepare,
    Relation,
    RelationColumn,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    Type,
    UNCHANGED_TOAST,
    Update,
)
from resources.pgoutput.relations import RelationCache, TypeCache
from tests.support.postgres import PgDatabase

INT4, INT8, TEXT = 23, 20, 25

# --------------------------------------------------------------------------- live helpers


def proto_version(pg: PgDatabase) -> int:
    """Highest pgoutput protocol the server speaks: 4 since PostgreSQL 16, 3 on 14/15."""
    return 4 if pg.major >= 16 else 3


def make_slot(pg: PgDatabase) -> None:
    pg.execute("CREATE PUBLICATION pub FOR ALL TABLES")
    pg.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput', false, true)")


def peek(
    pg: PgDatabase, *, streaming: str = "on", proto: int | None = None, immediate: bool = False
) -> tuple[PgOutputDecoder, list]:
    """Decode every pending change of slot 's'; each message's wal_start must be the row's lsn."""
    proto = proto or proto_version(pg)
    options = ["proto_version", str(proto), "publication_names", "pub", "messages", "true"]
    options += ["streaming", streaming, "binary", "false", "two_phase", "on"]
    if pg.major >= 16:
        options += ["origin", "any"]
    flush_wal(pg)
    placeholders = ", ".join(["%s"] * len(options))
    with pg.connect() as conn:
        if immediate:  # stream every change at once (PostgreSQL 16+; a developer option)
            conn.execute("SET debug_logical_replication_streaming = immediate")
        rows = conn.execute(
            f"SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes('s', NULL, NULL, {placeholders})",
            options,
        ).fetchall()
    decoder = PgOutputDecoder(proto)
    messages = []
    for lsn, data in rows:
        message = decoder.decode(data, LSN.parse(lsn))
        assert message.wal_start == LSN.parse(lsn)
        messages.append(message)
    assert not decoder.in_stream
    return decoder, messages


def flush_wal(pg: PgDatabase) -> None:
    """Flush all WAL written so far: the SQL interface decodes only flushed WAL.

    The test servers run with synchronous_commit=off and the WAL writer leaves the
    last partial page of an open transaction unflushed; a synchronous commit that
    wrote WAL (here: catalog rows of a temporary table) flushes everything before it.
    pgoutput sends nothing for this transaction.
    """
    with pg.connect() as conn, conn.transaction():
        conn.execute("SET LOCAL synchronous_commit = on")
        conn.execute("CREATE TEMPORARY TABLE flush_wal () ON COMMIT DROP")


def xid_of(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT txid_current() & 4294967295").fetchone()[0]


def oid_of(pg: PgDatabase, name: str) -> int:
    return pg.execute("SELECT %s::regclass::oid::int", (name,))[0][0]


def kinds(messages: list) -> list[str]:
    return [type(m).__name__ for m in messages]


def assert_transaction_frame(begin: Begin, body: list, commit: Commit, xid: int) -> None:
    """Begin/Commit agree with each other, with the xid, and enclose the body's LSNs."""
    assert begin.xid == xid
    assert begin.final_lsn == commit.commit_lsn
    assert begin.commit_time == commit.commit_time
    assert commit.flags == 0
    assert commit.end_lsn > commit.commit_lsn
    assert commit.wal_start == commit.end_lsn
    assert begin.commit_time.tzinfo is timezone.utc
    assert abs(datetime.now(timezone.utc) - begin.commit_time) < timedelta(minutes=5)
    lsns = [begin.wal_start, *(m.wal_start for m in body)]
    assert lsns == sorted(lsns)
    # A change is reported at its record's start, a logical message at its record's end,
    # which can be where the commit record starts.
    assert lsns[-1] <= commit.commit_lsn


def tup(*values: object) -> TupleData:
    return TupleData(tuple(values), False)


# --------------------------------------------------------------------------- live: plain transactions


def test_insert_update_delete_with_default_identity(pg: PgDatabase) -> None:
    pg.execute("CREATE TABLE items (id int PRIMARY KEY, label text, qty int)")
    make_slot(pg)
    with pg.connect() as conn, conn.transaction():
        xid = xid_of(conn)
        conn.execute("INSERT INTO items VALUES (1, 'apple', NULL), (2, 'pear', 7)")
        conn.execute("UPDATE items SET qty = 3 WHERE id = 1")  # key unchanged: no old tuple
        conn.execute("UPDATE items SET id = 10, label = 'fig' WHERE id = 2")  # key changed: 'K' tuple
        conn.execute("DELETE FROM items WHERE id = 1")
    oid = oid_of(pg, "items")

    decoder, messages = peek(pg)
    assert kinds(messages) == ["Begin", "Relation", "Insert", "Insert", "Update", "Update", "Delete", "Commit"]
    begin, relation, ins1, ins2, upd1, upd2, delete, commit = messages
    assert_transaction_frame(begin, messages[1:-1], commit, xid)
    assert relation == Relation(
        relation.wal_start,
        None,
        oid,
        "public",
        "items",
        "d",
        (
            RelationColumn(1, "id", INT4, -1),
            RelationColumn(0, "label", TEXT, -1),
            RelationColumn(0, "qty", INT4, -1),
        ),
    )
    assert relation.wal_start == ins1.wal_start  # sent in the first change's callback
    assert [c.is_key for c in relation.columns] == [True, False, False]
    assert ins1 == Insert(ins1.wal_start, None, oid, tup(b"1", b"apple", None))
    assert ins2 == Insert(ins2.wal_start, None, oid, tup(b"2", b"pear", b"7"))
    assert upd1 == Update(upd1.wal_start, None, oid, None, None, tup(b"1", b"apple", b"3"))
    assert upd2 == Update(upd2.wal_start, None, oid, tup(b"2", None, None), None, tup(b"10", b"fig", b"7"))
    assert delete == Delete(delete.wal_start, None, oid, tup(b"1", None, None), None)
    assert decoder.relations.get(oid) == relation
    assert len(decoder.types) == 0


def test_replica_identity_full_sends_old_tuples(pg: PgDatabase) -> None:
    pg.execute("CREATE TABLE ledger (id int, note text); ALTER TABLE ledger REPLICA IDENTITY FULL")
    pg.execute("INSERT INTO ledger VALUES (1, 'a'), (2, NULL)")
    make_slot(pg)
    with pg.connect() as conn, conn.transaction():
        xid = xid_of(conn)
        conn.execute("UPDATE ledger SET note = 'b' WHERE id = 1")
        conn.execute("DELETE FROM ledger WHERE id = 2")
    oid = oid_of(pg, "ledger")

    _, messages = peek(pg)
    assert kinds(messages) == ["Begin", "Relation", "Update", "Delete", "Commit"]
    begin, relation, update, delete, commit = messages
    assert_transaction_frame(begin, messages[1:-1], commit, xid)
    assert relation.replica_identity == "f"
    assert relation.columns == (RelationColumn(1, "id", INT4, -1), RelationColumn(1, "note", TEXT, -1))
    assert update == Update(update.wal_start, None, oid, None, tup(b"1", b"a"), tup(b"1", b"b"))
    assert delete == Delete(delete.wal_start, None, oid, None, tup(b"2", None))


def test_changed_relation_replaces_the_cached_one(pg: PgDatabase) -> None:
    pg.execute("CREATE TABLE grow (id bigint PRIMARY KEY)")
    make_slot(pg)
    pg.execute("INSERT INTO grow VALUES (1)")
    pg.execute("ALTER TABLE grow ADD COLUMN price numeric(10, 2)")
    pg.execute("INSERT INTO grow VALUES (2, 9.5)")
    oid = oid_of(pg, "grow")

    decoder, messages = peek(pg)
    relations = [m for m in messages if isinstance(m, Relation)]
    inserts = [m for m in messages if isinstance(m, Insert)]
    assert len(relations) == 2
    assert relations[0].columns == (RelationColumn(1, "id", INT8, -1),)
    numeric_typmod = ((10 << 16) | 2) + 4
    assert relations[1].columns == (RelationColumn(1, "id", INT8, -1), RelationColumn(0, "price", 1700, numeric_typmod))
    assert relations[0].oid == relations[1].oid == oid
    assert [i.new for i in inserts] == [tup(b"1"), tup(b"2", b"9.50")]
    assert decoder.relations.get(oid) is relations[1]
    assert len(decoder.relations) == 1


def test_user_types_send_type_messages(pg: PgDatabase) -> None:
    pg.execute("CREATE TYPE mood AS ENUM ('sad', 'happy')")
    pg.execute("CREATE DOMAIN short_text AS text CHECK (length(VALUE) < 10)")
    pg.execute("CREATE TABLE diary (id int PRIMARY KEY, m mood, s short_text)")
    make_slot(pg)
    pg.execute("INSERT INTO diary VALUES (1, 'happy', 'hi')")
    mood_oid = pg.execute("SELECT 'mood'::regtype::oid::int")[0][0]
    domain_oid = pg.execute("SELECT 'short_text'::regtype::oid::int")[0][0]

    decoder, messages = peek(pg)
    assert kinds(messages) == ["Begin", "Type", "Type", "Relation", "Insert", "Commit"]
    mood, domain = messages[1], messages[2]
    assert mood == Type(mood.wal_start, None, mood_oid, "public", "mood")
    # A domain is described by its own oid with the name of its base type.
    assert domain == Type(domain.wal_start, None, domain_oid, "pg_catalog", "text")
    assert [c.type_oid for c in messages[3].columns] == [INT4, mood_oid, domain_oid]
    assert messages[4].new == tup(b"1", b"happy", b"hi")
    assert decoder.types.get(mood_oid) == mood
    assert decoder.types.get(INT4) is None


def test_truncate_flags_and_relations(pg: PgDatabase) -> None:
    pg.execute("CREATE TABLE parent (id serial PRIMARY KEY)")
    pg.execute("CREATE TABLE child (id int PRIMARY KEY, parent_id int REFERENCES parent)")
    pg.execute("CREATE TABLE solo (id int PRIMARY KEY)")
    pg.execute("INSERT INTO parent DEFAULT VALUES; INSERT INTO child VALUES (1, 1); INSERT INTO solo VALUES (1)")
    make_slot(pg)
    with pg.connect() as conn, conn.transaction():
        xid = xid_of(conn)
        conn.execute("TRUNCATE parent RESTART IDENTITY CASCADE")
    pg.execute("TRUNCATE solo")
    parent, child, solo = (oid_of(pg, n) for n in ("parent", "child", "solo"))

    _, messages = peek(pg)
    assert kinds(messages) == ["Begin", "Relation", "Relation", "Truncate", "Commit"] + [
        "Begin", "Relation", "Truncate", "Commit"
    ]  # fmt: skip
    begin, rel1, rel2, truncate, commit = messages[:5]
    assert_transaction_frame(begin, messages[1:4], commit, xid)
    assert {rel1.name, rel2.name} == {"parent", "child"}
    assert truncate.xid is None
    assert sorted(truncate.relation_oids) == sorted([parent, child])
    assert (truncate.cascade, truncate.restart_identity) == (True, True)
    assert messages[7] == Truncate(messages[7].wal_start, None, (solo,), False, False)


def test_logical_messages(pg: PgDatabase) -> None:
    make_slot(pg)
    with pg.connect() as conn:
        (plain_lsn,) = conn.execute("SELECT pg_logical_emit_message(false, 'pfx/plain', 'hello')::text").fetchone()
        with conn.transaction():
            xid = xid_of(conn)
            (txn_lsn,) = conn.execute(
                "SELECT pg_logical_emit_message(true, 'pfx/txn', '\\x00ff10'::bytea)::text"
            ).fetchone()

    _, messages = peek(pg)
    assert kinds(messages) == ["Message", "Begin", "Message", "Commit"]
    plain, begin, txn, commit = messages
    assert plain == Message(plain.wal_start, None, False, LSN.parse(plain_lsn), "pfx/plain", b"hello")
    assert plain.wal_start == plain.lsn
    assert txn == Message(txn.wal_start, None, True, LSN.parse(txn_lsn), "pfx/txn", b"\x00\xff\x10")
    assert_transaction_frame(begin, [txn], commit, xid)


def test_unchanged_toast_value(pg: PgDatabase) -> None:
    pg.execute("CREATE TABLE docs (id int PRIMARY KEY, body text, hits int)")
    pg.execute("ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL")
    make_slot(pg)
    pg.execute("INSERT INTO docs SELECT 1, string_agg(md5(random()::text), '') , 0 FROM generate_series(1, 12000)")
    pg.execute("UPDATE docs SET hits = 1 WHERE id = 1")
    ((body,),) = pg.execute("SELECT body FROM docs")
    assert len(body) == 12000 * 32

    _, messages = peek(pg)
    # The insert of a few hundred kB exceeds logical_decoding_work_mem (64kB), so it is streamed.
    assert kinds(messages)[-3:] == ["Begin", "Update", "Commit"]
    (insert,) = [m for m in messages if isinstance(m, Insert)]
    update = messages[-2]
    assert insert.new == tup(b"1", body.encode(), b"0")
    assert update.key is None and update.old is None
    assert update.new == tup(b"1", UNCHANGED_TOAST, b"1")
    assert update.new.values[1] is UNCHANGED_TOAST


def test_origin_message(pg: PgDatabase) -> None:
    pg.execute("CREATE TABLE replicated (id int PRIMARY KEY)")
    make_slot(pg)
    with pg.connect() as conn:
        conn.execute("SELECT pg_replication_origin_create('upstream')")
        conn.execute("SELECT pg_replication_origin_session_setup('upstream')")
        with conn.transaction():
            xid = xid_of(conn)
            conn.execute("SELECT pg_replication_origin_xact_setup('0/ABCDEF', now())")
            conn.execute("INSERT INTO replicated VALUES (1)")
        conn.execute("SELECT pg_replication_origin_session_reset()")
    try:
        _, messages = peek(pg)
    finally:
        pg.execute("SELECT pg_replication_origin_drop('upstream')")
    assert kinds(messages) == ["Begin", "Origin", "Relation", "Insert", "Commit"]
    begin, origin, _, insert, commit = messages
    assert_transaction_frame(begin, messages[1:-1], commit, xid)
    assert origin == Origin(origin.wal_start, LSN.parse("0/ABCDEF"), "upstream")
    assert insert.new == tup(b"1")


# --------------------------------------------------------------------------- live: streaming

ROWS = 5000


def split_streams(messages: list) -> list[list]:
    """Group the messages of each Stream Start ... Stream Stop block (other messages form their own groups)."""
    groups: list[list] = []
    current: list | None = None
    for message in messages:
        if isinstance(message, StreamStart):
            current = [message]
        elif isinstance(message, StreamStop):
            assert current is not None
            current.append(message)
            groups.append(current)
            current = None
        elif current is not None:
            current.append(message)
        else:
            groups.append([message])
    assert current is None
    return groups


def assert_streamed(messages: list, xid: int, rows_xids: set[int], min_blocks: int = 2) -> list[Insert]:
    """The stream blocks of ``xid``: first_segment on the first only, every change tagged with a streamed xid."""
    starts = [m for m in messages if isinstance(m, StreamStart)]
    assert len(starts) >= min_blocks  # a few thousand rows do not fit in 64kB
    assert [s.first_segment for s in starts] == [True] + [False] * (len(starts) - 1)
    assert {s.xid for s in starts} == {xid}
    inserts = [m for m in messages if isinstance(m, Insert)]
    assert {i.xid for i in inserts} <= rows_xids
    relations = [m for m in messages if isinstance(m, Relation)]
    assert relations and all(r.xid in rows_xids for r in relations)
    assert not any(isinstance(m, (Begin, Commit)) for m in messages)
    return inserts


def test_streamed_transaction_commit(pg: PgDatabase) -> None:
    pg.execute("CREATE TABLE bulk (id int PRIMARY KEY, payload text)")
    make_slot(pg)
    with pg.connect() as conn, conn.transaction():
        xid = xid_of(conn)
        conn.execute(f"INSERT INTO bulk SELECT g, 'row-' || g FROM generate_series(1, {ROWS}) g")

    _, messages = peek(pg)
    inserts = assert_streamed(messages, xid, {xid})
    assert [i.new for i in inserts] == [tup(str(g).encode(), f"row-{g}".encode()) for g in range(1, ROWS + 1)]
    commit = messages[-1]
    assert isinstance(commit, StreamCommit)
    assert (commit.xid, commit.flags) == (xid, 0)
    assert commit.end_lsn > commit.commit_lsn > inserts[-1].wal_start
    assert commit.wal_start == commit.end_lsn
    assert commit.commit_time.tzinfo is timezone.utc


def stream_then_abort(pg: PgDatabase, streaming: str) -> tuple[int, datetime, list, list]:
    """A big transaction decoded while still open (so it streams), then rolled back and decoded again.

    Decoded after the fact, an aborted transaction streams no changes: the server
    notices the abort at the first catalog lookup and closes the block early.
    """
    pg.execute("CREATE TABLE bulk (id int PRIMARY KEY)")
    make_slot(pg)
    with pg.connect() as conn:
        conn.execute("BEGIN")
        xid = xid_of(conn)
        (started,) = conn.execute("SELECT now()").fetchone()
        conn.execute(f"INSERT INTO bulk SELECT generate_series(1, {ROWS})")
        _, in_progress = peek(pg, streaming=streaming)
        conn.execute("ROLLBACK")
    pg.execute("SELECT pg_logical_emit_message(false, 'after', '')")
    # PostgreSQL 18 skips (truncates) transactions it finds already aborted instead of
    # streaming them, unless changes are streamed immediately.
    # Immediate streaming also streams the other transactions (as empty stream blocks).
    _, after_abort = peek(pg, streaming=streaming, immediate=pg.major >= 18)
    return xid, started, in_progress, after_abort


def assert_in_progress_stream(in_progress: list, xid: int) -> None:
    inserts = assert_streamed(in_progress, xid, {xid})
    assert isinstance(in_progress[-1], StreamStop)
    assert [i.new for i in inserts] == [tup(str(g).encode()) for g in range(1, len(inserts) + 1)]
    assert 0 < len(inserts) <= ROWS


def test_streamed_transaction_abort(pg: PgDatabase) -> None:
    xid, _, in_progress, after_abort = stream_then_abort(pg, "on")
    assert_in_progress_stream(in_progress, xid)
    abort = the_abort(after_abort, xid)
    assert abort == StreamAbort(abort.wal_start, xid, xid, None, None)


def the_abort(after_abort: list, xid: int) -> StreamAbort:
    """The one Stream Abort, preceded by stream blocks of ``xid`` and followed by the 'after' message."""
    (index,) = [i for i, m in enumerate(after_abort) if isinstance(m, StreamAbort)]
    streamed = [m for m in after_abort[:index] if getattr(m, "xid", None) == xid]
    assert streamed and isinstance(streamed[0], StreamStart) and streamed[0].first_segment
    assert {type(m) for m in streamed} <= {StreamStart, Relation, Insert}
    (message,) = [m for m in after_abort if isinstance(m, Message)]
    assert message.prefix == "after" and message.wal_start > after_abort[index].wal_start
    return after_abort[index]


def test_streamed_subtransaction_abort(pg: PgDatabase) -> None:
    pg.execute("CREATE TABLE bulk (id int PRIMARY KEY)")
    make_slot(pg)
    with pg.connect() as conn:
        conn.execute("BEGIN")
        xid = xid_of(conn)
        conn.execute(f"INSERT INTO bulk SELECT generate_series(1, {ROWS})")
        conn.execute("SAVEPOINT sp")
        conn.execute(f"INSERT INTO bulk SELECT generate_series({ROWS} + 1, {2 * ROWS})")
        (subxid,) = conn.execute("SELECT xmin::text::bigint FROM bulk WHERE id = %s", (ROWS + 1,)).fetchone()
        conn.execute("ROLLBACK TO SAVEPOINT sp")
        conn.execute("INSERT INTO bulk VALUES (0)")  # in a new subtransaction: the savepoint still exists
        (subxid2,) = conn.execute("SELECT xmin::text::bigint FROM bulk WHERE id = 0").fetchone()
        conn.execute("COMMIT")
    assert len({xid, subxid, subxid2}) == 3

    _, messages = peek(pg)
    aborts = [m for m in messages if isinstance(m, StreamAbort)]
    assert aborts == [StreamAbort(aborts[0].wal_start, xid, subxid, None, None)]
    inserts = assert_streamed(messages, xid, {xid, subxid, subxid2})
    assert {i.xid for i in inserts} == {xid, subxid, subxid2}
    assert all((int(i.new.values[0]) > ROWS) == (i.xid == subxid) for i in inserts if i.new.values[0] != b"0")
    assert inserts[-1].new == tup(b"0") and inserts[-1].xid == subxid2
    commit = messages[-1]
    assert isinstance(commit, StreamCommit) and commit.xid == xid


def test_parallel_streaming_abort_carries_abort_lsn(pg: PgDatabase) -> None:
    if pg.major < 16:
        # streaming = parallel and protocol 4 exist since PostgreSQL 16: older servers refuse them.
        pg.execute("CREATE TABLE bulk (id int PRIMARY KEY)")
        make_slot(pg)
        with pytest.raises(psycopg.errors.SyntaxError, match="streaming requires a Boolean value"):
            peek(pg, streaming="parallel", proto=3)
        return
    xid, started, in_progress, after_abort = stream_then_abort(pg, "parallel")
    assert_in_progress_stream(in_progress, xid)
    abort = the_abort(after_abort, xid)
    assert (abort.xid, abort.subxid) == (xid, xid)
    assert abort.abort_lsn is not None and abort.abort_lsn > max(m.wal_start for m in in_progress)
    assert abort.wal_start == abort.abort_lsn
    assert abort.abort_time is not None and started <= abort.abort_time <= datetime.now(timezone.utc)


# --------------------------------------------------------------------------- live: two-phase commit


def test_two_phase_commit_and_rollback(pg: PgDatabase) -> None:
    pg.execute("CREATE TABLE tp (id int PRIMARY KEY)")
    make_slot(pg)
    xids = {}
    with pg.connect() as conn:
        for gid, row in (("g-commit", 1), ("g-rollback", 2)):
            conn.execute("BEGIN")
            xids[gid] = xid_of(conn)
            conn.execute("INSERT INTO tp VALUES (%s)", (row,))
            conn.execute(f"PREPARE TRANSACTION '{gid}'")
        conn.execute("COMMIT PREPARED 'g-commit'")
        conn.execute("ROLLBACK PREPARED 'g-rollback'")

    _, messages = peek(pg)
    assert kinds(messages) == [
        "BeginPrepare", "Relation", "Insert", "Prepare",
        "BeginPrepare", "Insert", "Prepare",
        "CommitPrepared", "RollbackPrepared",
    ]  # fmt: skip
    bp1, _, ins1, prep1, bp2, ins2, prep2, commit, rollback = messages
    for bp, prep, gid in ((bp1, prep1, "g-commit"), (bp2, prep2, "g-rollback")):
        assert (bp.xid, bp.gid, prep.xid, prep.gid) == (xids[gid], gid, xids[gid], gid)
        assert (prep.prepare_lsn, prep.end_lsn, prep.prepare_time) == (bp.prepare_lsn, bp.end_lsn, bp.prepare_time)
        assert prep.flags == 0 and prep.end_lsn > prep.prepare_lsn
        assert prep.wal_start == prep.end_lsn
        assert prep.prepare_time.tzinfo is timezone.utc
    assert (ins1.new, ins2.new) == (tup(b"1"), tup(b"2"))
    assert (commit.flags, commit.xid, commit.gid) == (0, xids["g-commit"], "g-commit")
    assert commit.end_lsn > commit.commit_lsn >= prep2.end_lsn
    assert commit.commit_time >= prep1.prepare_time
    assert rollback == RollbackPrepared(
        rollback.wal_start,
        0,
        prep2.end_lsn,
        rollback.rollback_end_lsn,
        prep2.prepare_time,
        rollback.rollback_time,
        xids["g-rollback"],
        "g-rollback",
    )
    assert rollback.rollback_end_lsn > commit.end_lsn
    assert rollback.rollback_time >= commit.commit_time


def test_stream_prepare(pg: PgDatabase) -> None:
    pg.execute("CREATE TABLE bulk (id int PRIMARY KEY)")
    make_slot(pg)
    with pg.connect() as conn:
        conn.execute("BEGIN")
        xid = xid_of(conn)
        conn.execute(f"INSERT INTO bulk SELECT generate_series(1, {ROWS})")
        conn.execute("PREPARE TRANSACTION 'big'")
        conn.execute("COMMIT PREPARED 'big'")

    _, messages = peek(pg)
    prepare, commit = messages[-2:]
    assert isinstance(prepare, StreamPrepare)
    assert (prepare.flags, prepare.xid, prepare.gid) == (0, xid, "big")
    assert prepare.end_lsn > prepare.prepare_lsn
    assert isinstance(commit, CommitPrepared)
    assert (commit.xid, commit.gid) == (xid, "big")
    inserts = assert_streamed(messages[:-2], xid, {xid})
    assert [i.new for i in inserts] == [tup(str(g).encode()) for g in range(1, ROWS + 1)]


# --------------------------------------------------------------------------- crafted bytes

AT = LSN.parse("0/16B3748")
T0 = 789_000_000_123_456  # microseconds since 2000-01-01
T0_DT = datetime(2000, 1, 1, tzinfo=timezone.utc) + timedelta(microseconds=T0)


def cstr(text: str) -> bytes:
    return text.encode() + b"\0"


def tuple_bytes(*columns: bytes | None | object, binary: bool = False) -> bytes:
    out = struct.pack(">H", len(columns))
    for value in columns:
        if value is None:
            out += b"n"
        elif value is UNCHANGED_TOAST:
            out += b"u"
        else:
            out += (b"b" if binary else b"t") + struct.pack(">i", len(value)) + value
    return out


def relation_bytes(oid: int = 16384, xid: int | None = None) -> bytes:
    head = b"R" + (struct.pack(">I", xid) if xid is not None else b"")
    return (
        head
        + struct.pack(">I", oid)
        + cstr("sales")
        + cstr("orders")
        + b"i"
        + struct.pack(">H", 2)
        + b"\x01" + cstr("id") + struct.pack(">Ii", INT8, -1)
        + b"\x00" + cstr("note") + struct.pack(">Ii", 1043, 36)
    )  # fmt: skip


def decoder_with_relation(proto: int = 4) -> PgOutputDecoder:
    decoder = PgOutputDecoder(proto)
    decoder.decode(relation_bytes(), AT)
    return decoder


def test_pg_timestamp() -> None:
    assert pg_timestamp(0) == datetime(2000, 1, 1, tzinfo=timezone.utc)
    assert pg_timestamp(T0) == T0_DT
    assert pg_timestamp(-1) == datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=timezone.utc)


@pytest.mark.parametrize("proto", [1, 2, 3, 4])
def test_crafted_transaction_messages(proto: int) -> None:
    d = PgOutputDecoder(proto)
    assert d.decode(b"B" + struct.pack(">QqI", 0x1_0000_0010, T0, 77), AT) == Begin(AT, LSN(0x1_0000_0010), T0_DT, 77)
    assert d.decode(b"C" + struct.pack(">BQQq", 0, 10, 20, T0), AT) == Commit(AT, 0, LSN(10), LSN(20), T0_DT)
    assert d.decode(b"O" + struct.pack(">Q", 5) + cstr("up"), AT) == Origin(AT, LSN(5), "up")
    message = b"M" + struct.pack(">BQ", 1, 99) + cstr("p") + struct.pack(">I", 3) + b"a\0b"
    assert d.decode(message, AT) == Message(AT, None, True, LSN(99), "p", b"a\0b")
    empty = b"M" + struct.pack(">BQ", 0, 99) + cstr("") + struct.pack(">I", 0)
    assert d.decode(empty, AT) == Message(AT, None, False, LSN(99), "", b"")


def test_crafted_relation_type_and_caches() -> None:
    d = PgOutputDecoder(1)
    relation = d.decode(relation_bytes(), AT)
    assert relation == Relation(
        AT,
        None,
        16384,
        "sales",
        "orders",
        "i",
        (RelationColumn(1, "id", INT8, -1), RelationColumn(0, "note", 1043, 36)),
    )
    assert relation.column_names == ("id", "note")
    type_message = d.decode(b"Y" + struct.pack(">I", 90000) + cstr("") + cstr("int4"), AT)
    assert type_message == Type(AT, None, 90000, "pg_catalog", "int4")
    assert d.relations.get(16384) is relation and d.types.get(90000) is type_message
    with pytest.raises(ProtocolError, match="at 0/16B3748 names relation oid 1,"):
        d.relations.get(1, AT)

    cache = RelationCache()
    cache.update(relation)
    assert 16384 in cache and len(cache) == 1
    cache.clear()
    assert len(cache) == 0
    types = TypeCache()
    types.update(type_message)
    assert types.get(90000) is type_message and types.get(1) is None


def test_crafted_dml_messages() -> None:
    d = decoder_with_relation(1)
    rel = struct.pack(">I", 16384)
    insert = d.decode(b"I" + rel + b"N" + tuple_bytes(b"1", None), AT)
    assert insert == Insert(AT, None, 16384, TupleData((b"1", None), False))
    binary = d.decode(b"I" + rel + b"N" + tuple_bytes(b"\x00\x01", b"", binary=True), AT)
    assert binary.new == TupleData((b"\x00\x01", b""), True)
    update = d.decode(b"U" + rel + b"N" + tuple_bytes(b"1", UNCHANGED_TOAST), AT)
    assert update == Update(AT, None, 16384, None, None, TupleData((b"1", UNCHANGED_TOAST)))
    update_k = d.decode(b"U" + rel + b"K" + tuple_bytes(b"1", None) + b"N" + tuple_bytes(b"2", b"x"), AT)
    assert update_k == Update(AT, None, 16384, tup(b"1", None), None, tup(b"2", b"x"))
    update_o = d.decode(b"U" + rel + b"O" + tuple_bytes(b"1", b"a") + b"N" + tuple_bytes(b"1", b"b"), AT)
    assert update_o == Update(AT, None, 16384, None, tup(b"1", b"a"), tup(b"1", b"b"))
    assert d.decode(b"D" + rel + b"K" + tuple_bytes(b"1", None), AT) == Delete(AT, None, 16384, tup(b"1", None), None)
    assert d.decode(b"D" + rel + b"O" + tuple_bytes(b"1", b"a"), AT) == Delete(AT, None, 16384, None, tup(b"1", b"a"))
    truncate = d.decode(b"T" + struct.pack(">IBI", 1, 2, 16384), AT)
    assert truncate == Truncate(AT, None, (16384,), False, True)
    assert d.decode(b"T" + struct.pack(">IBI", 1, 1, 16384), AT).cascade


def test_crafted_stream_block_messages_carry_xid() -> None:
    d = PgOutputDecoder(2)
    assert d.decode(b"S" + struct.pack(">IB", 700, 1), AT) == StreamStart(AT, 700, True)
    assert d.in_stream and d.stream_xid == 700
    x = struct.pack(">I", 701)  # a subtransaction's changes carry the subxid
    assert d.decode(relation_bytes(xid=701), AT).xid == 701
    assert d.decode(b"Y" + x + struct.pack(">I", 5) + cstr("s") + cstr("t"), AT) == Type(AT, 701, 5, "s", "t")
    rel = struct.pack(">I", 16384)
    assert d.decode(b"I" + x + rel + b"N" + tuple_bytes(b"1", b"2"), AT) == Insert(AT, 701, 16384, tup(b"1", b"2"))
    assert d.decode(b"U" + x + rel + b"N" + tuple_bytes(b"1", b"3"), AT).xid == 701
    assert d.decode(b"D" + x + rel + b"K" + tuple_bytes(b"1", None), AT).xid == 701
    assert d.decode(b"T" + x + struct.pack(">IBI", 1, 3, 16384), AT) == Truncate(AT, 701, (16384,), True, True)
    message = b"M" + x + struct.pack(">BQ", 1, 9) + cstr("p") + struct.pack(">I", 1) + b"z"
    assert d.decode(message, AT) == Message(AT, 701, True, LSN(9), "p", b"z")
    assert d.decode(b"E", AT) == StreamStop(AT)
    assert not d.in_stream and d.stream_xid is None
    # Outside the block the same messages have no xid.
    assert d.decode(b"I" + rel + b"N" + tuple_bytes(b"1", b"2"), AT).xid is None
    assert d.decode(b"S" + struct.pack(">IB", 700, 0), AT) == StreamStart(AT, 700, False)
    d.decode(b"E", AT)
    commit = d.decode(b"c" + struct.pack(">IBQQq", 700, 0, 30, 40, T0), AT)
    assert commit == StreamCommit(AT, 700, 0, LSN(30), LSN(40), T0_DT)


@pytest.mark.parametrize("proto", [2, 3, 4])
def test_crafted_stream_abort_layouts(proto: int) -> None:
    d = PgOutputDecoder(proto)
    assert d.decode(b"A" + struct.pack(">II", 700, 701), AT) == StreamAbort(AT, 700, 701, None, None)
    with_info = b"A" + struct.pack(">IIQq", 700, 701, 0x2_0000_0001, T0)
    if proto >= 4:
        assert d.decode(with_info, AT) == StreamAbort(AT, 700, 701, LSN(0x2_0000_0001), T0_DT)
    else:
        with pytest.raises(ProtocolError, match=r"Stream Abort .*'A'.* at 0/16B3748 has 16 trailing bytes"):
            d.decode(with_info, AT)
    with pytest.raises(ProtocolError, match="truncated" if proto >= 4 else "8 trailing bytes"):
        d.decode(b"A" + struct.pack(">IIQ", 700, 701, 1), AT)


@pytest.mark.parametrize("proto", [3, 4])
def test_crafted_two_phase_messages(proto: int) -> None:
    d = PgOutputDecoder(proto)
    begin = d.decode(b"b" + struct.pack(">QQqI", 10, 20, T0, 42) + cstr("gid-1"), AT)
    assert begin == BeginPrepare(AT, LSN(10), LSN(20), T0_DT, 42, "gid-1")
    prepare = d.decode(b"P" + struct.pack(">BQQqI", 0, 10, 20, T0, 42) + cstr("gid-1"), AT)
    assert prepare == Prepare(AT, 0, LSN(10), LSN(20), T0_DT, 42, "gid-1")
    commit = d.decode(b"K" + struct.pack(">BQQqI", 0, 30, 40, T0 + 1, 42) + cstr("gid-1"), AT)
    assert commit == CommitPrepared(AT, 0, LSN(30), LSN(40), T0_DT + timedelta(microseconds=1), 42, "gid-1")
    rollback = d.decode(b"r" + struct.pack(">BQQqqI", 0, 20, 50, T0, T0 + 2, 43) + cstr("g2"), AT)
    assert rollback == RollbackPrepared(AT, 0, LSN(20), LSN(50), T0_DT, T0_DT + timedelta(microseconds=2), 43, "g2")
    stream_prepare = d.decode(b"p" + struct.pack(">BQQqI", 0, 10, 20, T0, 44) + cstr("g3"), AT)
    assert stream_prepare == StreamPrepare(AT, 0, LSN(10), LSN(20), T0_DT, 44, "g3")


# --------------------------------------------------------------------------- crafted error paths


def test_unknown_type_byte_names_byte_and_lsn() -> None:
    with pytest.raises(ProtocolError, match=r"unknown pgoutput message type byte 'Z' \(0x5a\) at 0/16B3748"):
        PgOutputDecoder(4).decode(b"Z\x00\x00", AT)
    with pytest.raises(ProtocolError, match="at 0/16B3748"):
        PgOutputDecoder(4).decode(b"", AT)


@pytest.mark.parametrize(
    ("proto", "payload", "name"),
    [(1, b"S" + struct.pack(">IB", 1, 1), "Stream Start"), (2, b"b" + bytes(28) + b"\0", "Begin Prepare")],
)
def test_message_from_a_later_protocol_is_rejected(proto: int, payload: bytes, name: str) -> None:
    with pytest.raises(ProtocolError, match=f"{name} .* at 0/16B3748 is not part of protocol version {proto}"):
        PgOutputDecoder(proto).decode(payload, AT)


@pytest.mark.parametrize(
    "payload",
    [
        b"B" + bytes(19),
        b"C" + bytes(24),
        b"O" + bytes(8) + b"no-terminator",
        b"M" + struct.pack(">BQ", 1, 9) + cstr("p") + struct.pack(">I", 10) + b"short",
        relation_bytes()[:-3],
        b"I" + struct.pack(">I", 16384) + b"N" + tuple_bytes(b"12345")[:-2],
        b"I" + struct.pack(">I", 16384) + b"N" + struct.pack(">H", 2) + b"n",
        b"U" + struct.pack(">I", 16384) + b"K" + tuple_bytes(b"1"),
        b"T" + struct.pack(">IB", 3, 0) + struct.pack(">I", 16384),
        b"r" + bytes(20),
    ],
)
def test_truncated_messages(payload: bytes) -> None:
    kind = chr(payload[0])
    with pytest.raises(ProtocolError, match=rf"'{kind}'\) at 0/16B3748 is truncated"):
        decoder_with_relation().decode(payload, AT)


def test_trailing_bytes_and_bad_kinds() -> None:
    d = decoder_with_relation()
    with pytest.raises(ProtocolError, match=r"Commit message \(type byte 'C'\) at 0/16B3748 has 1 trailing bytes"):
        d.decode(b"C" + struct.pack(">BQQq", 0, 1, 2, 3) + b"x", AT)
    with pytest.raises(ProtocolError, match="trailing"):
        d.decode(b"I" + struct.pack(">I", 16384) + b"N" + tuple_bytes(b"1") + b"\0", AT)
    with pytest.raises(ProtocolError, match=r"unknown column kind 'x'"):
        d.decode(b"I" + struct.pack(">I", 16384) + b"N" + struct.pack(">H", 1) + b"x", AT)
    with pytest.raises(ProtocolError, match=r"tuple kind 'K' where 'N'"):
        d.decode(b"I" + struct.pack(">I", 16384) + b"K" + tuple_bytes(b"1"), AT)
    with pytest.raises(ProtocolError, match=r"tuple kind 'N' where 'K' or 'O'"):
        d.decode(b"D" + struct.pack(">I", 16384) + b"N" + tuple_bytes(b"1"), AT)


def test_change_for_unknown_relation() -> None:
    d = PgOutputDecoder(4)
    for payload in (
        b"I" + struct.pack(">I", 777) + b"N" + tuple_bytes(b"1"),
        b"U" + struct.pack(">I", 777) + b"N" + tuple_bytes(b"1"),
        b"D" + struct.pack(">I", 777) + b"K" + tuple_bytes(b"1"),
        b"T" + struct.pack(">IBI", 1, 0, 777),
    ):
        with pytest.raises(ProtocolError, match="at 0/16B3748 names relation oid 777"):
            d.decode(payload, AT)


def test_stream_state_errors() -> None:
    d = PgOutputDecoder(4)
    with pytest.raises(ProtocolError, match="Stream Stop .* outside a stream block"):
        d.decode(b"E", AT)
    d.decode(b"S" + struct.pack(">IB", 5, 1), AT)
    with pytest.raises(ProtocolError, match="Stream Start .* inside the stream of xid 5"):
        d.decode(b"S" + struct.pack(">IB", 6, 1), AT)
    with pytest.raises(ProtocolError, match="trailing"):
        d.decode(b"E\0", AT)
    assert d.in_stream  # a malformed Stream Stop does not close the block


def test_decoder_accepts_memoryview_and_int_lsn() -> None:
    d = decoder_with_relation()
    payload = memoryview(bytearray(b"I" + struct.pack(">I", 16384) + b"N" + tuple_bytes(b"1", b"x")))
    message = d.decode(payload, int(AT))
    assert type(message.wal_start) is LSN and message.wal_start == AT
    assert message.new == tup(b"1", b"x")
    with pytest.raises(ValueError):
        PgOutputDecoder(5)
    assert repr(UNCHANGED_TOAST) == "UNCHANGED_TOAST" and not UNCHANGED_TOAST
