"""Checks at what the drain costs, and reconciliation at one fixed LSN (docs/contracts.md, "Checks and reconciliation"),
against real PostgreSQL, Sail and Dagster runs in process: on the newest server, as the checks are
Dagster's and the oracle's (reconciliation itself runs on 15 and 18 in tests/test_memory_runs.py).

One scenario walks it all, since every step needs a snapshot and a Dagster instance:
the schema check after a snapshot, not evaluated on a drain without schema changes (no catalog
round trip), evaluated after an ALTER TABLE seen in the drain; ``pgcdc_reconcile`` exact while a
writer commits throughout; then a Delta row corrupted through Spark, named by key range and key.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import yaml
from dagster import AssetCheckEvaluation, AssetKey, DagsterInstance, ExecuteInProcessResult, instance_for_test
from pyspark.sql import SparkSession

import pgcdc_assets.checks
import resources.cdc.apply_batches
import resources.runs.reconcile
from pgcdc_assets.builder import build_definitions
from resources.config import parse_config
from resources.config.columns import ColumnOverrides
from resources.delta.spark_destination import lake_destination
from resources.lsn import LSN
from resources.names import TableName
from resources.pgtypes import PgColumnType, to_arrow
from resources.runs.reconcile import HashBuckets, IntegerRanges, RangeSums, reconcile, TableReconciliation
from resources.runs.snapshot import snapshot_tables
from resources.testing.verify import compare_table
from tests.support.dagster_runs import create_shop, slot_position, write_config
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase

pytest_plugins = ["tests.support.spark_fixtures"]

ORDERS = AssetKey(["pgcdc", "public", "orders"])
NOTES = AssetKey(["pgcdc", "public", "notes"])
LABELS = AssetKey(["pgcdc", "public", "labels"])
SLOT = AssetKey(["pgcdc", "slot"])
SCHEMA, LAG = "schema_matches_postgres", "slot_lag_within_bound"
ROW_COUNT, ROWS_MATCH = "row_count_matches_postgres", "rows_match_postgres"


class Writer(threading.Thread):
    """Commits small transactions on all three tables until stopped: inserts, updates, deletes."""

    def __init__(self, dsn: str) -> None:
        super().__init__(name="test-writer", daemon=True)
        self._dsn = dsn
        self._halt = threading.Event()
        self.commits = 0
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self._dsn, autocommit=True) as conn:
                n = 0
                while not self._halt.is_set():
                    n += 1
                    with conn.transaction():
                        conn.execute("INSERT INTO orders VALUES (%s, 'w', 1.5, '{1}', now()::timestamp)", (10_000 + n,))
                        conn.execute("UPDATE orders SET amount = amount + 1 WHERE id = %s", (n % 400 + 1,))
                        conn.execute("DELETE FROM orders WHERE id = %s", (10_000 + n - 3,))
                        conn.execute("INSERT INTO notes VALUES (%s)", (f"w{n % 7}",))
                        conn.execute("UPDATE labels SET n = n + 1 WHERE code = %s", (f"k{n % 50}",))
                    self.commits += 1
                    time.sleep(0.005)
        except BaseException as exc:  # noqa: BLE001 - re-raised by stop() in the test's thread
            self.failure = exc

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)
        if self.failure is not None:
            raise self.failure


def oracle_beside_reconcile(monkeypatch: pytest.MonkeyPatch) -> dict[str, int | AssertionError]:
    """Make every table reconciliation also run the writer-independent oracle (``compare_table``:
    catalog-derived types, delta-rs, PostgreSQL's own output) on the reconciliation's connection,
    which holds the snapshot at the reconcile LSN while Delta holds exactly the changes up to it.
    Returns, per table, the oracle's row count or its failure, filled in as the job runs."""
    outcomes: dict[str, int | AssertionError] = {}
    reconcile_table = resources.runs.reconcile._compare_table

    def with_oracle(
        reader: psycopg.Connection,
        publication: str,
        spark: SparkSession,
        table: TableName,
        path: str,
        range_rows: int,
        overrides: ColumnOverrides,
    ) -> TableReconciliation:
        try:
            outcomes[str(table)] = compare_table(reader, str(table), path, columns=overrides.for_table(table))
        except AssertionError as failure:
            outcomes[str(table)] = failure
        return reconcile_table(reader, publication, spark, table, path, range_rows, overrides)  # type: ignore[arg-type]

    monkeypatch.setattr(resources.runs.reconcile, "_compare_table", with_oracle)
    return outcomes


def evaluations(result: ExecuteInProcessResult) -> dict[tuple[AssetKey, str], AssetCheckEvaluation]:
    return {(e.asset_key, e.check_name): e for e in result.get_asset_check_evaluations()}


def run(defs: object, instance: DagsterInstance, job: str, **kwargs: object) -> ExecuteInProcessResult:
    result = defs.resolve_job_def(job).execute_in_process(instance=instance, **kwargs)  # type: ignore[attr-defined]
    assert result.success
    return result


@NEWEST_POSTGRES_ONLY
def test_schema_check_follows_relation_changes_and_reconcile_is_exact_under_writes(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    create_shop(pg)
    pg.execute("CREATE TABLE labels (code text PRIMARY KEY, n int)")
    pg.execute("INSERT INTO labels SELECT 'k' || g, g FROM generate_series(0, 49) g")
    pg.execute("ALTER PUBLICATION pgcdc_pub ADD TABLE labels")
    catalog_reads: list[str] = []
    read_columns: Callable[..., list[tuple[str, str]]] = pgcdc_assets.checks.postgres_columns

    def counted_columns(postgres: object, table: object) -> list[tuple[str, str]]:
        catalog_reads.append(str(table))
        return read_columns(postgres, table)

    monkeypatch.setattr(pgcdc_assets.checks, "postgres_columns", counted_columns)
    defs = build_definitions(write_config(tmp_path, pg))
    with instance_for_test() as instance:
        run(defs, instance, "pgcdc_snapshot")

        # The first drain after the snapshot checks every table's schema.
        pg.execute("UPDATE orders SET customer = 'x' WHERE id = 5")
        first = evaluations(run(defs, instance, "pgcdc_incremental"))
        assert {key: e.passed for key, e in first.items()} == {
            (SLOT, LAG): True,
            **{(table, SCHEMA): True for table in (ORDERS, NOTES, LABELS)},
        }
        assert sorted(catalog_reads) == ["public.labels", "public.notes", "public.orders"]

        # Row changes only: the Relation messages match Delta, so no schema check, no catalog read.
        catalog_reads.clear()
        pg.execute("UPDATE orders SET customer = 'y' WHERE id = 6; INSERT INTO notes VALUES ('n')")
        quiet = evaluations(run(defs, instance, "pgcdc_incremental"))
        assert set(quiet) == {(SLOT, LAG)}
        assert catalog_reads == []

        # An ALTER TABLE seen in the drain: evaluated for that table alone, against the catalog.
        pg.execute(
            "ALTER TABLE orders ADD COLUMN channel text DEFAULT 'web'; UPDATE orders SET amount = 0 WHERE id = 7"
        )
        altered = evaluations(run(defs, instance, "pgcdc_incremental"))
        assert set(altered) == {(ORDERS, SCHEMA), (SLOT, LAG)}
        assert altered[(ORDERS, SCHEMA)].passed
        assert "channel string" in altered[(ORDERS, SCHEMA)].metadata["delta"].value
        assert catalog_reads == ["public.orders"]

        # Reconciliation while a writer commits before, during and after the job: exact, by its own
        # comparison and by the oracle at the same LSN.
        oracle = oracle_beside_reconcile(monkeypatch)
        writer = Writer(pg.dsn)
        writer.start()
        try:
            while writer.commits < 5:
                time.sleep(0.01)
            before = writer.commits
            reconciled = run(defs, instance, "pgcdc_reconcile")
            during = writer.commits - before
            confirmed = slot_position(pg)
        finally:
            writer.stop()
        assert during > 0
        # The job's drain is recorded like a drain: the slot at the fixed LSN, and the tables it changed.
        drained = {
            e.asset_key: e.event_specific_data.materialization for e in reconciled.get_asset_materialization_events()
        }
        assert set(drained) == {SLOT, ORDERS, NOTES, LABELS}
        assert drained[SLOT].metadata["pgcdc/confirmed_flush_lsn"].value == str(confirmed)
        checks = evaluations(reconciled)
        assert {key: e.passed for key, e in checks.items()} == {
            (table, check): True for table in (ORDERS, NOTES, LABELS) for check in (ROW_COUNT, ROWS_MATCH)
        }
        reconcile_lsn = LSN.parse(checks[(ORDERS, ROWS_MATCH)].metadata["pgcdc/reconcile_lsn"].value)
        assert confirmed == reconcile_lsn  # the slot was drained to exactly the fixed LSN, no further
        assert checks[(ORDERS, ROWS_MATCH)].metadata["pgcdc/changes_drained"].value > 0
        assert checks[(ORDERS, ROWS_MATCH)].metadata["ranges"].value.endswith('ranges of "id"')
        assert checks[(LABELS, ROWS_MATCH)].metadata["ranges"].value.endswith('hash buckets of ("code")')
        assert "no key" in checks[(NOTES, ROWS_MATCH)].metadata["ranges"].value
        count = checks[(ORDERS, ROW_COUNT)].metadata
        assert count["postgres_rows"].value == count["delta_rows"].value > 500
        assert oracle == {
            f"public.{table}": checks[(key, ROW_COUNT)].metadata["postgres_rows"].value
            for table, key in (("orders", ORDERS), ("notes", NOTES), ("labels", LABELS))
        }
        oracle.clear()

        # A Delta row changed behind pgcdc's back (one the writer never touched, so the drain does not
        # overwrite it): the range holding it and its key are named.
        path = tmp_path / "lake" / "public" / "orders"
        spark.sql(
            f"MERGE INTO delta.`{path}` t USING (SELECT CAST(450 AS BIGINT) AS id) s ON t.id = s.id"
            " WHEN MATCHED THEN UPDATE SET customer = 'corrupted'"
        ).collect()
        config = {"ops": {"reconcile_tables": {"config": {"range_rows": 50}}}}
        broken = evaluations(run(defs, instance, "pgcdc_reconcile", run_config=config))
        failed = {key for key, e in broken.items() if not e.passed}
        assert failed == {(ORDERS, ROWS_MATCH)}
        assert isinstance(oracle.pop("public.orders"), AssertionError)
        assert all(isinstance(rows, int) for rows in oracle.values()), oracle
        evaluation = broken[(ORDERS, ROWS_MATCH)]
        assert evaluation.metadata["mismatched_ranges"].value == 1
        assert evaluation.metadata["differing_keys"].value == "450"
        assert evaluation.metadata["differing_rows"].value == 2  # PostgreSQL's row and Delta's
        named = re.fullmatch(r'1 range\(s\) differ: (.+); differing keys: 450; re-snapshot the table to repair it',
                             evaluation.description or "")  # fmt: skip
        assert named, evaluation.description
        bounds = re.fullmatch(r'(?:"id" >= (\d+))?(?: AND )?(?:"id" < (\d+))?', named.group(1))
        assert bounds and any(bounds.groups()), named.group(1)  # a key range, not "all rows"
        low, high = (int(bound) if bound else None for bound in bounds.groups())
        assert (low is None or low <= 450) and (high is None or 450 < high)


@NEWEST_POSTGRES_ONLY
def test_a_conversion_broken_in_the_writer_only_fails_the_oracle_and_rows_match_postgres(
    pg: PgDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drain's text-to-Arrow conversion of one column goes wrong (timestamps an hour late, as a
    time zone bug would), while reconciliation reads PostgreSQL through its own, intact path: the
    check names the rows, and the oracle, which shares no conversion with the writer, fails too."""
    create_shop(pg)
    defs = build_definitions(write_config(tmp_path, pg))

    def placed_an_hour_late(values: pa.Array, column: PgColumnType) -> pa.Array:
        converted = to_arrow(values, column)
        if column.column != "placed":
            return converted
        return pc.add(converted, pa.scalar(3_600_000_000, pa.duration("us")))

    with instance_for_test() as instance:
        run(defs, instance, "pgcdc_snapshot")
        monkeypatch.setattr(resources.cdc.apply_batches, "to_arrow", placed_an_hour_late)
        pg.execute(
            "UPDATE orders SET placed = placed + interval '1 day' WHERE id IN (7, 300); INSERT INTO notes VALUES ('n')"
        )
        oracle = oracle_beside_reconcile(monkeypatch)
        checks = evaluations(run(defs, instance, "pgcdc_reconcile"))
    assert {key for key, e in checks.items() if not e.passed} == {(ORDERS, ROWS_MATCH)}
    assert set(checks[(ORDERS, ROWS_MATCH)].metadata["differing_keys"].value.split(", ")) == {"7", "300"}
    assert isinstance(oracle["public.orders"], AssertionError)
    assert str(oracle["public.orders"]).count("only in Delta") == 2  # rows 7 and 300, an hour late
    assert oracle["public.notes"] == 4


@pytest.mark.parametrize(
    ("low", "high", "count"),
    [(1, 500, 7), (-1_000, 1_000, 64), (-(2**63), 2**63 - 1, 4096), (5, 5, 10), (0, 9, 100)],
)
def test_integer_ranges_put_every_key_in_the_range_that_names_it(low: int, high: int, count: int) -> None:
    ranges = IntegerRanges("id", low, high, count)
    span = [low, high, low + 1, high - 1, (low + high) // 2, -(2**63), 2**63 - 1, 0, -1]  # and keys outside [low, high]
    keys = pa.table({"id": pa.array(sorted(set(span)), pa.int64())})
    for key, index in zip(keys.column("id").to_pylist(), ranges.of(keys, []).tolist()):
        assert 0 <= index < ranges.count <= count
        described = ranges.describe(index)
        lower = re.search(r'"id" >= (-?\d+)', described)
        upper = re.search(r'"id" < (-?\d+)', described)
        assert (lower is None) == (index == 0) and (upper is None) == (index == ranges.count - 1)
        assert (lower is None or int(lower.group(1)) <= key) and (upper is None or key < int(upper.group(1)))


def test_range_fingerprints_ignore_order_and_catch_one_changed_value() -> None:
    rows = [(i, f"v{i % 3}", None if i % 5 else 1.5) for i in range(200)] + [(7, "v1", None)]  # one repeated row
    ranges = HashBuckets([0, 1, 2], 8, "whole rows")
    data = pa.table({"n": [0] * len(rows)})  # hash buckets read only the row tuples
    forward, backward, changed = RangeSums.empty(8), RangeSums.empty(8), RangeSums.empty(8)
    forward.add(ranges.of(data, rows), rows)
    backward.add(ranges.of(data, rows[::-1]), rows[::-1])
    altered = [*rows[:-1], (7, "v1", 0.0)]
    changed.add(ranges.of(data, altered), altered)
    assert (forward.counts == backward.counts).all() and (forward.sums == backward.sums).all()
    assert forward.counts.sum() == len(rows)
    assert (forward.sums != changed.sums).sum() >= 1


@NEWEST_POSTGRES_ONLY  # the order of pgcdc's own reads; no stream of the server's version is involved
def test_a_table_re_snapshotted_while_it_is_compared_is_reported_not_compared(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/operating.md: a table re-snapshotted while the reconcile job runs is reported as not compared
    (its Delta table no longer holds the changes up to the reconcile LSN); the other tables are compared.
    The re-snapshot is a real one, run right as the comparison of ``notes`` begins."""
    create_shop(pg)
    config = parse_config(yaml.safe_load(write_config(tmp_path, pg).read_text(encoding="utf-8")))
    destination = lake_destination(spark, config)
    snapshot_tables(config, destination)
    pg.execute("UPDATE orders SET customer = 'x' WHERE id = 9; INSERT INTO notes VALUES ('n')")
    compare = resources.runs.reconcile._compare_table
    re_snapshots: list[LSN | None] = []

    def re_snapshot_first(reader: psycopg.Connection, publication: str, lake: Any, table: TableName, *rest: Any) -> Any:
        if table == TableName("public", "notes"):
            snapshot_tables(config, destination, [table])
            re_snapshots.append(destination.read_table_log(config.table_path("public", "notes"), None).snapshot_lsn)
        return compare(reader, publication, lake, table, *rest)

    monkeypatch.setattr(resources.runs.reconcile, "_compare_table", re_snapshot_first)
    result = reconcile(config, destination)
    (snapshot_lsn,) = re_snapshots
    assert snapshot_lsn is not None and snapshot_lsn > result.lsn
    assert result.skipped == {"public.notes": "re-snapshotted while it was compared: run it again"}
    assert set(result.tables) == {"public.orders"} and result.tables["public.orders"].passed
    monkeypatch.setattr(resources.runs.reconcile, "_compare_table", compare)
    again = reconcile(config, destination)  # run again, as the reason says: both compared, exact
    assert again.skipped == {} and all(outcome.passed for outcome in again.tables.values())


@NEWEST_POSTGRES_ONLY  # names are pgcdc's reading, not the server's
def test_tables_whose_names_hold_dots_are_found_and_compared(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    """Without a list of tables, reconcile compares every replicated table, found by the table itself and not
    by parsing its ``schema.table`` key: ``"a.b".c`` and ``a."b.c"`` split the same key two ways."""
    create_shop(pg)
    pg.execute(
        'CREATE SCHEMA "a.b"; CREATE TABLE "a.b".c (id int PRIMARY KEY, v text); '
        'CREATE SCHEMA a; CREATE TABLE a."b.d" (id int PRIMARY KEY, v text); '
        "INSERT INTO \"a.b\".c VALUES (1, 'one'); INSERT INTO a.\"b.d\" VALUES (2, 'two'); "
        'ALTER PUBLICATION pgcdc_pub ADD TABLE "a.b".c, a."b.d"'
    )
    config = parse_config(yaml.safe_load(write_config(tmp_path, pg).read_text(encoding="utf-8")))
    destination = lake_destination(spark, config)
    snapshot_tables(config, destination)
    pg.execute('UPDATE "a.b".c SET v = \'uno\'; DELETE FROM a."b.d"')
    result = reconcile(config, destination)
    assert result.skipped == {}
    assert set(result.tables) == {"public.orders", "public.notes", "a.b.c", "a.b.d"}
    assert all(outcome.passed for outcome in result.tables.values())
    assert result.tables["a.b.c"].delta_rows == 1 and result.tables["a.b.d"].delta_rows == 0
