"""The replication layer against real PostgreSQL 15 and 18: slots, snapshots, START_REPLICATION, drain."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import psycopg
import pytest

from resources.errors import ConfigurationError, ConnectionFailure, PgcdcError, SlotError
from resources.lsn import LSN
from resources.pgoutput.options import highest_proto_version, PgOutputOptions
from resources.postgres.connections import libpq_options
from resources.postgres.frames import XLogData
from resources.postgres.replication import ReplicationConnection
from resources.postgres.stream import ReplicationStream
from tests.support.postgres import PgDatabase


@pytest.fixture
def rc(pg: PgDatabase) -> Iterator[ReplicationConnection]:
    with ReplicationConnection(pg.dsn) as conn:
        yield conn


@pytest.fixture
def writer(pg: PgDatabase) -> Iterator[psycopg.Connection]:
    """A SQL connection whose commits are flushed before they return, so IDENTIFY_SYSTEM covers them."""
    with pg.connect(options="-c synchronous_commit=on") as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, label text)")
        conn.execute("CREATE TABLE other (id int)")
        conn.execute("CREATE PUBLICATION pub FOR TABLE items")
        yield conn


def tags(frames: list[XLogData]) -> str:
    return "".join(chr(f.payload[0]) for f in frames)


def drain_all(dsn: str, slot: str, end: LSN, options: PgOutputOptions | None = None) -> list[XLogData]:
    with ReplicationConnection(dsn) as conn:
        stream = ReplicationStream(conn)
        stream.start(slot, options=options or PgOutputOptions(["pub"]))
        frames = [f._replace(payload=bytes(f.payload)) for f in stream.drain(end)]
        assert not stream.streaming
        conn.identify_system()  # still usable
        return frames


# --------------------------------------------------------------------------- connection


def test_identify_system(pg: PgDatabase, rc: ReplicationConnection) -> None:
    ident = rc.identify_system()
    assert ident.systemid.isdigit()
    assert ident.timeline >= 1
    assert ident.xlogpos > 0
    assert ident.dbname == pg.name
    assert rc.server_version_num // 10000 == pg.major


def test_session_settings_reach_the_walsender(pg: PgDatabase) -> None:
    settings = {"TimeZone": "UTC", "search_path": "public, pg_catalog", "DateStyle": "ISO, MDY"}
    with ReplicationConnection(pg.dsn, session_settings=settings, application_name="pgcdc test") as conn:
        assert conn.execute("SHOW TimeZone") == [("UTC",)]
        assert conn.execute("SHOW DateStyle") == [("ISO, MDY",)]
        assert conn.execute("SHOW search_path") == [("",)]  # pgcdc's sessions never search other schemas
        assert conn.execute("SHOW application_name") == [("pgcdc test",)]
    assert libpq_options({"a": "x y\\z"}) == "-c a=x\\ y\\\\z"
    with pytest.raises(ConfigurationError):
        libpq_options({"bad name": "x"})


def test_create_and_drop_slots_of_each_snapshot_kind(pg: PgDatabase, rc: ReplicationConnection) -> None:
    nothing = rc.create_slot("s_nothing")
    assert nothing.slot_name == "s_nothing" and nothing.snapshot_name is None
    assert nothing.output_plugin == "pgoutput" and nothing.consistent_point > 0

    export = rc.create_slot("s_export", snapshot="export")
    assert export.snapshot_name  # e.g. 00000003-00000002-1

    rc.begin_snapshot_transaction()
    use = rc.create_slot("s_use", snapshot="use")
    assert use.snapshot_name is None
    rc.commit()

    names = {row[0] for row in pg.execute("SELECT slot_name FROM pg_replication_slots")}
    assert {"s_nothing", "s_export", "s_use"} <= names
    for name in ("s_nothing", "s_export", "s_use"):
        rc.drop_slot(name)
        assert rc.read_slot(name) is None


def test_slot_errors_are_clear(rc: ReplicationConnection) -> None:
    with pytest.raises(SlotError, match="invalid replication slot name"):
        rc.create_slot('bad"name')
    with pytest.raises(SlotError, match="invalid replication slot name"):
        rc.read_slot("UPPER")
    with pytest.raises(ConfigurationError, match="begin_snapshot_transaction"):
        rc.create_slot("s_use", snapshot="use")
    rc.create_slot("dup")
    with pytest.raises(SlotError, match="already exists"):
        rc.create_slot("dup")
    with pytest.raises(SlotError, match="does not exist"):
        rc.drop_slot("missing")
    rc.identify_system()  # errors leave the connection usable


def test_temporary_slot_vanishes_with_its_connection(pg: PgDatabase) -> None:
    with ReplicationConnection(pg.dsn) as conn:
        conn.create_slot("tmp", temporary=True)
        state = conn.read_slot("tmp")
        assert state is not None and state.temporary and state.active
    # The walsender drops the slot as it exits, which may be just after the client has closed.
    deadline = time.monotonic() + 60
    while pg.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'tmp'") != [(0,)]:
        assert time.monotonic() < deadline, "the temporary slot outlived its connection's walsender"
        time.sleep(0.05)


def test_use_snapshot_sees_data_as_of_the_consistent_point(
    pg: PgDatabase, rc: ReplicationConnection, writer: psycopg.Connection
) -> None:
    writer.execute("INSERT INTO items VALUES (1, 'before')")
    rc.begin_snapshot_transaction()
    rc.create_slot("snap", snapshot="use")
    writer.execute("INSERT INTO items VALUES (2, 'after')")
    assert rc.execute("SELECT id FROM public.items ORDER BY id") == [(1,)]
    rc.commit()
    assert rc.execute("SELECT id FROM public.items ORDER BY id") == [(1,), (2,)]
    # The row inserted after the consistent point comes through the slot instead.
    frames = drain_all(pg.dsn, "snap", rc.identify_system().xlogpos)
    assert tags(frames) == "BRIC"


def test_read_slot_fields(pg: PgDatabase, rc: ReplicationConnection) -> None:
    created = rc.create_slot("fields", two_phase=True)
    state = rc.read_slot("fields")
    assert state is not None
    assert state.slot_name == "fields"
    assert state.plugin == "pgoutput"
    assert state.slot_type == "logical"
    assert state.database == pg.name
    assert state.temporary is False
    assert state.active is False and state.active_pid is None
    assert state.confirmed_flush_lsn == created.consistent_point
    assert state.restart_lsn is not None and state.restart_lsn <= created.consistent_point
    assert state.wal_status == "reserved"
    assert state.two_phase is True
    assert rc.read_slot("nope") is None


# --------------------------------------------------------------------------- options


def test_publication_names_are_quoted_at_both_levels() -> None:
    options = PgOutputOptions(["pub one", 'Pub"2', "it's"], proto_version=1)
    assert options.publication_names_value() == '"pub one","Pub""2","it\'s"'
    assert options.render(150000) == ('(proto_version \'1\', publication_names \'"pub one","Pub""2","it\'\'s"\')')
    assert PgOutputOptions(["p"]).render(180000).startswith("(proto_version '4', ")
    assert [highest_proto_version(v) for v in (140000, 150000, 160000, 180000)] == [2, 3, 4, 4]


def test_quoted_publication_names_are_accepted(pg: PgDatabase, rc: ReplicationConnection) -> None:
    with pg.connect(options="-c synchronous_commit=on") as conn:
        conn.execute("CREATE TABLE a (id int PRIMARY KEY)")
        conn.execute("CREATE TABLE b (id int PRIMARY KEY)")
        conn.execute('CREATE PUBLICATION "pub one" FOR TABLE a')
        conn.execute('CREATE PUBLICATION "it\'s ""2""" FOR TABLE b')
        rc.create_slot("quoted")
        conn.execute("INSERT INTO a VALUES (1)")
        conn.execute("INSERT INTO b VALUES (2)")
    frames = drain_all(pg.dsn, "quoted", rc.identify_system().xlogpos, PgOutputOptions(["pub one", 'it\'s "2"']))
    assert tags(frames) == "BRICBRIC"


