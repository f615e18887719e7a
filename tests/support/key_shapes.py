"""Primary keys of every shape (types, composite keys, replica identity changes): the tables, a
workload over them, and drains compared with PostgreSQL or a subscriber oracle."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pyspark.sql import SparkSession

from resources.config import parse_config, PgcdcConfig
from resources.delta.layout import HASH, RANGE
from resources.delta.spark_destination import lake_destination
from resources.lsn import LSN
from resources.runs.incremental import IncrementalResult, run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.verify import assert_buckets_right, assert_delta_equals_postgres
from tests.support.postgres import PgDatabase

KEYS = 40
"""Key values 0..KEYS-1 per table (the first 30 exist after the set-up)."""


@dataclass(frozen=True)
class KeyShape:
    """A table ``k_<name>`` keyed by ``columns`` of ``types``; ``values(i)`` are the SQL literals of key i."""

    name: str
    columns: tuple[str, ...]
    types: tuple[str, ...]
    values: Callable[[int], tuple[str, ...]]
    #: Key values the type has (a boolean key has two).
    space: int = KEYS
    #: How the primary key is declared (default: PRIMARY KEY over ``columns``).
    key_clause: str = ""
    #: The layout kind the snapshot must choose (None: not bucketed).
    layout: str | None = HASH

    @property
    def table(self) -> str:
        return f"k_{self.name}"

    def key_match(self, i: int) -> str:
        return f"({', '.join(self.columns)}) = ({', '.join(self.values(i))})"


def _one(column_type: str, literal: Callable[[int], str], name: str | None = None, **options: object) -> KeyShape:
    return KeyShape(name or column_type.split("(")[0], ("k",), (column_type,), lambda i: (literal(i),), **options)  # type: ignore[arg-type]


SHAPES = [
    _one("int2", lambda i: f"{i * 7 - 100}::int2", layout=RANGE),
    _one("int4", lambda i: f"{i * 1000}", layout=RANGE),
    _one("int8", lambda i: f"{i * 10**12}::int8", layout=RANGE),
    _one("numeric(12,3)", lambda i: f"{i / 8:.3f}"),
    # floats, hashed by their bits: NaN, an infinity and 0 among the keys (PostgreSQL's = holds NaN equal to NaN)
    _one("float8", lambda i: "'NaN'::float8" if i == KEYS - 1 else f"{i / 8 - 2}::float8"),
    _one("float4", lambda i: "'-Infinity'::float4" if i == KEYS - 2 else f"{i / 4 - 3}::float4"),
    _one("text", lambda i: f"'key {i} ü'"),
    _one("varchar(20)", lambda i: f"'v{i:04d}'"),
    _one("citext", lambda i: f"'Key{i}'::citext"),
    _one("uuid", lambda i: f"md5('{i}')::uuid"),
    _one("date", lambda i: f"date '2000-01-01' + {i * 37}"),
    _one("timestamp", lambda i: f"timestamp '2001-02-03 04:05:06.789' + {i} * interval '1 day 1 second'"),
    _one("timestamptz", lambda i: f"timestamptz '2001-02-03 04:05:06+02' + {i} * interval '1 hour'"),
    _one("interval", lambda i: f"make_interval(secs => {i * 61})"),
    _one("bytea", lambda i: f"decode(md5('{i}'), 'hex')"),
    _one("bool", lambda i: "true" if i % 2 else "false", space=2),
    _one("mood", lambda i: f"'m{i}'::mood", name="enum"),
    _one("int4[]", lambda i: f"ARRAY[{i}, {i % 3}, NULL]::int4[]", name="array"),
    _one("text[]", lambda i: f"ARRAY['a{i}', 'b']", name="text_array"),
    _one("pair", lambda i: f"ROW({i}, 'p{i}')::pair", name="composite"),
    _one("int4range", lambda i: f"int4range({i}, {i + 10})", name="range"),
    _one("code", lambda i: f"'c{i}'::code", name="domain"),
    KeyShape(
        "mixed",
        ("a", "b", "c"),
        ("text", "int4", "date"),
        lambda i: (f"'a{i % 5}'", f"{i // 5}", f"date '2020-01-01' + {i % 3}"),
    ),
    KeyShape(
        "mixed2",
        ("x", "y", "z"),
        ("uuid", "numeric(10,2)", "bool"),
        lambda i: (f"md5('{i // 2}')::uuid", f"{i}.5", "true" if i % 2 else "false"),
    ),
    KeyShape(
        "include", ("k",), ("int4",), lambda i: (f"{i}",), key_clause="PRIMARY KEY (k) INCLUDE (v, note)", layout=RANGE
    ),
    KeyShape("unique_index", ("k",), ("text",), lambda i: (f"'u{i}'",), key_clause="UNIQUE (k)"),
]

TYPES_DDL = """
    CREATE EXTENSION IF NOT EXISTS citext;
    CREATE TYPE mood AS ENUM ({labels});
    CREATE TYPE pair AS (n int, s text);
    CREATE DOMAIN code AS text CHECK (VALUE <> '');
