"""No object a database user plants can run inside a pgcdc session (PostgreSQL 15 and 18).

Look-alikes of every function, aggregate, operator, type and catalog relation pgcdc's SQL
names are planted in ``public`` and in a schema ``evil`` that ``ALTER DATABASE`` and
``ALTER ROLE ... IN DATABASE`` put first on the search path. Each one writes a row to
``public.planted_calls`` when it runs and returns a plausible wrong value. pgcdc runs as a
role holding only the grants the README documents, through the snapshot job, a drain with
its asset checks, the reconciliation job, the three sensors and ``pgcdc changes``; nothing may be called and Delta
must equal PostgreSQL.

Two defenses are tested apart: the empty search_path every pgcdc session starts with
(``resources/postgres/connections.py``), and, with that switched to ``evil, pg_catalog, public``
(planted objects first, even before pg_catalog), the schema-qualified SQL alone.
"""

from __future__ import annotations

import io
import json
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from dagster import DagsterInstance, instance_for_test, RunRequest, SkipReason

import resources.postgres.connections
from pgcdc_assets.builder import build_definitions
from resources.postgres.connections import connect
from resources.runs.cli import build_parser, print_changes
from resources.testing.verify import assert_delta_equals_postgres, delta_rows
from tests.support.dagster_runs import check_outcomes, evaluate, run_job, write_config
from tests.support.postgres import PgDatabase

pytest_plugins = ["tests.support.spark_fixtures"]
pytestmark = pytest.mark.slow  # Dagster runs under hostile search paths; tiers: docs/testing.md

PLANTED_IN = ("public", "evil")

#: Functions pgcdc calls (and a few its row filter and the oracle call), each with overloads
#: that would be exact matches for unqualified calls with int, bigint, text or name arguments,
#: and the plausible wrong value they return.
FUNCTIONS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "pg_get_replica_identity_index": (("integer", "bigint", "oid", "text", "regclass"), "regclass", "NULL"),
    "format_type": (("integer, integer", "bigint, integer", "oid, integer"), "text", "'text'"),
    "current_setting": (("text", "name", "text, boolean"), "text", "'90000'"),
    "pg_current_wal_lsn": (("",), "pg_lsn", "'0/1'"),
    "pg_current_wal_flush_lsn": (("",), "pg_lsn", "'0/1'"),
    "pg_wal_lsn_diff": (("pg_lsn, pg_lsn", "text, text"), "numeric", "0"),
    "current_database": (("",), "name", "'postgres'"),
    "pg_drop_replication_slot": (("name", "text"), "void", ""),
    "array_to_string": (("anyarray, text", "text[], text", "name[], text"), "text", "''"),
    "format": (("text", "text, text", "text, integer", "text, bigint"), "text", "'planted'"),
    "lower": (("text", "character varying", "name"), "text", "'a'"),
    "set_config": (("text, text, boolean",), "text", "''"),
    "date_part": (("text, timestamp without time zone", "text, timestamp with time zone"), "double precision", "0"),
}
#: Set-returning functions, as (arguments, result): they return no rows.
PARTITION_TREE = "TABLE(relid regclass, parentrelid regclass, isleaf boolean, level integer)"
SET_FUNCTIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "unnest": (
        ("oid[]", "SETOF oid"),
        ("integer[]", "SETOF integer"),
        ("bigint[]", "SETOF bigint"),
        ("text[]", "SETOF text"),
        ("anyarray", "SETOF anyelement"),
    ),
    "pg_partition_tree": tuple((arguments, PARTITION_TREE) for arguments in ("oid", "bigint", "integer", "regclass")),
}
#: Operators on the types pgcdc compares: name/text/oid/int/char/varchar/timestamp.
OPERATORS: dict[str, tuple[tuple[str, str], ...]] = {
    "=": (
        ("name", "name"),
        ("name", "text"),
        ("text", "name"),
        ("text", "text"),
        ("oid", "oid"),
        ("oid", "regclass"),
        ("regclass", "oid"),
        ("oid", "integer"),
        ("oid", "bigint"),
        ("integer", "oid"),
        ("smallint", "smallint"),
        ("smallint", "integer"),
        ("integer", "integer"),
        ("bigint", "bigint"),
        ('"char"', '"char"'),
        ('"char"', "text"),
        ("character varying", "character varying"),
        ("character varying", "text"),
        ("timestamp without time zone", "timestamp without time zone"),
    ),
    "<>": (('"char"', '"char"'), ("oid", "oid"), ("integer", "integer"), ('"char"', "text")),
    ">": (("smallint", "integer"), ("smallint", "smallint"), ("integer", "integer")),
    "+": (("integer", "integer"),),
    "*": (("numeric", "integer"), ("numeric", "numeric")),
    "%": (("integer", "integer"),),
    "~~": (("character varying", "text"), ("text", "text")),
}
#: Catalog relations pgcdc reads: shadowed by views that log when scanned.
RELATIONS = (
    "pg_class", "pg_namespace", "pg_attribute", "pg_index", "pg_type", "pg_publication",
    "pg_publication_tables", "pg_replication_slots", "pg_settings",
)  # fmt: skip
#: pg_attribute's columns pgcdc reads (a view cannot have its anyarray attmissingval).
ATTRIBUTE_COLUMNS = (
    "attrelid, attname, atttypid, attnum, atttypmod, attnotnull, attisdropped, atthasmissing, atthasdef,"
    " attgenerated, attmissingval::text::text[] AS attmissingval"
)
#: Types pgcdc's SQL names: shadowed by domains whose check logs.
TYPES = ("text", "name", "oid", "int2", "int4", "int8", "regclass", "bool")


