"""Catalog reads against real servers: column lists, row filters, identities, partitions."""

import pytest

from resources.errors import ConfigurationError
from resources.postgres.catalog import read_table, TableName
from resources.postgres.publication import published_tables
from tests.support.postgres import PgDatabase


@pytest.fixture
def shop(pg: PgDatabase) -> PgDatabase:
    pg.execute(
        '''
        CREATE TABLE public.orders (id bigint PRIMARY KEY, customer text NOT NULL, total numeric(10,2), secret text);
        CREATE TABLE public.events (at timestamptz, payload jsonb);
        ALTER TABLE public.events REPLICA IDENTITY FULL;
        CREATE TABLE public.logs (line text);
        CREATE TABLE public.measures (id int, region text, v float8) PARTITION BY LIST (region);
        CREATE TABLE public.measures_eu PARTITION OF public.measures FOR VALUES IN ('eu');
        CREATE SCHEMA "Odd Schema";
        CREATE TABLE "Odd Schema"."Odd ""Table""" (k int PRIMARY KEY);
        CREATE PUBLICATION pub FOR TABLE public.orders (id, customer, total) WHERE (total > 0),
            public.events, public.logs, public.measures, "Odd Schema"."Odd ""Table"""
            WITH (publish_via_partition_root = true);
        '''
    )
    return pg


def test_published_tables_lists_roots_not_partitions(shop: PgDatabase) -> None:
    with shop.connect() as conn:
        tables = published_tables(conn, "pub")
    assert [str(t) for t in tables] == [
        'Odd Schema.Odd "Table"',
        "public.events",
        "public.logs",
        "public.measures",
        "public.orders",
    ]


def test_column_list_row_filter_and_primary_key(shop: PgDatabase) -> None:
    with shop.connect() as conn:
        info = read_table(conn, "pub", TableName("public", "orders"))
    assert [c.name for c in info.columns] == ["id", "customer", "total"]
    assert [c.type_name for c in info.columns] == ["bigint", "text", "numeric(10,2)"]
    assert info.key_columns == ("id",)
    assert info.replica_identity == "d"
    assert info.row_filter == "(total > (0)::numeric)"
    assert info.copy_query() == (
        'COPY (SELECT "id", "customer", "total" FROM ONLY "public"."orders" WHERE ((total > (0)::numeric)))'
        " TO STDOUT WITH (FORMAT text)"
    )  # the filter is parenthesized again so that a ctid range can be ANDed to it


def test_identities_full_nothing_and_partitioned(shop: PgDatabase) -> None:
    with shop.connect() as conn:
        events = read_table(conn, "pub", TableName("public", "events"))
        logs = read_table(conn, "pub", TableName("public", "logs"))
        measures = read_table(conn, "pub", TableName("public", "measures"))
        odd = read_table(conn, "pub", TableName("Odd Schema", 'Odd "Table"'))
    assert (events.replica_identity, events.key_columns) == ("f", ("at", "payload"))
    assert (logs.replica_identity, logs.key_columns) == ("d", ())
    assert measures.relkind == "p" and 'FROM "public"."measures"' in measures.copy_query()
    assert odd.key_columns == ("k",)
    assert odd.table.quoted == '"Odd Schema"."Odd ""Table"""'


def test_unpublished_and_missing(shop: PgDatabase) -> None:
    shop.execute("CREATE TABLE public.private (id int)")
    with shop.connect() as conn:
        with pytest.raises(ConfigurationError, match='public.private is not in publication "pub"'):
            read_table(conn, "pub", TableName("public", "private"))
        with pytest.raises(ConfigurationError, match="does not exist"):
            read_table(conn, "pub", TableName("public", "nope"))
        with pytest.raises(ConfigurationError, match='publication "nope" does not exist'):
            published_tables(conn, "nope")
