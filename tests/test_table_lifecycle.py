"""Published tables dropped, renamed, dropped and created again, or removed from the publication while
their changes are still in the slot, with PostgreSQL's own subscriber as the oracle
(``tests/support/subscriber_oracle.py``; the behaviour: ``resources/runs/drain_tables.py``,
``resources/cdc/applier.py: _adopt``, docs/guarantees.md).

The subscriber applies every change pgoutput sends, by table name, and keeps a table its publisher
dropped or stopped publishing: its tables are what Delta must hold for those. For a table dropped and
created again it maps the new relation to its old table by name and mixes the two, which pgcdc refuses:
its table is frozen on the subscriber right after the drop (``again_before``), and Delta must hold that.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from dagster import AssetKey, AssetMaterialization, AssetObservation
from pyspark.sql import SparkSession

from pgcdc_assets.incremental_assets import drain_events
from resources.config import parse_config
from resources.delta.spark_destination import lake_destination
from resources.delta.state_table import read_state, state_path
from resources.lsn import LSN
from resources.names import PipelineNames, TableName
from resources.runs.incremental import IncrementalResult, run_incremental, TableResult
from resources.runs.snapshot import snapshot_tables
from resources.testing.verify import assert_delta_equals_postgres, compare_table
from tests.support.incremental_runs import settings
from tests.support.postgres import PgDatabase
from tests.support.subscriber_oracle import Subscriber

pytest_plugins = ["tests.support.spark_fixtures", "tests.support.subscriber_oracle"]
pytestmark = pytest.mark.slow  # a PostgreSQL subscriber beside the drains; tiers: docs/testing.md

TABLES = ("gone", "moved", "again", "hidden", "other")


def _current_lsn(pg: PgDatabase) -> LSN:
    ((lsn,),) = pg.execute("SELECT pg_current_wal_lsn()::text")
    return LSN.parse(lsn)


def test_tables_that_leave_the_publication_keep_their_drained_changes_and_a_recreated_one_is_not_mixed(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, subscribe: Callable[[str], Subscriber]
) -> None:
    for name in TABLES:
        pg.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, v text); INSERT INTO {name} VALUES (1, 'a'), (2, 'b')")
    pg.execute(f"CREATE PUBLICATION pub FOR TABLE {', '.join(TABLES)}")
    subscriber = subscribe("pub")
    config = parse_config(settings(pg, tmp_path / "lake"))
    destination = lake_destination(spark, config)
    snapshot_tables(config, destination)

    # Changes of every table, then the DDL, all before one drain.
    for name in TABLES:
        pg.execute(f"INSERT INTO {name} VALUES (3, 'new'); UPDATE {name} SET v = 'upd' WHERE id = 1")
        pg.execute(f"DELETE FROM {name} WHERE id = 2")
    pg.execute(
        "DROP TABLE gone; ALTER TABLE moved RENAME TO moved_to; DROP TABLE again;"
        " ALTER PUBLICATION pub DROP TABLE hidden"
    )
    subscriber.wait_for(_current_lsn(pg))
    with subscriber.connect() as conn:
        # Frozen before the recreated table's rows reach (and mix into) the subscriber's table; and a table
        # under the new name, which the subscriber needs to go on (it is in no subscription: skipped).
        conn.execute("CREATE TABLE again_before AS TABLE again; CREATE TABLE moved_to (id int PRIMARY KEY, v text)")
    pg.execute(
        "CREATE TABLE again (id int PRIMARY KEY, v text); ALTER PUBLICATION pub ADD TABLE again;"
        " INSERT INTO again VALUES (10, 'recreated'), (11, 'recreated');"
        " UPDATE moved_to SET v = 'after the rename'; INSERT INTO hidden VALUES (9, 'after unpublishing');"
        " UPDATE other SET v = 'later' WHERE id = 3"
    )

    result = run_incremental(config, destination)
    assert result.newly_quarantined == ["public.again"]
    assert "dropped and created again" in result.quarantined["public.again"].cause
    assert sorted(result.departed) == ["public.gone", "public.hidden", "public.moved"]
    assert "(dropped)" in result.departed["public.gone"]
    assert "(renamed to public.moved_to)" in result.departed["public.moved"]
    assert "(removed from the publication)" in result.departed["public.hidden"]
    assert result.tables_without_snapshot == ["public.moved_to"]

    subscriber.wait_for(result.end_lsn)
    path = {name: config.table_path("public", name) for name in TABLES}
    with subscriber.connect() as conn:
        # The subscriber holds the dropped, renamed and unpublished tables as of their last published change.
        assert {name: compare_table(conn, f"public.{name}", path[name], key=["id"]) for name in TABLES if name != "again"} == {
            "gone": 2, "moved": 2, "hidden": 2, "other": 2,
        }  # fmt: skip
        assert compare_table(conn, "public.again_before", path["again"], key=["id"]) == 2
        # ... while the subscriber mixed the recreated table's rows into the old one's: pgcdc did not.
        assert conn.execute("SELECT count(*) FROM again").fetchall() == [(4,)]
    assert pg.execute("SELECT count(*) FROM hidden") == [(3,)]  # its later change did not reach Delta

    # Later drains keep reporting the departed tables; a re-snapshot takes the recreated table as new.
    again = run_incremental(config, destination)
    assert sorted(again.departed) == sorted(result.departed) and again.newly_quarantined == []
    snapshot_tables(config, destination, [TableName("public", "again")])
    pg.execute("INSERT INTO again VALUES (12, 'after the re-snapshot')")
    lifted = run_incremental(config, destination)
    assert lifted.lifted == ["public.again"] and not lifted.quarantined
    assert_delta_equals_postgres(pg.dsn, "public.again", path["again"], key=["id"])

    # A departed table's Delta table removed: pgcdc forgets it.
    shutil.rmtree(path["gone"])
    forgotten = run_incremental(config, destination)
    assert sorted(forgotten.departed) == ["public.hidden", "public.moved"]
    assert "public.gone" not in read_state(state_path(config.delta.root, config.slot))


def test_the_asset_of_a_departed_table_says_why_it_left_and_the_slot_asset_lists_it() -> None:
    """``drain_events``: the drain that applied a departed table's last changes materializes it with the
    line; a later drain records the line as an observation; the slot asset lists it."""

    line = 'public.gone is no longer published by "pub" (dropped): ...'
    table, key, slot = TableName("public", "gone"), AssetKey(["pgcdc", "public", "gone"]), AssetKey(["pgcdc", "slot"])

    def result(applied: LSN | None) -> IncrementalResult:
        stats = TableResult(1, 0, 0, 0, applied, 3, applied)
        return IncrementalResult(
            LSN(1), LSN(9), LSN(9), {"public.gone": stats}, 1, 1, 0, 8, 0, 0.1, 1.0, departed={"public.gone": line}
        )

    def events(applied: LSN | None) -> list[object]:
        return list(drain_events(result(applied), [table], {table: key}, slot, set(), PipelineNames(), print, LSN(5)))

    last, slot_event = events(LSN(8))
    assert isinstance(last, AssetMaterialization) and last.metadata["pgcdc/departed"].value == line
    assert isinstance(slot_event, AssetMaterialization) and line in str(
        slot_event.metadata["pgcdc/departed_tables"].value
    )
    later, _ = events(None)
    assert isinstance(later, AssetObservation) and later.metadata["pgcdc/departed"].value == line