def planting_sql(schema: str) -> str:
    """Look-alikes in ``schema``; written with pg_catalog first, so they never call each other."""
    log = (  # a read-only transaction (the snapshot's) cannot take the row: there the call fails, naming itself
        "IF pg_catalog.current_setting('transaction_read_only') OPERATOR(pg_catalog.=) 'on'"
        " THEN RAISE EXCEPTION 'planted % called', {what}; END IF;"
        " INSERT INTO public.planted_calls VALUES ({what}, pg_catalog.current_setting('application_name'))"
    )
    statements = [
        f"CREATE SCHEMA IF NOT EXISTS {schema}",
        f"GRANT USAGE ON SCHEMA {schema} TO PUBLIC",
        f"CREATE FUNCTION {schema}.planted_seen(what text) RETURNS boolean LANGUAGE plpgsql AS"
        f" $$BEGIN {log.format(what='what')}; RETURN true; END$$",
    ]
    for name, (signatures, returns, value) in FUNCTIONS.items():
        for arguments in signatures:
            what = f"'{schema}.{name}({arguments})'"
            ret = "RETURN" if returns == "void" else f"RETURN {value}"
            statements.append(
                f"CREATE FUNCTION {schema}.{name}({arguments}) RETURNS {returns} LANGUAGE plpgsql AS"
                f" $$BEGIN {log.format(what=what)}; {ret}; END$$"
            )
    for name, signatures in SET_FUNCTIONS.items():
        for arguments, returns in signatures:
            what = f"'{schema}.{name}({arguments})'"
            statements.append(
                f"CREATE FUNCTION {schema}.{name}({arguments}) RETURNS {returns} LANGUAGE plpgsql AS"
                f" $$BEGIN {log.format(what=what)}; RETURN; END$$"
            )
    statements += [
        f"CREATE FUNCTION {schema}.planted_count(bigint) RETURNS bigint LANGUAGE plpgsql AS"
        f" $$BEGIN {log.format(what=repr(f'{schema}.count(*)'))}; RETURN $1 OPERATOR(pg_catalog.+) 2; END$$",
        f"CREATE AGGREGATE {schema}.count(*) (SFUNC = {schema}.planted_count, STYPE = bigint, INITCOND = '0')",
    ]
    for number, (operator, pairs) in enumerate(OPERATORS.items()):
        for index, (left, right) in enumerate(pairs):
            function = f"{schema}.planted_op_{number}_{index}"
            what = f"'{schema}.{operator}({left}, {right})'"
            returns = "boolean" if operator in ("=", "<>", ">", "~~") else left
            wrong = f"NOT ($1 OPERATOR(pg_catalog.{operator}) $2)" if returns == "boolean" else "$1"
            statements += [
                f"CREATE FUNCTION {function}({left}, {right}) RETURNS {returns} LANGUAGE plpgsql AS"
                f" $$BEGIN {log.format(what=what)}; RETURN {wrong}; END$$",
                f"CREATE OPERATOR {schema}.{operator} (LEFTARG = {left}, RIGHTARG = {right}, FUNCTION = {function})",
            ]
    for relation in RELATIONS:
        columns = ATTRIBUTE_COLUMNS if relation == "pg_attribute" else "*"
        statements.append(
            f"CREATE VIEW {schema}.{relation} AS SELECT {columns} FROM pg_catalog.{relation}"
            f" WHERE {schema}.planted_seen('{schema}.{relation}')"
        )
    for type_name in TYPES:
        statements.append(
            f"CREATE DOMAIN {schema}.{type_name} AS pg_catalog.{type_name}"
            f" CHECK ({schema}.planted_seen('{schema}.{type_name}'))"
        )
    statements.append(f"GRANT SELECT ON {', '.join(f'{schema}.{relation}' for relation in RELATIONS)} TO PUBLIC")
    return ";\n".join(statements)