def _combinations() -> list[dict[str, object]]:
    combos: list[dict[str, object]] = []
    for proto, streaming, two_phase in itertools.product((1, 2, 3, 4), ("off", "on", "parallel"), (False, True)):
        combos.append({"proto_version": proto, "streaming": streaming, "two_phase": two_phase})
    combos += [
        {"binary": True, "messages": True},
        {"origin": "none"},
        {"origin": "any", "streaming": "on", "binary": True},
    ]
    return combos


def _supported(major: int, combo: dict[str, object]) -> bool:
    proto = int(combo.get("proto_version") or highest_proto_version(major * 10000))
    if proto > highest_proto_version(major * 10000):
        return False
    if combo.get("streaming") == "on" and proto < 2 or combo.get("streaming") == "parallel" and proto < 4:
        return False
    if combo.get("two_phase") and proto < 3:
        return False
    return not (combo.get("origin") and major < 16)


def test_start_accepts_each_option_combination_the_server_supports(
    pg: PgDatabase, rc: ReplicationConnection, writer: psycopg.Connection
) -> None:
    rc.create_slot("combos")
    writer.execute("INSERT INTO items VALUES (1, 'x')")
    end = rc.identify_system().xlogpos
    accepted = refused = 0
    for combo in _combinations():
        options = PgOutputOptions(["pub"], **combo)  # type: ignore[arg-type]
        with ReplicationConnection(pg.dsn) as conn:
            stream = ReplicationStream(conn)
            if _supported(pg.major, combo):
                stream.start("combos", options=options)
                frames = list(stream.drain(end))
                assert tags(frames) in ("BRIC", "BIC"), combo
                accepted += 1
            else:
                with pytest.raises(ConfigurationError) as info:
                    stream.start("combos", options=options)
                assert "\n" not in str(info.value)
                conn.identify_system()
                refused += 1
    assert accepted and refused


