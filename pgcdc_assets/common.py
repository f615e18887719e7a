"""What the pgcdc assets, jobs and sensors share: names, table discovery, error policy."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from dagster import Backoff, DagsterRunStatus, Failure, RetryPolicy

from resources.postgres.catalog import TableName, resolve_tables
from resources.config import PgcdcConfig
from resources.postgres.connections import connect
from resources.errors import ConnectionFailure, PgcdcError, explain

SNAPSHOT_JOB = "pgcdc_snapshot"
RESNAPSHOT_JOB = "pgcdc_resnapshot"
INCREMENTAL_JOB = "pgcdc_incremental"
INCREMENTAL_SCHEDULE = "pgcdc_incremental_schedule"

#: Runs that will drain (or are draining) the slot: queued ones count, since they are about to.
PENDING_RUN_STATUSES = [
    DagsterRunStatus.QUEUED,
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
    DagsterRunStatus.CANCELING,
]

#: Retries a step whose PostgreSQL connection failed; every other error fails at once (see ``user_facing``).
TRANSIENT_RETRY_POLICY = RetryPolicy(max_retries=3, delay=5, backoff=Backoff.EXPONENTIAL)


def slot_pool(slot: str) -> str:
    """The Dagster concurrency pool of every step that drains ``slot``.

    With a limit of 1 on it (``dagster instance concurrency set pgcdc_slot_<slot> 1``, or
    ``concurrency: pools: default_limit: 1`` in dagster.yaml) a second drain waits for the
    first instead of failing on the busy slot.
    """
    return f"pgcdc_slot_{slot}"


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