SOURCE_DDL = """
CREATE TYPE public.mood AS ENUM ('ok', 'sad');
CREATE DOMAIN public.price AS numeric(8,2);
CREATE TABLE public.orders (id bigint PRIMARY KEY, customer varchar(40), amount numeric(10,2), tags int[],
                            placed timestamp, mood public.mood, price public.price);
INSERT INTO public.orders SELECT g, 'c' || g, g * 1.25, ARRAY[g, NULL], timestamp '2024-01-01' + g * interval '1 s',
                                 'ok', g FROM generate_series(1, 200) g;
CREATE TABLE public.ident (code text NOT NULL, n int);
CREATE UNIQUE INDEX ident_code ON public.ident (code);
ALTER TABLE public.ident REPLICA IDENTITY USING INDEX ident_code;
INSERT INTO public.ident VALUES ('a', 1), ('b', 2), ('c', 3);
-- A row filter's columns must be in the replica identity for UPDATE and DELETE to be published.
CREATE TABLE public.filtered (id int, name varchar(20), PRIMARY KEY (id, name));
INSERT INTO public.filtered SELECT g, CASE WHEN g % 3 = 0 THEN 'Abc' || g ELSE 'x' || g END
                            FROM generate_series(1, 60) g;
CREATE TABLE public.events (id int, region text, note text, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
CREATE TABLE public.events_eu PARTITION OF public.events FOR VALUES IN ('eu');
CREATE TABLE public.events_us PARTITION OF public.events FOR VALUES IN ('us');
INSERT INTO public.events SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, 'n' || g FROM generate_series(1, 40) g;
CREATE PUBLICATION pgcdc_pub FOR TABLE public.orders, public.ident, public.events,
    public.filtered WHERE (lower(name) LIKE 'a%' AND id % 2 = 0)
    WITH (publish_via_partition_root = true);
CREATE TABLE public.planted_calls (what text, application text);
GRANT INSERT ON public.planted_calls TO PUBLIC;
"""

#: The row filter of public.filtered, for computing what Delta must hold.
FILTER = "lower(name) LIKE 'a%' AND id % 2 = 0"

CHANGES = """
INSERT INTO public.orders VALUES (501, 'new', 9.99, '{7}', '2025-01-01', 'sad', 3.5);
UPDATE public.orders SET customer = 'changed', amount = amount + 1 WHERE id IN (1, 2);
DELETE FROM public.orders WHERE id = 3;
UPDATE public.ident SET n = 20 WHERE code = 'b';
UPDATE public.ident SET code = 'cc' WHERE code = 'c';
DELETE FROM public.ident WHERE code = 'a';
INSERT INTO public.filtered VALUES (100, 'abc'), (101, 'abd'), (102, 'zzz');
UPDATE public.filtered SET name = 'x' WHERE id = 6;
ALTER TABLE public.events ADD COLUMN flag boolean NOT NULL DEFAULT true;
INSERT INTO public.events VALUES (41, 'eu', 'late', false);
UPDATE public.events SET note = 'moved', region = 'us' WHERE id = 2;
"""