""".format(labels=", ".join(f"'m{i}'" for i in range(KEYS)))


def key_shapes_ddl(shapes: list[KeyShape]) -> str:
    statements = [TYPES_DDL]
    for shape in shapes:
        columns = ", ".join(f"{c} {t} NOT NULL" for c, t in zip(shape.columns, shape.types))
        key = shape.key_clause or f"PRIMARY KEY ({', '.join(shape.columns)})"
        statements.append(f"CREATE TABLE {shape.table} ({columns}, v int, note text, body text, {key});")
        statements.append(f"ALTER TABLE {shape.table} ALTER COLUMN body SET STORAGE EXTERNAL;")
        if shape.name == "unique_index":
            statements.append(f"ALTER TABLE {shape.table} REPLICA IDENTITY USING INDEX {shape.table}_k_key;")
        for i in range(min(30, shape.space)):
            statements.append(_insert(shape, i, i, big=i % 4 == 0))
    statements.append(f"CREATE PUBLICATION pub FOR TABLE {', '.join(shape.table for shape in shapes)};")
    return "\n".join(statements)


def _insert(shape: KeyShape, i: int, v: int, big: bool = False) -> str:
    body = f"repeat(md5('{v}'), 100)" if big else f"'b{v}'"
    return (
        f"INSERT INTO {shape.table} ({', '.join(shape.columns)}, v, note, body)"
        f" SELECT {', '.join(shape.values(i))}, {v}, 'n{v}', {body}"
        f" WHERE NOT EXISTS (SELECT 1 FROM {shape.table} WHERE {shape.key_match(i)});"
    )


@dataclass
class Workload:
    """Random row changes per table, seeded; ``insert_only`` tables (REPLICA IDENTITY NOTHING) get inserts only."""

    shapes: list[KeyShape]
    rng: random.Random
    insert_only: set[str] = field(default_factory=set)

    def statements(self, count: int) -> list[str]:
        sql = []
        for _ in range(count):
            shape = self.rng.choice(self.shapes)
            i, j, v = self.rng.randrange(shape.space), self.rng.randrange(shape.space), self.rng.randrange(10**6)
            x = 0.0 if shape.table in self.insert_only else self.rng.random()
            if x < 0.3:
                sql.append(_insert(shape, i, v, big=self.rng.random() < 0.2))
            elif x < 0.55:  # body untouched: unchanged TOAST in the new image
                sql.append(f"UPDATE {shape.table} SET v = {v} WHERE {shape.key_match(i)};")
            elif x < 0.8:  # the key moves
                sql.append(
                    f"UPDATE {shape.table} SET ({', '.join(shape.columns)}) = ROW({', '.join(shape.values(j))}), v = {v}"
                    f" WHERE {shape.key_match(i)} AND NOT EXISTS (SELECT 1 FROM {shape.table} WHERE {shape.key_match(j)});"
                )
            else:
                sql.append(f"DELETE FROM {shape.table} WHERE {shape.key_match(i)};")
        return sql


@dataclass(frozen=True)
class IdentityChange:
    """DDL on one table between drains, run on the subscriber (``subscriber_first``), then on the
    publisher, then, once the subscriber has caught up, on the subscriber again (``subscriber_then``);
    ``prunes``: whether the next drain still prunes by the layout (None: the table is only appended to)."""

    table: str
    publisher: str
    prunes: bool | None
    subscriber_first: str | None = None
    subscriber_then: str = ""

    @property
    def first(self) -> str:
        return self.publisher if self.subscriber_first is None else self.subscriber_first


def _same(table: str, ddl: str, prunes: bool | None) -> IdentityChange:
    return IdentityChange(table, ddl, prunes)


def _new_unique_column(table: str, identity: str, prunes: bool) -> IdentityChange:
    """A NOT NULL column ``u`` with the same values on both sides (from the key, then from a sequence
    by a trigger on the publisher only: a default set on a filled column would be refused as one
    PostgreSQL may have written unlogged), then ``identity`` (DDL making ``u`` the identity) on both."""
    return IdentityChange(
        table,
        f"CREATE SEQUENCE {table}_u_seq START 1000000; ALTER TABLE {table} ADD COLUMN u bigint;"
        f" UPDATE {table} SET u = ('x' || left(md5(k::text), 15))::bit(60)::bigint;"
        f" CREATE FUNCTION {table}_u() RETURNS trigger LANGUAGE plpgsql AS"
        f" $$BEGIN NEW.u := coalesce(NEW.u, nextval('{table}_u_seq')); RETURN NEW; END$$;"
        f" CREATE TRIGGER {table}_u BEFORE INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION {table}_u();"
        f" ALTER TABLE {table} ALTER COLUMN u SET NOT NULL; {identity}",
        prunes,
        subscriber_first=f"ALTER TABLE {table} ADD COLUMN u bigint",
        subscriber_then=f"ALTER TABLE {table} ALTER COLUMN u SET NOT NULL; {identity}",
    )


#: Replica identity changes between drains.
IDENTITY_CHANGES = [
    [  # after the first drain
        _same("k_text", "ALTER TABLE k_text REPLICA IDENTITY FULL", True),  # the primary key still matches
        _new_unique_column(
            "k_uuid",
            "CREATE UNIQUE INDEX k_uuid_u ON k_uuid (u); ALTER TABLE k_uuid REPLICA IDENTITY USING INDEX k_uuid_u",
            False,
        ),
        _new_unique_column(
            "k_bytea",
            "ALTER TABLE k_bytea DROP CONSTRAINT k_bytea_pkey; ALTER TABLE k_bytea ADD PRIMARY KEY (u)",
            False,
        ),
        _same("k_int4", "ALTER TABLE k_int4 ALTER COLUMN k TYPE bigint", True),  # a key column widened
        _same("k_date", "ALTER TABLE k_date REPLICA IDENTITY NOTHING", None),  # inserts only: appended
        _same(
            "k_enum", "ALTER TABLE k_enum REPLICA IDENTITY FULL; ALTER TABLE k_enum DROP CONSTRAINT k_enum_pkey", False
        ),
        _same("k_mixed", "ALTER TABLE k_mixed REPLICA IDENTITY FULL", True),
    ],
    [  # after the second drain: back again, where there is a way back
        _same("k_uuid", "ALTER TABLE k_uuid REPLICA IDENTITY DEFAULT", True),
        _same("k_date", "ALTER TABLE k_date REPLICA IDENTITY DEFAULT", True),
        _same("k_enum", "ALTER TABLE k_enum ADD PRIMARY KEY (k); ALTER TABLE k_enum REPLICA IDENTITY DEFAULT", True),
        _same("k_mixed", "ALTER TABLE k_mixed REPLICA IDENTITY DEFAULT", True),
        _same("k_unique_index", "ALTER TABLE k_unique_index REPLICA IDENTITY FULL", False),  # FULL, no primary key
    ],
]


class Oracle(Protocol):
    """What a drain is compared with: PostgreSQL's subscriber, or the publisher itself (no DDL to mirror)."""

    def mirror(self, sql: str) -> None: ...

    def caught_up(self, lsn: LSN) -> None: ...

    def assert_matches_delta(self, config: PgcdcConfig) -> dict[str, int]: ...


