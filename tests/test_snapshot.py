"""Initial snapshot against real PostgreSQL 15 and 18, the embedded Sail engine, read back by delta-rs."""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import deltalake
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from psycopg.types.datetime import TimestampLoader, TimestamptzLoader
from psycopg.types.string import TextLoader
from pyspark.sql import SparkSession

from resources.config import parse_config, PgcdcConfig
from resources.delta.layout import BUCKET_COLUMN
from resources.delta.markers import LSN_COLUMN
from resources.delta.reads import delta_rs_rows
from resources.delta.snapshot_writes import ROW_GROUP_BYTES
from resources.delta.spark_destination import lake_destination, SparkDeltaDestination
from resources.errors import ConfigurationError, SlotError, SnapshotError
from resources.lsn import LSN
from resources.pgtypes import SESSION_SETTINGS, TIMESTAMP_NEGATIVE_INFINITY, TIMESTAMP_POSITIVE_INFINITY
from resources.postgres.catalog import TableName
from resources.postgres.connections import libpq_options
from resources.postgres.preflight import ensure_slot
from resources.postgres.publication import ensure_publication
from resources.postgres.replication import CreatedSlot
from resources.runs import snapshot
from resources.runs.snapshot import snapshot_table, snapshot_tables, SnapshotProgress
from resources.testing.verify import assert_buckets_right
from tests.support.marker_reads import read_snapshot_lsn
from tests.support.memory_child import measured
from tests.support.postgres import PgDatabase
from tests.support.snapshot_checks import assert_md5_payloads

pytest_plugins = ["tests.support.spark_fixtures"]

SLOT = "pgcdc_slot"
PUB = "pub"
_EPOCH = datetime(1970, 1, 1)
_EPOCH_UTC = datetime(1970, 1, 1, tzinfo=timezone.utc)


def make_config(pg: PgDatabase, root: Path, **overrides: Any) -> PgcdcConfig:
    return parse_config(
        {"postgres": {"dsn": pg.dsn}, "publication": PUB, "slot": SLOT, "delta": {"root": str(root)}, **overrides}
    )


def delta_table(path: str | Path) -> pa.Table:
    """The Delta table's columns but the bucket column, after checking every row is in its key's bucket."""
    assert_buckets_right(str(path))
    table = delta_rs_rows(str(path))
    return table.drop_columns([BUCKET_COLUMN]) if BUCKET_COLUMN in table.column_names else table


def lake_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*")) if root.exists() else []


def temporary_slots(pg: PgDatabase) -> list[tuple[str, str]]:
    return pg.execute(
        "SELECT slot_name::text, confirmed_flush_lsn::text FROM pg_replication_slots"
        " WHERE temporary AND database = current_database()"
    )


# --------------------------------------------------------------------------- value for value


class _MicrosTimestampLoader(TimestampLoader):
    """timestamp -> microseconds since the epoch, infinities as the mapping's int64 extremes."""

    def load(self, data: Any) -> int:
        special = _infinity(bytes(data))
        return special if special is not None else (super().load(data) - _EPOCH) // timedelta(microseconds=1)


class _MicrosTimestamptzLoader(TimestamptzLoader):
    def load(self, data: Any) -> int:
        special = _infinity(bytes(data))
        return special if special is not None else (super().load(data) - _EPOCH_UTC) // timedelta(microseconds=1)


def _infinity(data: bytes) -> int | None:
    return {b"infinity": TIMESTAMP_POSITIVE_INFINITY, b"-infinity": TIMESTAMP_NEGATIVE_INFINITY}.get(data)


def _float32(value: float | None) -> float | None:
    """PostgreSQL's real is an IEEE single: its value is the float32 nearest to the text."""
    return None if value is None else struct.unpack("<f", struct.pack("<f", value))[0]


def _float_bits(value: float | None) -> str | None:
    """Exact float comparison that also equates NaN with NaN."""
    return None if value is None else float.hex(value)


def _canonical_floats(rows: list[dict[str, Any]], columns: list[str]) -> None:
    for row in rows:
        for name in columns:
            row[name] = _float_bits(row[name])


def _delta_rows(path: Path) -> list[dict[str, Any]]:
    """Delta rows with timestamps as int64 microseconds (infinity lies beyond Python's datetime)."""
    table = delta_table(path).sort_by("id")
    columns = [
        pc.cast(column, pa.int64()) if pa.types.is_timestamp(column.type) else column for column in table.columns
    ]
    return pa.table(columns, names=table.column_names).to_pylist()


