"""The configuration's ``columns`` against real PostgreSQL 15 and 18 and the embedded Sail engine.

Values Delta's typed columns cannot hold are kept as PostgreSQL's text, at the snapshot and in a
drain; every refusal names the exact key to set (and the key it prints is one the configuration
takes); two columns whose names differ only in case are refused before anything is written, and
renaming or leaving out one of them replicates the table.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from resources.cdc.schema import ChangeValueError, SchemaChangeError
from resources.config import parse_config, PgcdcConfig
from resources.config.columns import ColumnChoice, ColumnClashError
from resources.delta.reads import delta_rs_rows
from resources.delta.spark_destination import lake_destination
from resources.errors import ConfigurationError, SnapshotError
from resources.runs.snapshot import snapshot_tables
from tests.support.incremental_runs import drain, path_of, same, settings, slot_confirmed
from tests.support.postgres import PgDatabase

pytest_plugins = ["tests.support.spark_fixtures"]


def configured(
    pg: PgDatabase, tmp_path: Path, columns: dict[str, object], snapshot: dict[str, object] | None = None
) -> PgcdcConfig:
    return parse_config({**settings(pg, tmp_path / "lake"), "columns": columns, "snapshot": snapshot or {}})


def snapshot(config: PgcdcConfig, spark: SparkSession) -> None:
    snapshot_tables(config, lake_destination(spark, config))


def delta_values(config: PgcdcConfig, table: str, columns: list[str]) -> list[tuple]:
    rows = delta_rs_rows(path_of(config, table)).select(columns).to_pylist()
    return sorted(tuple(row[name] for name in columns) for row in rows)


def lake_files(root: Path) -> list[Path]:
    """Everything below the lake's root but the slot's record (``_pgcdc/slots``): the snapshot run creates
    the slot before it copies a table, and records its position with it (resources/runs/slot_guard.py)."""
    slot_records = root / "_pgcdc" / "slots"
    return sorted(
        path for path in (root.rglob("*") if root.exists() else [])
        if path not in (root / "_pgcdc", slot_records) and slot_records not in path.parents
    )  # fmt: skip


def one_line(error: pytest.ExceptionInfo[Exception], *fragments: str) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


AS_TEXT = {name: ColumnChoice(as_text=True) for name in ("d", "ts", "tstz", "n", "arr")}


@pytest.mark.parametrize(
    "snapshot_settings", [{}, {"chunked_above_mb": 0, "key_chunk_mb": 0.001}], ids=["one-copy", "key-ranges"]
)
def test_values_delta_cannot_type_are_kept_as_text(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, snapshot_settings: dict[str, object]
) -> None:
    pg.execute("""
        CREATE TABLE odd (id int PRIMARY KEY, d date, ts timestamp, tstz timestamptz, n numeric(10,2), arr int[]);
        INSERT INTO odd VALUES (1, 'infinity', 'infinity', '-infinity', 'NaN', '{{1,2},{3,4}}'),
                               (2, '-infinity', '-infinity', 'infinity', 1.5, '[0:1]={7,8}'),
                               (3, '2024-02-29', '2024-02-29 10:00:00.5', '2024-02-29 10:00:00+02', NULL, '{1,NULL}');
        CREATE PUBLICATION pub FOR TABLE odd;
    """)
    config = configured(pg, tmp_path, {f"public.odd.{name}": "text" for name in AS_TEXT}, snapshot_settings)
    snapshot(config, spark)
    assert same(pg, config, "public.odd", columns=AS_TEXT) == 3
    names = ["id", "d", "ts", "tstz", "n", "arr"]
    assert delta_values(config, "public.odd", names) == [
        (1, "infinity", "infinity", "-infinity", "NaN", "{{1,2},{3,4}}"),
        (2, "-infinity", "-infinity", "infinity", "1.50", "[0:1]={7,8}"),
        (3, "2024-02-29", "2024-02-29 10:00:00.5", "2024-02-29 08:00:00+00", None, "{1,NULL}"),
    ]
    pg.execute("""
        INSERT INTO odd VALUES (4, '-infinity', 'infinity', 'infinity', 'NaN', '{{5},{6}}');
        UPDATE odd SET d = 'infinity', n = 'NaN', arr = '{{9,9}}', tstz = '-infinity' WHERE id = 3;
        UPDATE odd SET d = '2000-01-01', n = 2.25, arr = '{3}' WHERE id = 1;
    """)
    drain(config, spark)
    assert same(pg, config, "public.odd", columns=AS_TEXT) == 4
    assert delta_values(config, "public.odd", names) == [
        (1, "2000-01-01", "infinity", "-infinity", "2.25", "{3}"),
        (2, "-infinity", "-infinity", "infinity", "1.50", "[0:1]={7,8}"),
        (3, "infinity", "2024-02-29 10:00:00.5", "-infinity", "NaN", "{{9,9}}"),
        (4, "-infinity", "infinity", "infinity", "NaN", "{{5},{6}}"),
    ]


@pytest.mark.parametrize(
    ("column", "value", "key"),
    [
        ('"Due.Date"', "'infinity'", """'public.odd."Due.Date"'"""),
        ("n", "'NaN'", '"public.odd.n"'),
        ("arr", "'{{1,2},{3,4}}'", '"public.odd.arr"'),
    ],
    ids=["date", "numeric", "array"],
)
def test_refusals_name_the_key_the_configuration_takes(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, column: str, value: str, key: str
) -> None:
    pg.execute(f"""
        CREATE TABLE odd (id int PRIMARY KEY, "Due.Date" date, n numeric(10,2), arr int[]);
        INSERT INTO odd (id, {column}) VALUES (1, {value});
        CREATE TABLE plain (id int PRIMARY KEY, "Due.Date" date, n numeric(10,2), arr int[]);
        CREATE PUBLICATION pub FOR TABLE odd, plain;
    """)
    config = configured(pg, tmp_path, {})
    with pytest.raises(SnapshotError) as refused:
        snapshot(config, spark)
    one_line(refused, f"set columns: {{{key}: text}} in the pipeline's configuration, then re-snapshot the table")
    config = configured(pg, tmp_path, {key[1:-1]: "text"})  # the key as printed, without its YAML quotes
    snapshot(config, spark)
    choices = {column.strip('"'): ColumnChoice(as_text=True)}
    assert same(pg, config, "public.odd", columns=choices) == 1

    start = slot_confirmed(pg)
    pg.execute(f"INSERT INTO plain (id, {column}) VALUES (1, {value})")
    with pytest.raises(ChangeValueError) as refused_drain:
        drain(config.model_copy(update={"on_table_error": "stop"}), spark)  # by default: quarantined, same line
    plain_key = key.replace("public.odd.", "public.plain.")
    one_line(refused_drain, f"set columns: {{{plain_key}: text}} in the pipeline's configuration")
    assert slot_confirmed(pg) == start


def test_an_override_after_the_snapshot_asks_for_a_resnapshot(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    pg.execute("""
        CREATE TABLE t (id int PRIMARY KEY, d date);
        INSERT INTO t VALUES (1, '2024-01-01');
        CREATE PUBLICATION pub FOR TABLE t;
    """)
    snapshot(configured(pg, tmp_path, {}), spark)
    config = configured(pg, tmp_path, {"public.t.d": "text"})
    pg.execute("INSERT INTO t VALUES (2, 'infinity')")
    start = slot_confirmed(pg)
    with pytest.raises(SchemaChangeError) as refused:
        drain(config.model_copy(update={"on_table_error": "stop"}), spark)  # by default: quarantined, same line
    one_line(refused, "'d' of public.t is replicated as text", "its Delta column is date", "pgcdc_resnapshot")
    assert slot_confirmed(pg) == start
    snapshot(config, spark)
    drain(config, spark)
    assert same(pg, config, "public.t", columns={"d": ColumnChoice(as_text=True)}) == 2


CLASH = """
    CREATE TABLE t (id int PRIMARY KEY, duration int, "Duration" text);
    INSERT INTO t VALUES (1, 10, 'ten'), (2, NULL, 'two');
    CREATE PUBLICATION pub FOR TABLE t;