def test_proto_4_on_15_is_a_clear_error(pg: PgDatabase, rc: ReplicationConnection) -> None:
    rc.create_slot("p4")
    stream = ReplicationStream(rc)
    if pg.major >= 16:
        stream.start("p4", options=PgOutputOptions(["pub"], proto_version=4, streaming="parallel"))
        stream.stop()
        return
    with pytest.raises(ConfigurationError) as info:
        stream.start("p4", options=PgOutputOptions(["pub"], proto_version=4))
    assert str(info.value) == (
        "pgoutput protocol version 4 is not supported by PostgreSQL 15 (highest: 3): "
        "use proto_version=3 or leave it unset"
    )
    with pytest.raises(ConfigurationError, match="proto_version"):
        PgOutputOptions(["pub"], proto_version=5).render(150000)
    with pytest.raises(ConfigurationError, match="publication_names"):
        PgOutputOptions([]).render(150000)


# --------------------------------------------------------------------------- drain


def test_drain_returns_exactly_the_transactions_committed_before_the_end(
    pg: PgDatabase, rc: ReplicationConnection, writer: psycopg.Connection
) -> None:
    created = rc.create_slot("d")
    writer.execute("INSERT INTO items VALUES (1, 'a'), (2, 'b')")
    writer.execute("INSERT INTO other VALUES (1)")  # not published: nothing is sent
    writer.execute("INSERT INTO items VALUES (3, 'c')")
    end = rc.identify_system().xlogpos
    writer.execute("INSERT INTO items VALUES (4, 'after the end')")

    frames = drain_all(pg.dsn, "d", end)
    assert tags(frames) == "BRIICBIC"
    assert b"after the end" not in b"".join(f.payload for f in frames)
    assert all(f.wal_start < end for f in frames if f.payload[:1] == b"B")
    # Draining did not move the slot.
    state = rc.read_slot("d")
    assert state is not None and state.confirmed_flush_lsn == created.consistent_point

    # Draining again gives the same frames; a later end includes the last transaction.
    assert tags(drain_all(pg.dsn, "d", end)) == "BRIICBIC"
    assert tags(drain_all(pg.dsn, "d", rc.identify_system().xlogpos)) == "BRIICBICBIC"