def test_every_mapped_type_round_trips_value_for_value(pg: PgDatabase, spark: SparkSession, tmp_path: Path) -> None:
    citext = bool(pg.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'citext'"))
    if citext:
        pg.execute("CREATE EXTENSION citext")
    pg.execute(
        f"""
        CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy ''quoted''');
        CREATE DOMAIN price AS numeric(10,2) CHECK (VALUE >= 0);
        CREATE TABLE every_type (
            id int PRIMARY KEY, i2 int2, i4 int4, i8 int8, num numeric(12,3), num_free numeric,
            f4 float4, f8 float8, ok bool, t text, vc varchar(20), ch char(5), nm name,
            {"ci citext," if citext else ""}
            by bytea, u uuid, j json, jb jsonb, d date, ts timestamp, tstz timestamptz,
            tm time, tmtz timetz, iv interval, ai int4[], at text[], e mood, dom price, m money,
            ip inet, net cidr, mac macaddr, r int4range, tr tstzrange);
        CREATE PUBLICATION {PUB} FOR TABLE every_type;
        """
    )
    ci_values = [", 'MiXeD Case'", ", NULL", ", ''", ", 'Ünï'", ", 'x'", ", '\\N'"] if citext else [""] * 6
    pg.execute(
        f"""
        INSERT INTO every_type VALUES
        (1, 7, -42, 9000000000, 12345.678, 3.14159265358979323846264338327950288419716939937510,
         1.5, 2.718281828459045, true, 'plain', 'varchar', 'ab', 'a_name'{ci_values[0]},
         '\\xdeadbeef', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{{"a": [1, 2.50, null]}}', '{{"b": {{"c": "d"}}, "a": 1}}',
         '2024-02-29', '2024-02-29 13:14:15.123456', '2024-02-29 13:14:15.654321+05:30',
         '13:14:15.5', '13:14:15+02', '1 year 2 mons 3 days 04:05:06.7', '{{1,NULL,3}}',
         ARRAY['a,b', 'quote"d', 'back\\slash', NULL, 'NULL', '', ' spaced ', 'new
line', '{{braces}}'],
         'happy ''quoted''', 19.99, 1234.56, '192.168.0.1/24', '10.0.0.0/8', '08:00:2b:01:02:03',
         '[1,10)', '[2024-01-01 00:00:00+00,infinity)'),
        (2, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL{ci_values[1]},
         NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
         NULL, NULL, NULL, NULL, NULL),
        (3, -32768, -2147483648, -9223372036854775808, -999999999.999, 'NaN',
         'NaN', 'Infinity', false, '', '', '', ''{ci_values[2]},
         '\\x', '00000000-0000-0000-0000-000000000000', '""', '[]',
         '0001-01-01', 'infinity', 'infinity', '00:00', '00:00+00', '-1 days -00:00:01', '{{}}', '{{}}',
         'sad', 0, -0.01, '::1', '::/0', 'ff:ff:ff:ff:ff:ff', 'empty', '(,)'),
        (4, 32767, 2147483647, 9223372036854775807, 999999999.999, '-0.000000000000000000001',
         '-Infinity', '-Infinity', true, 'ünïcødé 🐘 中文 e\u0301 "q" , x', 'ｆｕｌｌ', 'é', 'ñ'{ci_values[3]},
         '\\x00ff00', 'ffffffff-ffff-ffff-ffff-ffffffffffff', '"🐘"', '"\\u00e9"',
         '9999-12-31', '-infinity', '-infinity', '24:00', '23:59:59.999999-15:59', '178000000 years',
         '{{-2147483648,2147483647}}', '{{"x\\\\y","a\\"b",NULL}}',
         'ok', 99999999.99, 0, '2001:db8::1/64', '2001:db8::/32', '00:00:00:00:00:00', '(,5]', 'empty'),
        (5, 1, 1, 1, 0, '1e-1000', '1.17549435e-38', '4.9e-324', false,
         (SELECT string_agg(md5(g::text) || 'ß', '') FROM generate_series(1, 100000) g),
         'x', 'x', 'x'{ci_values[4]},
         (SELECT decode(string_agg(md5(g::text), ''), 'hex') FROM generate_series(1, 200000) g),
         NULL, NULL, NULL, '1999-12-31', '1970-01-01 00:00:00', '1969-12-31 23:59:59.999999+00',
         NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL),
        (6, 0, 0, 0, 0.001, '0', '-0', '-0', true, ',', '"', '\\', 'N'{ci_values[5]},
         NULL, NULL, 'null', 'null', '2000-01-01', '2000-01-01 00:00:00', '2000-01-01 00:00:00+00',
         NULL, NULL, NULL, '{{NULL}}', '{{NULL,"NULL"}}', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)
        """
    )
    # Row 5 holds a 3.4 MB text and a 3.2 MB bytea: TOASTed out of line, each bigger than a piece.
    assert pg.execute("SELECT pg_column_size(t) > 1000000, length(by) FROM every_type WHERE id = 5") == [
        (True, 3_200_000)
    ]
    text_columns = ["num_free", "u", "j", "jb", "tm", "tmtz", "iv", "e", "m", "ip", "net", "mac", "r", "tr"]
    typed_columns = ["id", "i2", "i4", "i8", "num", "f4", "f8", "ok", "t", "vc", "ch", "nm",
                     *(["ci"] if citext else []), "by", "d", "ts", "tstz", "ai", "at", "dom"]  # fmt: skip
    with psycopg.connect(pg.dsn, autocommit=True, options=libpq_options(SESSION_SETTINGS)) as conn:
        conn.adapters.register_loader("timestamp", _MicrosTimestampLoader)
        conn.adapters.register_loader("timestamptz", _MicrosTimestamptzLoader)
        cursor = conn.cursor(row_factory=psycopg.rows.dict_row)
        expected = cursor.execute(f"SELECT {', '.join(typed_columns)} FROM every_type ORDER BY id").fetchall()
    with psycopg.connect(pg.dsn, autocommit=True, options=libpq_options(SESSION_SETTINGS)) as conn:
        # The mapping keeps these as PostgreSQL's output text: take the server's bytes as they are
        # (a ::text cast would differ, e.g. inet '::1' casts to '::1/128').
        for type_name in ("numeric", "uuid", "json", "jsonb", "time", "timetz", "interval", "money",
                          "inet", "cidr", "macaddr", "int4range", "tstzrange"):  # fmt: skip
            conn.adapters.register_loader(type_name, TextLoader)
        cursor = conn.cursor(row_factory=psycopg.rows.dict_row)
        as_text = cursor.execute(f"SELECT {', '.join(text_columns)} FROM every_type ORDER BY id").fetchall()
    for row, text_row in zip(expected, as_text, strict=True):
        row.update(text_row)
    for row in expected:
        row["f4"] = _float32(row["f4"])

    path = tmp_path / "every_type"
    progress: list[SnapshotProgress] = []
    ensure_slot(pg.dsn, SLOT)
    result = snapshot_table(
        pg.dsn, PUB, TableName("public", "every_type"), SparkDeltaDestination(spark, None), str(path),
        slot=SLOT, chunk_bytes=256 * 1024, on_progress=progress.append,
    )  # fmt: skip

    actual = _delta_rows(path)
    assert [row.pop(LSN_COLUMN) for row in actual] == [int(result.snapshot_lsn)] * 6
    _canonical_floats(expected, ["f4", "f8"])
    _canonical_floats(actual, ["f4", "f8"])
    for want, got in zip(expected, actual, strict=True):
        assert got == want, f"row {want['id']}: " + ", ".join(
            f"{k}: {got[k]!r:.80} != {want[k]!r:.80}" for k in want if got[k] != want[k]
        )
    # The TOASTed row (3.4 MB text + 6.4 MB of bytea hex) closes the first piece on its own.
    assert [(p.rows, p.bytes > 9_600_000) for p in progress] == [(5, True), (6, True)]
    assert result.rows == 6
    types = {name: (pg_type, delta) for name, pg_type, delta in result.columns}
    assert types["num"] == ("numeric(12,3)", "decimal(12,3)")
    assert types["dom"] == ("public.price", "decimal(10,2)")  # format_type() qualifies what pg_catalog lacks
    assert types["tstz"] == ("timestamp with time zone", "timestamp")
    assert types["ts"] == ("timestamp without time zone", "timestamp_ntz")
    assert types["ai"] == ("integer[]", "array<int>")
    assert types["e"] == ("public.mood", "string")
    schema = deltalake.DeltaTable(str(path)).schema().to_arrow()
    assert schema.field("ts").type == pa.timestamp("us") and schema.field("tstz").type == pa.timestamp("us", "UTC")
    assert schema.field("f4").type == pa.float32() and schema.field("num").type == pa.decimal128(12, 3)
    assert temporary_slots(pg) == []


# --------------------------------------------------------------------------- what is published


def test_column_list_and_row_filter_are_honoured(pg: PgDatabase, spark: SparkSession, tmp_path: Path) -> None:
    pg.execute(
        f"""
        CREATE TABLE orders (id bigint PRIMARY KEY, customer text, total numeric(10,2), secret text);
        INSERT INTO orders SELECT g, 'c' || g, g * 5, 'hidden' FROM generate_series(1, 10) g;
        CREATE PUBLICATION {PUB} FOR TABLE orders (id, customer, total) WHERE (total > 20);
        """
    )
    ensure_slot(pg.dsn, SLOT)
    result = snapshot_table(
        pg.dsn, PUB, TableName("public", "orders"), SparkDeltaDestination(spark, None), str(tmp_path / "o"), slot=SLOT
    )
    table = delta_table(tmp_path / "o").sort_by("id")
    assert table.column_names == ["id", "customer", "total", LSN_COLUMN]
    assert table.drop_columns([LSN_COLUMN]).to_pylist() == [
        {"id": g, "customer": f"c{g}", "total": Decimal(f"{g * 5}.00")} for g in range(5, 11)
    ]
    assert result.rows == 6 and [c[0] for c in result.columns] == ["id", "customer", "total"]


def test_keyless_partitioned_and_empty_tables_in_parallel(
    pg: PgDatabase, spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pg.execute(
        '''
        CREATE TABLE logs (line text, at int, twice int GENERATED ALWAYS AS (at * 2) STORED);
        INSERT INTO logs SELECT 'line ' || (g % 3), g FROM generate_series(1, 3000) g;
        INSERT INTO logs VALUES ('line 1', 1), (NULL, NULL);
        CREATE TABLE measures (id int, region text, v float8) PARTITION BY LIST (region);
        CREATE TABLE measures_eu PARTITION OF measures FOR VALUES IN ('eu');
        CREATE TABLE measures_us PARTITION OF measures FOR VALUES IN ('us');
        INSERT INTO measures SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, g / 4.0
            FROM generate_series(1, 2000) g;
        CREATE TABLE nothing_yet (id int PRIMARY KEY, note text);
        CREATE TABLE "MixedCase" (id int PRIMARY KEY, "Odd, ""name""" text);
        INSERT INTO "MixedCase" VALUES (1, 'odd');
        '''
    )
    root = tmp_path / "lake"
    config = make_config(
        pg, root, create_publication=True, snapshot={"parallel_tables": 3},
        tables=["public.logs", "public.measures", "public.nothing_yet", 'public."MixedCase"'],
    )  # fmt: skip
    # The tables really run side by side on the one Spark session: the first two to start wait for each
    # other before copying (a pool running them one at a time would break the barrier after 120 s).
    side_by_side = threading.Barrier(2, timeout=120)
    copy_one = snapshot.snapshot_table
    started: list[str] = []

    def snapshot_table(*args: object, **kwargs: object) -> object:
        started.append(str(args[2]))
        if len(started) <= 2:
            side_by_side.wait()
        return copy_one(*args, **kwargs)

    monkeypatch.setattr(snapshot, "snapshot_table", snapshot_table)
    results = snapshot_tables(config, lake_destination(spark, config))

    assert [str(r.table) for r in results] == [
        "public.logs",
        "public.measures",
        "public.nothing_yet",
        "public.MixedCase",
    ]
    assert sorted(started) == sorted(str(r.table) for r in results) and not side_by_side.broken
    logs = delta_table(config.table_path("public", "logs"))
    assert logs.num_rows == 3002 and results[0].rows == 3002
    assert logs.column_names == ["line", "at", LSN_COLUMN]  # pgoutput does not publish generated columns
    with pg.connect() as conn:
        want = conn.execute("SELECT line, at FROM logs").fetchall()
    assert sorted(zip(logs["line"].to_pylist(), logs["at"].to_pylist()), key=repr) == sorted(want, key=repr)
    measures = delta_table(config.table_path("public", "measures")).sort_by("id")
    assert measures["id"].to_pylist() == list(range(1, 2001))
    assert measures["v"].to_pylist() == [g / 4.0 for g in range(1, 2001)]
    assert set(measures["region"].to_pylist()) == {"eu", "us"}
    empty = delta_table(config.table_path("public", "nothing_yet"))
    assert empty.num_rows == 0 and empty.column_names == ["id", "note", LSN_COLUMN]
    odd = delta_table(config.table_path("public", "MixedCase"))
    assert odd.to_pylist() == [{"id": 1, 'Odd, "name"': "odd", LSN_COLUMN: int(results[3].snapshot_lsn)}]
    for result in results:
        assert read_snapshot_lsn(spark, result.path) == result.snapshot_lsn
    assert len({r.snapshot_lsn for r in results}) == 4  # one temporary slot each
    (via_root,) = pg.execute(f"SELECT pubviaroot FROM pg_publication WHERE pubname = '{PUB}'")[0]
    assert via_root is True
    assert temporary_slots(pg) == []


# --------------------------------------------------------------------------- consistency with the slot


def test_resnapshot_replaces_rows_and_moves_the_snapshot_lsn(
    pg: PgDatabase, spark: SparkSession, tmp_path: Path
) -> None:
    pg.execute(
        f"""
        CREATE TABLE items (id int PRIMARY KEY, name text);
        INSERT INTO items SELECT g, 'v1-' || g FROM generate_series(1, 100) g;
        CREATE PUBLICATION {PUB} FOR TABLE items;
        """
    )
    path = str(tmp_path / "items")
    assert read_snapshot_lsn(spark, path) is None
    created = ensure_slot(pg.dsn, SLOT)
    assert isinstance(created, CreatedSlot)
    temp_seen: list[tuple[str, str]] = []

    def watch(progress: SnapshotProgress) -> None:
        temp_seen.extend(temporary_slots(pg))

    first = snapshot_table(
        pg.dsn,
        PUB,
        TableName("public", "items"),
        SparkDeltaDestination(spark, None),
        path,
        slot=SLOT,
        on_progress=watch,
    )
    (oid,) = pg.execute("SELECT 'items'::regclass::oid::int")[0]
    ((temp_name, temp_point),) = set(temp_seen)
    assert temp_name.startswith(f"pgcdc_sync_{oid}_") and len(temp_name) <= 63
    assert first.snapshot_lsn == LSN.parse(temp_point) >= created.consistent_point
    assert read_snapshot_lsn(spark, path) == first.snapshot_lsn

    pg.execute(
        "DELETE FROM items WHERE id > 50; UPDATE items SET name = 'v2-' || id WHERE id <= 10;"
        "INSERT INTO items VALUES (1000, 'new')"
    )
    second = snapshot_table(
        pg.dsn, PUB, TableName("public", "items"), SparkDeltaDestination(spark, None), path, slot=SLOT
    )
    table = delta_table(path).sort_by("id")
    assert table["id"].to_pylist() == [*range(1, 51), 1000]
    assert table["name"].to_pylist() == [f"v2-{g}" for g in range(1, 11)] + [f"v1-{g}" for g in range(11, 51)] + ["new"]
    assert set(table[LSN_COLUMN].to_pylist()) == {int(second.snapshot_lsn)}
    assert second.snapshot_lsn > first.snapshot_lsn and second.delta_version == first.delta_version + 1
    assert read_snapshot_lsn(spark, path) == second.snapshot_lsn
    history = deltalake.DeltaTable(path).history()
    ((relid,),) = pg.execute("SELECT 'items'::regclass::oid::int8")
    assert history[0]["userMetadata"] == (
        f'{{"pgcdc": {{"kind": "snapshot", "snapshot_lsn": "{second.snapshot_lsn}", "slot": "{SLOT}",'
        ' "table": "public.items", "layout": {"bucket_column": "_pgcdc_bucket", "kind": "range", "key": ["id"],'
        f' "size": 1000000}}, "columns": {{"attnums": {{"id": 1, "name": 2}}, "count": 2, "relid": {relid}}}}}}}'
    )
    state = ensure_slot(pg.dsn, SLOT)  # exists now: returned as it is
    assert not isinstance(state, CreatedSlot) and state.plugin == "pgoutput"


def test_change_committed_after_the_consistent_point_is_not_in_the_snapshot(
    pg: PgDatabase, spark: SparkSession, tmp_path: Path
) -> None:
    pg.execute(
        f"""
        CREATE TABLE events (id int PRIMARY KEY, what text);
        INSERT INTO events SELECT g, 'before' FROM generate_series(1, 2000) g;
        CREATE PUBLICATION {PUB} FOR TABLE events;
        """
    )
    ensure_slot(pg.dsn, SLOT)
    other = pg.connect()
    inserted_at: list[LSN] = []

    def insert_meanwhile(progress: SnapshotProgress) -> None:
        if not inserted_at:  # the snapshot transaction and its COPY are under way
            other.execute("INSERT INTO events VALUES (9999, 'during')")
            (lsn,) = other.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone() or ("",)
            inserted_at.append(LSN.parse(lsn))

    with other:
        result = snapshot_table(
            pg.dsn, PUB, TableName("public", "events"), SparkDeltaDestination(spark, None), str(tmp_path / "e"),
            slot=SLOT, chunk_rows=100, on_progress=insert_meanwhile,
        )  # fmt: skip
    table = delta_table(tmp_path / "e")
    assert table.num_rows == 2000 and 9999 not in table["id"].to_pylist()
    assert inserted_at[0] > result.snapshot_lsn
    # The permanent slot, older than the snapshot, still delivers the insert: nothing falls in a gap.
    changes = pg.execute(
        f"SELECT lsn::text, substr(data, 1, 1) FROM pg_logical_slot_peek_binary_changes('{SLOT}', NULL, NULL,"
        f" 'proto_version', '1', 'publication_names', '{PUB}')"
    )
    # Begin, Relation, Insert, Commit: the insert's record may start right at the consistent
    # point, but its transaction commits after it, so incremental runs apply it.
    assert [tag for _, tag in changes] == [b"B", b"R", b"I", b"C"]
    assert LSN.parse(changes[2][0]) >= result.snapshot_lsn and LSN.parse(changes[3][0]) > result.snapshot_lsn


#: What a snapshot's process (one worker) may add to its resident memory at its worst, whatever the
#: table's size: the rows in flight (COPY pieces, Arrow batches of ``chunk_bytes``) and delta-rs's
#: Parquet writer, which buffers a row group (16 MiB of Arrow data, ``ROW_GROUP_BYTES``) per open file
#: and has a runtime of its own. Measured 2026-11-26 with 1 KB rows: 172-205 MiB for 150k, 450k and
#: 1350k rows alike (nine runs); with row groups of 128k rows whatever their width, 211-319 MiB.
SNAPSHOT_PEAK_MIB = 384
#: How much more that peak may be for a table three times larger (290 MiB more): under half of what the
#: table grew. Measured: -14 to +24 MiB; with 128k-row groups, up to 132 MiB (a second bucket's open
#: file whose row group filled).
SNAPSHOT_GROWTH_MIB = 128
#: The most Arrow's pool may hold at once: pieces of ``chunk_bytes`` (4 MiB) in flight between the COPY,
#: its parser and delta-rs, which takes several before it writes. Measured 21-37 MiB on a quiet machine,
#: once 97 MiB in 26 runs (delta-rs read ahead of its writing): a fraction of either table.
SNAPSHOT_ARROW_MIB = 128


@pytest.mark.slow  # two table sizes copied in children to measure memory
def test_large_table_copies_with_bounded_memory(pg: PgDatabase, spark: SparkSession, tmp_path: Path) -> None:
    """Peak resident memory of a process that snapshots a 150k-row and a 450k-row table (1 KB rows,
    145 and 435 MiB): below a stated bound smaller than the larger table, and about the same for
    both, so the process holds pieces, not tables."""
    sizes = {"small": 150_000, "big": 450_000}
    for name, rows in sizes.items():
        pg.execute(f"""
            CREATE TABLE {name} (id int PRIMARY KEY, payload text);
            ALTER TABLE {name} ALTER payload SET STORAGE EXTERNAL;
            INSERT INTO {name} SELECT g, repeat(md5(g::text), 31) FROM generate_series(1, {rows}) g;
        """)
    pg.execute(f"CREATE PUBLICATION {PUB} FOR TABLE small, big")
    ensure_slot(pg.dsn, SLOT)
    chunk = 4 * 1024 * 1024
    memory = {
        name: measured("snapshot", pg.dsn, PUB, f"public.{name}", str(tmp_path / name), SLOT, str(chunk), "1", "64")
        for name in sizes
    }
    held = {name: report["peak_mib"] - report["baseline_mib"] for name, report in memory.items()}
    assert sizes["big"] * (31 * 32 + 8) > 420 * 2**20
    assert held["big"] < SNAPSHOT_PEAK_MIB, memory
    assert held["big"] - held["small"] < SNAPSHOT_GROWTH_MIB, memory
    assert all(report["arrow_max_mib"] < SNAPSHOT_ARROW_MIB for report in memory.values()), memory
    for name, rows in sizes.items():
        assert memory[name]["rows"] == rows
        assert_md5_payloads(str(tmp_path / name), rows)
        files = [pq.ParquetFile(uri) for uri in deltalake.DeltaTable(str(tmp_path / name)).file_uris()]
        groups = [file.metadata.row_group(i).num_rows for file in files for i in range(file.metadata.num_row_groups)]
        assert sum(groups) == rows and 8192 < max(groups) <= ROW_GROUP_BYTES // 1000  # 16 MiB of 1 KB rows
    # the payloads' generator agrees with PostgreSQL's md5
    assert pg.execute("SELECT repeat(md5('123456'), 31)")[0][0] == hashlib.md5(b"123456").hexdigest() * 31


# --------------------------------------------------------------------------- refusals


def _refused(action: Callable[[], object], error: type[Exception], *fragments: str) -> str:
    with pytest.raises(error) as caught:
        action()
    message = str(caught.value)
    assert "\n" not in message and ": " in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_bad_input_fails_clearly_and_writes_nothing(pg: PgDatabase, spark: SparkSession, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE b (id int PRIMARY KEY); INSERT INTO a VALUES (1)")
    root = tmp_path / "lake"

    _refused(lambda: snapshot_tables(make_config(pg, root), SparkDeltaDestination(spark, None)), ConfigurationError, f'"{PUB}" does not exist',
             "create_publication: true")  # fmt: skip
    _refused(lambda: ensure_publication(make_config(pg, root, create_publication=True)), ConfigurationError,
             "no tables are configured")  # fmt: skip
    pg.execute(f"CREATE PUBLICATION {PUB}")
    _refused(
        lambda: snapshot_tables(make_config(pg, root), SparkDeltaDestination(spark, None)),
        ConfigurationError,
        "publishes no tables",
    )
    pg.execute(f"ALTER PUBLICATION {PUB} ADD TABLE a")
    _refused(lambda: snapshot_tables(make_config(pg, root, tables=["public.b"]), SparkDeltaDestination(spark, None)), ConfigurationError,
             "public.b not published", "ALTER PUBLICATION")  # fmt: skip
    _refused(lambda: snapshot_tables(make_config(pg, root), SparkDeltaDestination(spark, None), tables=[TableName("public", "b")]),
             ConfigurationError, "public.b not published")  # fmt: skip
    _refused(lambda: snapshot_table(pg.dsn, PUB, TableName("public", "b"), SparkDeltaDestination(spark, None), str(root / "b"), slot=SLOT),
             ConfigurationError, "public.b", "not in publication")  # fmt: skip

    pg.execute(f"SELECT pg_create_logical_replication_slot('{SLOT}', 'test_decoding')")
    _refused(
        lambda: snapshot_tables(make_config(pg, root), SparkDeltaDestination(spark, None)),
        SlotError,
        "test_decoding",
        "not pgoutput",
    )
    pg.execute(f"SELECT pg_drop_replication_slot('{SLOT}')")
    pg.execute(f"SELECT pg_create_physical_replication_slot('{SLOT}')")
    _refused(lambda: ensure_slot(pg.dsn, SLOT), SlotError, "physical")
    pg.execute(f"SELECT pg_drop_replication_slot('{SLOT}')")
    with psycopg.connect(pg.server.dsn(), autocommit=True) as admin:
        admin.execute(f"SELECT pg_create_logical_replication_slot('{SLOT}', 'pgoutput')")
        try:
            _refused(lambda: ensure_slot(pg.dsn, SLOT), SlotError, 'belongs to database "postgres"')
        finally:
            admin.execute(f"SELECT pg_drop_replication_slot('{SLOT}')")

    assert lake_files(root) == []
    assert temporary_slots(pg) == []


def test_a_refused_value_fails_its_table_only(pg: PgDatabase, spark: SparkSession, tmp_path: Path) -> None:
    pg.execute(
        f"""
        CREATE TABLE good (id int PRIMARY KEY);
        INSERT INTO good SELECT generate_series(1, 10);
        CREATE TABLE prices (id int PRIMARY KEY, amount numeric(5,2));
        INSERT INTO prices VALUES (1, 1.5), (2, 'NaN');
        CREATE PUBLICATION {PUB} FOR TABLE good, prices;
        """
    )
    root = tmp_path / "lake"
    config = make_config(pg, root, snapshot={"parallel_tables": 2})
    message = _refused(
        lambda: snapshot_tables(config, lake_destination(spark, config)),
        SnapshotError,
        "public.prices",
        "'NaN'",
        "as text",
    )
    assert "amount" in message
    assert delta_table(config.table_path("public", "good")).num_rows == 10
    assert not (Path(config.table_path("public", "prices")) / "_delta_log").exists()
    assert read_snapshot_lsn(spark, config.table_path("public", "prices")) is None


# --------------------------------------------------------------------------- names and paths


@pytest.mark.parametrize(
    ("qualified", "schema", "name"),
    [
        ("public.orders", "public", "orders"),
        ("Public.Orders", "public", "orders"),  # unquoted identifiers fold to lower case
        ('public."Orders"', "public", "Orders"),
        ('"My Schema"."Mixed Case"', "My Schema", "Mixed Case"),
        ('"a.b"."c.d"', "a.b", "c.d"),  # dots inside quotes belong to the name
        ('"Odd Schema"."Odd ""Table"""', "Odd Schema", 'Odd "Table"'),
        (' public . "x y" ', "public", "x y"),
        ("ÄRGER.t", "Ärger", "t"),  # only ASCII letters fold, as in UTF-8 databases
    ],
)
def test_table_names_parse_like_postgresql(qualified: str, schema: str, name: str) -> None:
    assert TableName.parse(qualified) == TableName(schema, name)


@pytest.mark.parametrize("bad", ["orders", "a.b.c", '"a.b', "a.", "a..b", 'a.""', "a b.c", '"a"x.b'])
def test_malformed_table_names_are_refused(bad: str) -> None:
    with pytest.raises(ConfigurationError, match="table name"):
        TableName.parse(bad)


def test_table_paths_encode_names_sail_would_mangle(tmp_path: Path) -> None:
    config = make_config_from_dsn("postgresql:///x", tmp_path)
    assert config.table_path("public", "orders") == str(tmp_path / "public" / "orders")
    assert config.table_path("My Schema", "Mixed Case") == str(tmp_path / "My-20Schema" / "Mixed-20Case")
    assert config.table_path("a.b", "50%-off/é") == str(tmp_path / "a-2eb" / "50-25-2doff-2f-c3-a9")
    assert config.table_path("..", "x") == str(tmp_path / "-2e-2e" / "x")


def make_config_from_dsn(dsn: str, root: Path, **overrides: Any) -> PgcdcConfig:
    return parse_config(
        {"postgres": {"dsn": dsn}, "publication": PUB, "slot": SLOT, "delta": {"root": str(root)}, **overrides}
    )


def test_a_table_named_with_spaces_and_percent_replicates(pg: PgDatabase, spark: SparkSession, tmp_path: Path) -> None:
    from resources.runs.incremental import run_incremental
    from resources.testing.verify import assert_delta_equals_postgres

    pg.execute(
        """
        CREATE SCHEMA "Sales 2024";
        CREATE TABLE "Sales 2024"."Mixed Case" (id int PRIMARY KEY, "100% Note" text);
        INSERT INTO "Sales 2024"."Mixed Case" SELECT g, 'n' || g FROM generate_series(1, 50) g;
        """
    )
    root = tmp_path / "lake"
    config = make_config(pg, root, create_publication=True, tables=['"Sales 2024"."Mixed Case"'])
    (result,) = snapshot_tables(config, lake_destination(spark, config))
    path = config.table_path("Sales 2024", "Mixed Case")
    assert result.path == path and path.endswith("/Sales-202024/Mixed-20Case")
    assert sorted(p.name for p in (root / "Sales-202024").iterdir()) == ["Mixed-20Case"]
    assert not [p for p in root.rglob("*") if "%" in p.name]
    assert delta_table(path).num_rows == 50
    assert read_snapshot_lsn(spark, path) == result.snapshot_lsn

    pg.execute(
        """
        UPDATE "Sales 2024"."Mixed Case" SET "100% Note" = 'changed' WHERE id <= 10;
        DELETE FROM "Sales 2024"."Mixed Case" WHERE id > 45;
        INSERT INTO "Sales 2024"."Mixed Case" VALUES (100, 'new');
        """
    )
    run_incremental(config, lake_destination(spark, config), log=lambda *_: None)
    assert assert_delta_equals_postgres(pg.dsn, "Sales 2024.Mixed Case", path, key=("id",)) == 46
    assert not [p for p in root.rglob("*") if "%" in p.name]


def test_values_the_csv_reader_refuses_fall_back_to_the_exact_mapping(
    pg: PgDatabase, spark: SparkSession, tmp_path: Path
) -> None:
    """Typed CSV parsing is only a fast path: a piece holding infinity or a BC timestamp is
    converted by the text mapping, for that piece and the following ones."""
    pg.execute(
        f"""
        CREATE TABLE mixed (id int PRIMARY KEY, ts timestamptz, f float8, ok bool, n numeric(8,2), d date);
        INSERT INTO mixed SELECT g, timestamptz '2024-01-01 00:00:00+00' + g * interval '1 second',
            g / 3.0, g % 2 = 0, g / 7.0, date '2024-01-01' + g % 100 FROM generate_series(1, 30000) g;
        UPDATE mixed SET ts = 'infinity' WHERE id = 20000;
        UPDATE mixed SET ts = '0044-03-15 12:00:00+00 BC' WHERE id = 25000;
        UPDATE mixed SET f = 'NaN' WHERE id = 1;
        CREATE PUBLICATION {PUB} FOR TABLE mixed;
        """
    )
    ensure_slot(pg.dsn, SLOT)
    path = tmp_path / "mixed"
    snapshot_table(
        pg.dsn,
        PUB,
        TableName("public", "mixed"),
        SparkDeltaDestination(spark, None),
        str(path),
        slot=SLOT,
        chunk_bytes=256 * 1024,
    )
    with psycopg.connect(pg.dsn, autocommit=True, options=libpq_options(SESSION_SETTINGS)) as conn:
        cursor = conn.cursor(row_factory=psycopg.rows.dict_row)
        expected = cursor.execute(
            "SELECT id, CASE WHEN ts = 'infinity' THEN 9223372036854775807"
            " ELSE (extract(epoch FROM ts) * 1000000)::bigint END AS ts, f, ok, n, d FROM mixed ORDER BY id"
        ).fetchall()
    actual = _delta_rows(path)
    for row in actual:
        row.pop(LSN_COLUMN)
    _canonical_floats(expected, ["f"])
    _canonical_floats(actual, ["f"])
    assert actual == expected
    assert actual[19999]["ts"] == TIMESTAMP_POSITIVE_INFINITY