@dataclass
class Source:
    """The test database with planted objects, and pgcdc's role in it."""

    pg: PgDatabase
    role: str

    @property
    def dsn(self) -> str:
        """pgcdc's DSN; its own ``options`` ask for the planted schema too (pgcdc must override it)."""
        return self.pg.server.dsn(self.pg.name, user=self.role) + "?options=-c%20search_path%3Devil,public"

    def owner(self) -> psycopg.Connection:
        """The table owner's session for the workload; an empty search_path keeps it clear of the planted objects."""
        return psycopg.connect(self.pg.dsn, autocommit=True, options="-c search_path=")

    def planted_calls(self) -> list[tuple[str, str]]:
        with self.owner() as conn:
            return conn.execute("SELECT what, application FROM public.planted_calls").fetchall()


@pytest.fixture
def source(pg: PgDatabase) -> Iterator[Source]:
    """Planted objects in public and evil, ``evil, public`` as the database's and the role's search_path,
    and a pgcdc role with exactly the README's grants (LOGIN, REPLICATION, SELECT on the published tables)."""
    role = f"pgcdc_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg.dsn, autocommit=True, options="-c search_path=pg_catalog") as admin:
        admin.execute(SOURCE_DDL)
        for schema in PLANTED_IN:
            admin.execute(planting_sql(schema))
        admin.execute(f'CREATE ROLE "{role}" LOGIN REPLICATION')
        admin.execute(f'GRANT SELECT ON public.orders, public.ident, public.filtered, public.events TO "{role}"')
        admin.execute(f'ALTER DATABASE "{pg.name}" SET search_path = evil, public')
        admin.execute(f'ALTER ROLE "{role}" IN DATABASE "{pg.name}" SET search_path = evil, public')
    try:
        yield Source(pg, role)
    finally:
        with psycopg.connect(pg.dsn, autocommit=True, options="-c search_path=") as admin:
            admin.execute(
                "SELECT pg_catalog.pg_terminate_backend(pid) FROM pg_catalog.pg_stat_activity"
                " WHERE usename OPERATOR(pg_catalog.=) %s::pg_catalog.name",
                (role,),
            )
            admin.execute(f'DROP OWNED BY "{role}"')
            admin.execute(f'DROP ROLE "{role}"')