def test_consecutive_drains_on_one_stream_lose_nothing(
    pg: PgDatabase, rc: ReplicationConnection, writer: psycopg.Connection
) -> None:
    rc.create_slot("multi")
    writer.execute("INSERT INTO items VALUES (1, 'a')")
    writer.execute("INSERT INTO other VALUES (1)")  # moves the end past the first commit
    first_end = rc.identify_system().xlogpos
    writer.execute("INSERT INTO items VALUES (2, 'b')")
    second_end = rc.identify_system().xlogpos
    with ReplicationConnection(pg.dsn) as conn:
        stream = ReplicationStream(conn)
        stream.start("multi", options=PgOutputOptions(["pub"]))
        first = list(stream.drain(first_end, stop=False))
        assert tags(first) == "BRIC"
        assert stream.streaming and not stream.in_transaction
        second = list(stream.drain(second_end))
        assert tags(second) == "BIC"
        assert not stream.streaming
        assert stream.frames >= 7 and stream.bytes > 0
        assert stream.last_received_lsn >= int.from_bytes(second[-1].payload[10:18], "big")
        assert conn.identify_system().dbname == pg.name


def test_confirm_moves_the_slot_to_exactly_that_lsn(
    pg: PgDatabase, rc: ReplicationConnection, writer: psycopg.Connection
) -> None:
    rc.create_slot("c")
    writer.execute("INSERT INTO items VALUES (1, 'a')")
    writer.execute("INSERT INTO items VALUES (2, 'b')")
    end = rc.identify_system().xlogpos
    with ReplicationConnection(pg.dsn) as conn:
        stream = ReplicationStream(conn)
        stream.start("c", options=PgOutputOptions(["pub"]))
        commits = []
        for frame in stream.drain(end, stop=False):
            if frame.payload[:1] == b"C":
                commits.append(LSN(int.from_bytes(frame.payload[10:18], "big")))
                if len(commits) == 1:
                    stream.confirm(commits[0])
        assert stream.streaming
        stream.confirm(LSN(commits[0] - 8))  # lower: ignored, the slot never moves back
        stream.stop()
        assert conn.identify_system().xlogpos >= end
        state = conn.read_slot("c")
        assert state is not None and state.confirmed_flush_lsn == commits[0]
    # The next stream starts after the confirmed transaction.
    assert tags(drain_all(pg.dsn, "c", end)) == "BRIC"


def test_drain_of_an_idle_slot_ends(pg: PgDatabase, rc: ReplicationConnection) -> None:
    created = rc.create_slot("idle")
    assert drain_all(pg.dsn, "idle", rc.identify_system().xlogpos) == []
    # An end at or before the slot's confirmed position ends on the first keepalive.
    assert drain_all(pg.dsn, "idle", created.consistent_point) == []
    assert drain_all(pg.dsn, "idle", LSN(0)) == []


def test_open_transaction_at_the_end_does_not_hang(
    pg: PgDatabase, rc: ReplicationConnection, writer: psycopg.Connection
) -> None:
    rc.create_slot("open")
    with psycopg.connect(pg.dsn) as open_txn:
        # Larger than logical_decoding_work_mem (64kB), so streaming sends it in blocks.
        open_txn.execute("INSERT INTO items SELECT g, repeat('x', 100) FROM generate_series(1, 3000) g")
        writer.execute("INSERT INTO other VALUES (1)")  # flushes the WAL above; nothing published
        end = rc.identify_system().xlogpos
        for streaming in ("off", "on"):
            frames = drain_all(pg.dsn, "open", end, PgOutputOptions(["pub"], streaming=streaming))  # type: ignore[arg-type]
            if streaming == "off":
                assert frames == []
            else:
                kinds = tags(frames)
                assert kinds.startswith("S") and kinds.endswith("E") and "c" not in kinds
        open_txn.rollback()


