"""What the pgcdc assets, jobs and sensors share: names, table discovery, error policy."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from dagster import Backoff, Failure, RetryPolicy

from resources.config import PgcdcConfig
from resources.errors import ConnectionFailure, explain, PgcdcError
from resources.postgres.catalog import TableName
from resources.postgres.connections import connect
from resources.postgres.publication import resolve_tables

#: Retries a step whose PostgreSQL connection failed; every other error fails at once (see ``user_facing``).
TRANSIENT_RETRY_POLICY = RetryPolicy(max_retries=3, delay=5, backoff=Backoff.EXPONENTIAL)


def discover_tables(config: PgcdcConfig) -> list[TableName]:
    """The tables to define assets for: the configured list, or else what the publication publishes.

    Runs at definitions load time; an unreachable server or missing publication fails the
    load with pgcdc's one-line error, since a code location without its tables is useless.
    """
    if config.tables:
        return [TableName.parse(name) for name in config.tables]
    try:
        with connect(config.postgres.dsn, application_name="pgcdc-dagster") as conn:
            return resolve_tables(conn, config.publication, config.tables)
    except psycopg.Error as error:
        raise explain(error, config.postgres.dsn) from None


@contextmanager
def user_facing() -> Iterator[None]:
    """Let only connection failures reach the retry policy; any other pgcdc error fails the step at once.

    A missing slot or a bad configuration will not fix itself, and retrying would only
    delay the one-line message that says how to fix it.
    """
    try:
        yield
    except ConnectionFailure:
        raise
    except PgcdcError as error:
        raise Failure(description=str(error), allow_retries=False) from error