@pytest.fixture(params=["empty search_path", "qualified SQL alone"])
def defense(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both defenses together as shipped, or the schema-qualified SQL in sessions that search
    the planted schemas first (the connect-time setting swapped for a hostile one)."""
    if request.param == "qualified SQL alone":
        monkeypatch.setattr(
            resources.postgres.connections, "SEARCH_PATH_SETTINGS", {"search_path": "evil, pg_catalog, public"}
        )
    return str(request.param)


@pytest.fixture
def instance() -> Iterator[DagsterInstance]:
    with instance_for_test() as instance:
        yield instance


def test_planted_objects_catch_unqualified_sql(source: Source) -> None:
    """The trap works: the user's own session resolves the old unqualified calls to the planted ones."""
    with psycopg.connect(source.dsn, autocommit=True) as user:
        ((oid,),) = user.execute("SELECT 'public.ident'::regclass::oid::int").fetchall()
        assert user.execute(f"SELECT pg_get_replica_identity_index({oid})").fetchall() == [(None,)]
        assert user.execute("SELECT * FROM unnest('{23}'::oid[])").fetchall() == []
        assert user.execute("SELECT 'ident_code'::regclass::oid = 'ident_code'::regclass").fetchall() == [(False,)]
    assert Counter(what for what, _ in source.planted_calls()) == {
        "evil.pg_get_replica_identity_index(integer)": 1,
        "evil.unnest(oid[])": 1,
        "evil.=(oid, regclass)": 1,
    }


def test_every_pgcdc_session_starts_with_an_empty_search_path(source: Source, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over ALTER DATABASE, ALTER ROLE and the DSN's own options, normal and walsender sessions alike;
    the DSN's (or PGOPTIONS') other settings are kept."""
    schemas = "SELECT pg_catalog.current_schemas(true)::pg_catalog.text, pg_catalog.current_setting('work_mem')"
    with_options = source.dsn.replace("search_path%3Devil,public", "search_path%3Devil%20-c%20work_mem%3D7MB")
    for replication in (False, True):
        with connect(with_options, application_name="pgcdc-test", replication=replication) as conn:
            assert conn.execute(schemas).fetchall() == [("{pg_catalog}", "7MB")]
    monkeypatch.setenv("PGOPTIONS", "-c work_mem=9MB -c search_path=evil")
    plain = source.pg.server.dsn(source.pg.name, user=source.role)
    for replication in (False, True):
        with connect(plain, application_name="pgcdc-test", replication=replication) as conn:
            assert conn.execute(schemas).fetchall() == [("{pg_catalog}", "9MB")]
    assert source.planted_calls() == []


def test_snapshot_drain_checks_sensors_and_changes_call_nothing_planted(
    source: Source, defense: str, tmp_path: Path, instance: DagsterInstance
) -> None:
    config = write_config(tmp_path, source.pg, postgres={"dsn": source.dsn}, sensors={"lag_bytes": 1})
    defs = build_definitions(config)
    lake = tmp_path / "lake"
    run_job(defs, instance, "pgcdc_snapshot")
    assert_source_equals_delta(source, lake)
    assert_no_planted_calls(source)

    with source.owner() as owner:
        owner.execute(CHANGES)
    assert isinstance(evaluate(defs, "pgcdc_slot_lag_sensor", instance, config), RunRequest)
    assert isinstance(evaluate(defs, "pgcdc_slot_health_sensor", instance, config), SkipReason)
    assert isinstance(evaluate(defs, "pgcdc_new_tables_sensor", instance, config), SkipReason)
    result = run_job(defs, instance, "pgcdc_incremental")
    assert set(check_outcomes(result).values()) == {True}
    assert len(check_outcomes(result)) == 4 + 1  # the schema checks (first drain after the snapshot) and the slot's lag
    assert_source_equals_delta(source, lake)
    reconciled = run_job(defs, instance, "pgcdc_reconcile")  # row filter and column list: only published rows
    assert set(check_outcomes(reconciled).values()) == {True}
    assert len(check_outcomes(reconciled)) == 4 * 2

    args = build_parser().parse_args(
        ["changes", "--dsn", source.dsn, "--slot", "peek", "--publication", "pgcdc_pub", "--create-slot"]
    )
    print_changes(args, io.StringIO())
    with source.owner() as owner:
        owner.execute("UPDATE public.ident SET n = 21 WHERE code = 'b'")
    printed = io.StringIO()
    print_changes(args, printed)
    updates = [change for change in map(json.loads, printed.getvalue().splitlines()) if change["type"] == "update"]
    assert [update["new"] for update in updates] == [{"code": "b", "n": "21"}]
    assert_no_planted_calls(source)


def assert_no_planted_calls(source: Source) -> None:
    calls = source.planted_calls()
    assert calls == [], f"planted objects ran inside pgcdc's sessions: {sorted(set(calls))}"


def assert_source_equals_delta(source: Source, lake: Path) -> None:
    """Delta == PostgreSQL for every table; for the filtered one, == the rows its row filter publishes."""
    for table, key in (("orders", ("id",)), ("ident", ("code",)), ("events", ("id", "region"))):
        assert_delta_equals_postgres(source.pg.dsn, f"public.{table}", str(lake / "public" / table), key=key)
    _, rows = delta_rows(str(lake / "public" / "filtered"))
    with source.owner() as owner:
        published = owner.execute(f"SELECT id, name FROM public.filtered WHERE {FILTER}").fetchall()
    assert Counter((row["id"], row["name"]) for row in rows) == Counter(published)
    assert len(published) >= 5