@dataclass
class PublisherOracle:
    """For the engines too slow for a subscriber's pace: the whole tables are published, so the
    publisher's tables are the expected state."""

    pg: PgDatabase
    shapes: list[KeyShape]

    def mirror(self, sql: str) -> None:
        pass

    def caught_up(self, lsn: LSN) -> None:
        pass

    def assert_matches_delta(self, config: PgcdcConfig) -> dict[str, int]:
        return {
            f"public.{shape.table}": assert_delta_equals_postgres(
                self.pg.dsn, f"public.{shape.table}", config.table_path("public", shape.table)
            )
            for shape in self.shapes
        }


def _compare(
    oracle: Oracle, result: IncrementalResult | None, config: PgcdcConfig, shapes: list[KeyShape], drain: str
) -> None:
    if result is not None:
        oracle.caught_up(result.end_lsn)
    counts = oracle.assert_matches_delta(config)
    assert set(counts) == {f"public.{shape.table}" for shape in shapes}, drain
    for shape in shapes:
        layout = assert_buckets_right(config.table_path("public", shape.table))
        assert (layout.kind if layout else None) == shape.layout, (drain, shape.table, layout)


def run_key_shapes(
    pg: PgDatabase,
    config: PgcdcConfig,
    spark: SparkSession,
    oracle: Oracle,
    shapes: list[KeyShape],
    identity_changes: list[list[IdentityChange]],
    statements_per_drain: int,
    truncated: tuple[str, ...],
) -> None:
    """Snapshot the tables of ``shapes`` (created and published already), then drain after each
    round of ``identity_changes`` (and once before and after them), each round with random row
    changes and, in the second, a TRUNCATE of ``truncated``; compare after the snapshot and every drain."""
    results = {str(result.table): result for result in snapshot_tables(config, lake_destination(spark, config))}
    in_ranges = {name for name, result in results.items() if result.key_ranges and result.chunks > 1}
    integer_keys = {f"public.{shape.table}" for shape in shapes if shape.layout == RANGE}
    assert in_ranges == (integer_keys if config.snapshot.chunked_above_mb < 1 else set()), in_ranges
    _compare(oracle, None, config, shapes, "snapshot")

    workload = Workload(shapes, random.Random(20261125 + pg.major + len(in_ranges)))
    prunes: dict[str, bool] = {}  # the tables whose MERGEs must read every bucket now: False
    for drain, changes in enumerate([[], *identity_changes, []]):
        with pg.connect() as conn:
            for change in changes:
                oracle.mirror(change.first)
                conn.execute(change.publisher)
            if any(change.subscriber_then for change in changes):
                ((position,),) = conn.execute("SELECT pg_current_wal_lsn()::text").fetchall()
                oracle.caught_up(LSN.parse(position))
                for change in changes:
                    if change.subscriber_then:
                        oracle.mirror(change.subscriber_then)
            for change in changes:
                if change.prunes is None:
                    workload.insert_only.add(change.table)
                else:
                    workload.insert_only.discard(change.table)
                    prunes[change.table] = change.prunes
                    # every changed table gets a change, so the drain meets its new relation
                    conn.execute(
                        f"UPDATE {change.table} SET v = -1 WHERE ctid = (SELECT min(ctid) FROM {change.table})"
                    )
            for sql in workload.statements(statements_per_drain):
                conn.execute(sql)
            if drain == 2:
                conn.execute(f"TRUNCATE {', '.join(truncated)}")
                for shape in shapes:
                    if shape.table in truncated:
                        for i in range(5):
                            conn.execute(_insert(shape, i, i + 7, big=i == 0))
        result = run_incremental(config, lake_destination(spark, config), max_chunk_changes=97)
        _compare(oracle, result, config, shapes, f"drain {drain + 1}")
        for name, table in result.tables.items():
            if (
                table.inserted + table.updated + table.deleted
                and name.removeprefix("public.") not in workload.insert_only
            ):
                expected = prunes.get(name.removeprefix("public."), True)
                assert (table.unpruned is None) == expected, (drain, name, table.unpruned)


def key_shapes_config(pg: PgDatabase, root: Path, chunked: bool, **spark: object) -> PgcdcConfig:
    settings: dict = {
        "postgres": {"dsn": pg.dsn},
        "publication": "pub",
        "slot": f"keys_{pg.name}",
        "delta": {"root": str(root)},
        "spark": spark,
    }
    if chunked:  # every table above the threshold: integer keys in ranges, the others in one snapshot
        settings["snapshot"] = {"chunked_above_mb": 0.001, "key_chunk_mb": 0.004}
    return parse_config(settings)