def test_two_phase_transactions_end_at_prepare_and_commit_prepared(
    pg: PgDatabase, rc: ReplicationConnection, writer: psycopg.Connection
) -> None:
    rc.create_slot("tp", two_phase=True)
    with pg.connect(options="-c synchronous_commit=on") as conn:
        conn.execute("BEGIN")
        conn.execute("INSERT INTO items VALUES (1, 'prepared')")
        conn.execute("PREPARE TRANSACTION 'gid1'")
        after_prepare = rc.identify_system().xlogpos
        conn.execute("COMMIT PREPARED 'gid1'")
    end = rc.identify_system().xlogpos
    options = PgOutputOptions(["pub"], two_phase=True)
    assert tags(drain_all(pg.dsn, "tp", after_prepare, options)) == "bRIP"
    assert tags(drain_all(pg.dsn, "tp", end, options)) == "bRIPK"


def test_slot_held_by_another_consumer(pg: PgDatabase, rc: ReplicationConnection) -> None:
    rc.create_slot("busy")
    with ReplicationConnection(pg.dsn) as first:
        stream = ReplicationStream(first)
        stream.start("busy", options=PgOutputOptions(["pub"]))
        with ReplicationConnection(pg.dsn) as second:
            with pytest.raises(SlotError) as info:
                ReplicationStream(second).start("busy", options=PgOutputOptions(["pub"]))
            message = str(info.value)
            assert "is active for PID" in message and "\n" not in message
            assert message.endswith(": stop the other consumer (or wait for its run to finish) and retry")
            second.identify_system()
        stream.stop()


def test_missing_slot(rc: ReplicationConnection) -> None:
    with pytest.raises(SlotError, match='replication slot "ghost" does not exist'):
        ReplicationStream(rc).start("ghost", options=PgOutputOptions(["pub"]))


def test_connection_usable_after_stop_and_one_stream_per_connection(
    pg: PgDatabase, rc: ReplicationConnection, writer: psycopg.Connection
) -> None:
    rc.create_slot("reuse")
    writer.execute("INSERT INTO items VALUES (1, 'a')")
    stream = ReplicationStream(rc)
    stream.start("reuse", options=PgOutputOptions(["pub"]))
    frame = stream.read(timeout=5)
    assert frame is not None
    stream.stop()
    assert rc.identify_system().dbname == pg.name
    assert rc.read_slot("reuse") is not None
    with pytest.raises(PgcdcError, match="new ReplicationConnection"):
        stream.start("reuse", options=PgOutputOptions(["pub"]))


def test_lost_connection_is_a_one_line_connection_failure(
    pg: PgDatabase, rc: ReplicationConnection, writer: psycopg.Connection
) -> None:
    rc.create_slot("lost")
    stream = ReplicationStream(rc)
    stream.start("lost", options=PgOutputOptions(["pub"]))
    writer.execute("SELECT pg_terminate_backend(%s)", (rc.connection.info.backend_pid,))
    with pytest.raises(ConnectionFailure) as info:
        for _ in stream.drain(LSN(LSN.MAX)):
            pass
    assert "\n" not in str(info.value)


def test_server_error_during_streaming_is_raised(
    pg: PgDatabase, rc: ReplicationConnection, writer: psycopg.Connection
) -> None:
    rc.create_slot("err")
    if pg.major >= 18:
        rc.create_slot("err_control")  # the same insert, through the publication that exists
    writer.execute("INSERT INTO items VALUES (1, 'a')")
    stream = ReplicationStream(rc)
    stream.start("err", options=PgOutputOptions(["no_such_pub"]))
    if pg.major >= 18:
        # PostgreSQL 18 only warns about a missing publication and publishes nothing (not even the
        # transaction's Begin and Commit: empty transactions are skipped), which is why pgcdc checks
        # publications itself before streaming. The control slot shows the insert was there to send.
        (end,) = writer.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert [bytes(frame.payload[:1]) for frame in stream.drain(LSN.parse(end))] == []
        with ReplicationConnection(pg.dsn) as other:
            control = ReplicationStream(other)
            control.start("err_control", options=PgOutputOptions(["pub"]))
            sent = [bytes(frame.payload[:1]) for frame in control.drain(LSN.parse(end))]
        assert sent == [b"B", b"R", b"I", b"C"]
        return
    with pytest.raises(PgcdcError, match='publication "no_such_pub" does not exist'):
        for _ in stream.drain(LSN(LSN.MAX)):
            pass
    assert not stream.streaming
