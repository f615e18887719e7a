"""Publications: which tables a publication carries, creating pgcdc's own, and the preflight check that they exist."""

from __future__ import annotations

from collections.abc import Sequence

import psycopg

from resources.config import PgcdcConfig
from resources.errors import ConfigurationError, explain
from resources.postgres.catalog import client_cursor, TableName
from resources.postgres.connections import connect
from resources.postgres.replication import ReplicationConnection
from resources.sql import quote_ident, quote_literal


def publication_exists(conn: psycopg.Connection, publication: str) -> bool:
    row = (
        client_cursor(conn)
        .execute(
            "SELECT 1 FROM pg_catalog.pg_publication WHERE pubname OPERATOR(pg_catalog.=) %s::pg_catalog.name",
            (publication,),
        )
        .fetchone()
    )
    return row is not None


def published_tables(conn: psycopg.Connection, publication: str, *, allow_empty: bool = False) -> list[TableName]:
    """The tables a publication publishes, as pg_publication_tables lists them; none is refused
    unless ``allow_empty`` (a drain whose tables all left the publication still drains their changes)."""
    if not publication_exists(conn, publication):
        raise ConfigurationError(
            f'publication "{publication}" does not exist',
            f"CREATE PUBLICATION {quote_ident(publication)} FOR TABLE ... (or set create_publication: true)",
        )
    rows = (
        client_cursor(conn)
        .execute(
            "SELECT DISTINCT schemaname, tablename FROM pg_catalog.pg_publication_tables"
            " WHERE pubname OPERATOR(pg_catalog.=) %s::pg_catalog.name ORDER BY 1, 2",
            (publication,),
        )
        .fetchall()
    )
    if not rows and not allow_empty:
        # Draining an empty publication would confirm the slot past every change for nothing.
        raise ConfigurationError(
            f'publication "{publication}" publishes no tables',
            f"ALTER PUBLICATION {quote_ident(publication)} ADD TABLE ...",
        )
    return [TableName(schema, name) for schema, name in rows]


def resolve_tables(conn: psycopg.Connection, publication: str, configured: Sequence[str]) -> list[TableName]:
    """The tables to replicate: ``configured`` (schema.table names), each checked to be published,
    or the whole publication when none are configured."""
    published = published_tables(conn, publication)
    if not configured:
        return published
    wanted = [TableName.parse(name) for name in configured]
    missing = [table for table in wanted if table not in published]
    if missing:
        raise unpublished_error(publication, missing)
    return wanted


def unpublished_error(publication: str, missing: Sequence[TableName]) -> ConfigurationError:
    """Configured tables the publication does not publish."""
    return ConfigurationError(
        f'{", ".join(str(table) for table in missing)} not published by "{publication}"',
        f"ALTER PUBLICATION {quote_ident(publication)} ADD TABLE {', '.join(t.quoted for t in missing)}, "
        "or remove them from 'tables' (a partitioned table needs publish_via_partition_root = true)",
    )


def ensure_publication(config: PgcdcConfig) -> list[TableName]:
    """Make sure the publication exists and covers the configured tables; return the tables to replicate.

    A publication pgcdc creates publishes partitioned tables via their root, so one Delta
    table per configured (root) table receives the changes of all its partitions.
    """
    publication = config.publication
    configured = [TableName.parse(name) for name in config.tables]
    try:
        with connect(config.postgres.dsn, application_name="pgcdc") as conn:
            if not publication_exists(conn, publication):
                if not config.create_publication:
                    raise ConfigurationError(
                        f'publication "{publication}" does not exist',
                        f"run CREATE PUBLICATION {quote_ident(publication)} FOR TABLE ... "
                        "or set create_publication: true",
                    )
                if not configured:
                    raise ConfigurationError(
                        f'create_publication is true but no tables are configured for "{publication}"',
                        "list the tables to publish under 'tables'",
                    )
                _create_publication(conn, publication, configured)
            return resolve_tables(conn, publication, config.tables)
    except psycopg.Error as exc:
        raise explain(exc, config.postgres.dsn) from None


def _create_publication(conn: psycopg.Connection, publication: str, tables: Sequence[TableName]) -> None:
    try:
        conn.execute(
            f"CREATE PUBLICATION {quote_ident(publication)} FOR TABLE {', '.join(t.quoted for t in tables)}"
            " WITH (publish_via_partition_root = true)"
        )
    except psycopg.errors.UndefinedTable as exc:
        raise ConfigurationError(
            f'cannot create publication "{publication}": {exc.diag.message_primary}',
            "create the table or fix its name in 'tables'",
        ) from None
    except psycopg.errors.DuplicateObject:
        pass  # created concurrently by another run: use it as it is
    except psycopg.errors.InsufficientPrivilege as exc:
        raise _not_allowed_to_create(conn, publication, tables, exc.diag.message_primary or str(exc)) from None


def _not_allowed_to_create(
    conn: psycopg.Connection, publication: str, tables: Sequence[TableName], message: str
) -> ConfigurationError:
    """``create_publication: true`` for a role PostgreSQL does not let create it: no CREATE on the
    database, or not the owner of every table (only a table's owner may add it to a publication)."""
    role = conn.info.user
    statement = f"CREATE PUBLICATION {quote_ident(publication)} FOR TABLE {', '.join(t.quoted for t in tables)}"
    if "must be owner" in message:
        return ConfigurationError(
            f'cannot create publication "{publication}" as {role} ({message}): only a table\'s owner may publish it',
            f"run {statement} as the tables' owner and set create_publication: false, or make {role} own the tables",
        )
    return ConfigurationError(
        f'cannot create publication "{publication}" as {role} ({message})',
        f"GRANT CREATE ON DATABASE {quote_ident(conn.info.dbname)} TO {quote_ident(role)}, or run {statement}"
        " as the tables' owner and set create_publication: false",
    )


def check_publications(conn: ReplicationConnection, publications: Sequence[str]) -> None:
    """Every publication must exist in the connected database."""
    wanted = ", ".join(quote_literal(name) for name in publications)
    found = {
        name
        for (name,) in conn.execute(
            "SELECT pubname::pg_catalog.text FROM pg_catalog.pg_publication"
            f" WHERE pubname OPERATOR(pg_catalog.=) ANY (ARRAY[{wanted}]::pg_catalog.name[])"
        )
    }
    for name in publications:
        if name not in found:
            raise ConfigurationError(
                f'publication "{name}" does not exist in this database',
                f"CREATE PUBLICATION {quote_ident(name)} FOR TABLE ..., or fix the publication name",
            )
