"""Roles PostgreSQL does not let do what pgcdc asks, with real roles and real grants on PostgreSQL 15 and
18 and the embedded Sail engine: one line naming the grant (or the statement to run as the owner), the
fault kept where it belongs, nothing confirmed past Delta, exact after the fix.

A missing SELECT on one table is that table's own fault: the other tables are copied, the drains go on
(pgoutput needs no SELECT), and the table is copied once granted. A role that may not create the
publication (``create_publication: true`` without owning the tables, or without CREATE on the
database) is no table's fault: nothing is created, no slot, no lake.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from pyspark.sql import SparkSession

from resources.config import parse_config
from resources.delta.spark_destination import lake_destination
from resources.delta.table_log import read_table_log
from resources.errors import ConfigurationError
from resources.names import TableName
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from tests.support.bad_storage import assert_exact, DDL, one_line, PENDING, settings
from tests.support.postgres import PgDatabase

pytest_plugins = ["tests.support.spark_fixtures"]


@pytest.fixture
def role(pg: PgDatabase) -> Iterator[str]:
    """A login role with REPLICATION and nothing else, dropped after the test (roles are the server's)."""
    name = f"pgcdc_role_{uuid.uuid4().hex[:8]}"
    pg.execute(f"CREATE ROLE {name} LOGIN REPLICATION")
    try:
        yield name
    finally:
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s AND pid <> pg_backend_pid()",
                (name,),
            )
            conn.execute(f"DROP OWNED BY {name}")
            conn.execute(f"DROP ROLE {name}")


def test_role_without_select_on_one_table_copies_the_others_and_names_the_grant(
    pg: PgDatabase, role: str, tmp_path: Path, spark: SparkSession
) -> None:
    pg.execute(DDL + f"CREATE PUBLICATION pub FOR TABLE orders, notes, tally; GRANT SELECT ON orders, tally TO {role}")
    config = parse_config(settings(pg.server.dsn(pg.name, user=role), tmp_path / "lake"))
    with pytest.raises(ConfigurationError) as failure:
        snapshot_tables(config, lake_destination(spark, config))
    one_line(failure.value, "public.notes: missing privilege", f"GRANT SELECT ON notes TO {role}")
    assert read_table_log(config.table_path("public", "notes")).snapshot_lsn is None
    pg.execute(PENDING)
    drained = run_incremental(config, lake_destination(spark, config))  # the others drain; notes waits for its copy
    assert drained.tables_without_snapshot == ["public.notes"]
    assert_exact(pg, config, ["orders", "tally"])
    pg.execute(f"GRANT SELECT ON notes TO {role}")
    snapshot_tables(config, lake_destination(spark, config), [TableName("public", "notes")])
    pg.execute(PENDING.replace("51", "52") + f"; REVOKE SELECT ON orders FROM {role}")
    run_incremental(config, lake_destination(spark, config))  # a drain reads no table: SELECT is not needed
    assert_exact(pg, config)


def test_create_publication_by_a_role_that_may_not_creates_nothing_and_names_the_statement(
    pg: PgDatabase, role: str, tmp_path: Path, spark: SparkSession
) -> None:
    """Not the tables' owner, then not even CREATE on the database: each a line naming what to run; the
    owner runs the statement the line names, and the same configuration then copies and drains exactly."""
    pg.execute(DDL + f"GRANT SELECT ON orders, notes, tally TO {role}; GRANT CREATE ON DATABASE {pg.name} TO {role}")
    tables = ["public.orders", "public.notes", "public.tally"]
    config = parse_config(
        settings(pg.server.dsn(pg.name, user=role), tmp_path / "lake", create_publication=True, tables=tables)
    )
    with pytest.raises(ConfigurationError) as not_owner:
        snapshot_tables(config, lake_destination(spark, config))
    line = one_line(
        not_owner.value,
        f'cannot create publication "pub" as {role}',
        "only a table's owner",
        "create_publication: false",
    )
    pg.execute(f"REVOKE CREATE ON DATABASE {pg.name} FROM {role}")
    with pytest.raises(ConfigurationError) as no_create:
        snapshot_tables(config, lake_destination(spark, config))
    one_line(no_create.value, "permission denied for database", f'GRANT CREATE ON DATABASE "{pg.name}" TO "{role}"')
    assert pg.execute("SELECT count(*) FROM pg_publication") == [(0,)]
    assert pg.execute("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()") == [(0,)]
    assert not (tmp_path / "lake").exists()
    (statement,) = re.findall(r"run (CREATE PUBLICATION .*?) as the tables' owner", line)
    pg.execute(statement)  # the fix, as the owner (the test's superuser)
    snapshot_tables(config, lake_destination(spark, config))
    pg.execute(PENDING)
    run_incremental(config, lake_destination(spark, config))
    assert_exact(pg, config)