"""


def test_a_case_clash_is_refused_with_nothing_written(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    pg.execute(CLASH)
    config = configured(pg, tmp_path, {})
    with pytest.raises(ColumnClashError) as refused:
        snapshot(config, spark)
    one_line(
        refused,
        'public.t has columns "duration" and "Duration", whose names differ only in case',
        "columns: {'public.t.\"Duration\"': {rename: duration_2}}",
        "columns: {'public.t.\"Duration\"': exclude}, or the publication's column list",
    )
    assert lake_files(tmp_path / "lake") == []
    assert pg.execute("SELECT count(*) FROM pg_replication_slots WHERE temporary") == [(0,)]


@pytest.mark.parametrize(
    ("choice", "columns"),
    [
        ({"rename": "duration_2"}, {"Duration": ColumnChoice(rename="duration_2")}),
        ("exclude", {"Duration": ColumnChoice(exclude=True)}),
    ],
    ids=["rename", "exclude"],
)
def test_a_case_clash_replicates_once_one_column_is_renamed_or_left_out(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, choice: object, columns: dict[str, ColumnChoice]
) -> None:
    pg.execute(CLASH)
    config = configured(pg, tmp_path, {'public.t."Duration"': choice})
    snapshot(config, spark)
    assert same(pg, config, "public.t", columns=columns) == 2
    pg.execute("""
        INSERT INTO t VALUES (3, 30, 'thirty');
        UPDATE t SET "Duration" = 'one', duration = 1 WHERE id = 1;
        DELETE FROM t WHERE id = 2;
        ALTER TABLE t ADD COLUMN note text DEFAULT 'x';
        UPDATE t SET "Duration" = 'three' WHERE id = 3;
    """)
    drain(config, spark)
    assert same(pg, config, "public.t", columns=columns) == 2
    kept = ["id", "duration", "note"] + (["duration_2"] if "rename" in str(choice) else [])
    assert sorted(
        name for name in delta_rs_rows(path_of(config, "public.t")).column_names if not name.startswith("_")
    ) == sorted(kept)


def test_a_case_clash_arriving_in_a_drain_is_refused(pg: PgDatabase, tmp_path: Path, spark: SparkSession) -> None:
    pg.execute("""
        CREATE TABLE t (id int PRIMARY KEY, duration int);
        INSERT INTO t VALUES (1, 10);
        CREATE PUBLICATION pub FOR TABLE t;
    """)
    config = configured(pg, tmp_path, {})
    snapshot(config, spark)
    start = slot_confirmed(pg)
    pg.execute("""ALTER TABLE t ADD COLUMN "Duration" text; INSERT INTO t VALUES (2, 20, 'twenty')""")
    with pytest.raises(ColumnClashError) as refused:
        drain(config.model_copy(update={"on_table_error": "stop"}), spark)  # by default: quarantined, same line
    one_line(refused, 'public.t has columns "duration" and "Duration"', "{rename: duration_2}")
    assert slot_confirmed(pg) == start
    config = configured(pg, tmp_path, {'public.t."Duration"': {"rename": "duration_2"}})
    drain(config, spark)
    assert same(pg, config, "public.t", columns={"Duration": ColumnChoice(rename="duration_2")}) == 2
    start = slot_confirmed(pg)
    pg.execute(
        """ALTER TABLE t DROP duration; ALTER TABLE t ADD COLUMN "DURATION" int; INSERT INTO t VALUES (3, 'x', 3)"""
    )
    with pytest.raises(ColumnClashError) as refused_again:  # Delta keeps the dropped duration
        drain(config.model_copy(update={"on_table_error": "stop"}), spark)
    one_line(refused_again, 'public.t has columns "duration" and "DURATION"', "{rename: duration_2}")
    assert slot_confirmed(pg) == start


def test_leaving_out_a_key_column_is_refused_with_nothing_written(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession
) -> None:
    pg.execute(CLASH)
    config = configured(pg, tmp_path, {"public.t.id": "exclude"})
    with pytest.raises(ConfigurationError) as refused:
        snapshot(config, spark)
    one_line(refused, 'public.t: its key column(s) "id" are excluded', 'remove columns: {"public.t.id": exclude}')
    assert lake_files(tmp_path / "lake") == []
