"""Delta writes through the embedded Sail engine, read back with delta-rs as an independent reader."""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal
from pathlib import Path

import deltalake
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark.sql import SparkSession
from pyspark.sql.pandas.types import to_arrow_schema

from resources.delta.batch_columns import OP_COLUMN, unchanged_flag_column
from resources.delta.dataframes import nullable_schema
from resources.delta.delta_types import statistics_columns, STATISTICS_COLUMNS_PROPERTY
from resources.delta.layout import TableLayout
from resources.delta.merge import delete_all_rows, merge_batch, replace_rows
from resources.delta.schema_changes import add_columns, table_schema
from resources.delta.snapshot_writes import write_snapshot
from resources.delta.staging import STAGING_DIRECTORY
from resources.engines.capabilities import engine_capabilities, EngineCapabilities, set_engine_capabilities
from resources.engines.engine import classic_delta_config, SparkEngine
from resources.pgtypes import arrow_schema, PgColumnType, TIMESTAMP_POSITIVE_INFINITY, to_arrow
from resources.testing.memory_destination import InMemoryDestination
from tests.support.engine_fixtures import assert_delta_jars
from tests.support.marker_reads import read_commit_metadata

pytest_plugins = ["tests.support.spark_fixtures"]

SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("name", pa.string()),
        pa.field("amount", pa.decimal128(10, 2)),
        pa.field("seen", pa.timestamp("us")),
        pa.field("at", pa.timestamp("us", tz="UTC")),
        pa.field("tags", pa.list_(pa.int32())),
        pa.field("blob", pa.binary()),
    ]
)


def rows(ids: list[int]) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "name": pa.array([f"n{i}" for i in ids]),
            "amount": pa.array([Decimal(i) / 100 for i in ids], pa.decimal128(10, 2)),
            "seen": pa.array([dt.datetime(2024, 1, 1) + dt.timedelta(microseconds=i) for i in ids], pa.timestamp("us")),
            "at": pa.array([i * 1_000_001 for i in ids], pa.timestamp("us", tz="UTC")),
            "tags": pa.array([[i, None] for i in ids], pa.list_(pa.int32())),
            "blob": pa.array([bytes([i % 256]) for i in ids], pa.binary()),
        },
        schema=SCHEMA,
    )


def expected(ids: list[int]) -> pa.Table:
    """What Delta holds for ``rows(ids)``: the same values, every column nullable."""
    return rows(ids).cast(nullable_schema(SCHEMA))


def read_back(path: Path) -> pa.Table:
    return deltalake.DeltaTable(str(path)).to_pyarrow_table().sort_by("id")


def test_classic_config_adds_delta_and_keeps_user_settings() -> None:
    config = classic_delta_config({"spark.sql.shuffle.partitions": "4"})
    assert config["spark.sql.extensions"] == "io.delta.sql.DeltaSparkSessionExtension"
    assert config["spark.sql.catalog.spark_catalog"] == "org.apache.spark.sql.delta.catalog.DeltaCatalog"
    assert_delta_jars(config)
    assert config["spark.databricks.delta.snapshotPartitions"] == "2"
    assert config["spark.sql.shuffle.partitions"] == "4"  # the user's setting wins


def test_second_engine_is_independent_and_stops_cleanly(spark: SparkSession) -> None:
    with SparkEngine.embedded() as engine:
        assert engine.spark is not spark
        assert engine.spark.range(3).count() == 3
    assert spark.range(2).count() == 2


def test_snapshot_round_trips_exact_values_and_records_metadata(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "t"
    version = write_snapshot(spark, rows([1, 2, 3]), SCHEMA, str(path), '{"snapshot_lsn": "0/16B3748"}')
    assert version == 1  # version 0: delta-rs creates the new table, empty, with its layout property
    table = read_back(path)
    assert table.schema == nullable_schema(SCHEMA)
    assert table.equals(expected([1, 2, 3]))
    assert read_commit_metadata(spark, str(path))[0].user_metadata == '{"snapshot_lsn": "0/16B3748"}'
    assert deltalake.DeltaTable(str(path)).history(1)[0]["userMetadata"] == '{"snapshot_lsn": "0/16B3748"}'


def test_chunked_snapshot_lands_in_one_commit(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "t"
    write_snapshot(spark, rows([9]), SCHEMA, str(path), "old")
    batches = (batch for part in range(5) for batch in rows(list(range(part * 100, part * 100 + 100))).to_batches())
    version = write_snapshot(spark, batches, SCHEMA, str(path), "new", chunk_bytes=1)
    assert version == 2
    assert read_back(path).equals(expected(list(range(500))))
    assert [(c.version, c.user_metadata) for c in read_commit_metadata(spark, str(path))] == [
        (2, "new"),
        (1, "old"),
        (0, None),
    ]
    assert not (path / STAGING_DIRECTORY).exists()
    one_big_batch = rows(list(range(300)))
    version = write_snapshot(spark, one_big_batch, SCHEMA, str(path), "sliced", chunk_bytes=one_big_batch.nbytes // 3)
    assert version == 3 and read_back(path).equals(expected(list(range(300))))


def _log_actions(path: Path) -> dict[str, object]:
    """The newest protocol and metaData actions and the last commit's userMetadata in the table's log."""
    found: dict[str, object] = {}
    for commit in sorted((path / "_delta_log").glob("*.json")):
        for action in map(json.loads, commit.read_text().splitlines()):
            found.update({kind: action[kind] for kind in ("protocol", "metaData") if kind in action})
            if "commitInfo" in action:
                found["userMetadata"] = action["commitInfo"].get("userMetadata")
    return found


def test_both_snapshot_writers_give_the_same_delta_table(spark: SparkSession, tmp_path: Path) -> None:
    """delta-rs (the snapshots of an engine without Delta's commands) and the engine's overwrite (Delta on
    Spark's, and key ranges') write the same schema for every Arrow type pgtypes maps to, the same
    partitioning, layout property, protocol versions and marker: what drains, markers.py and table_log.py
    read cannot tell them apart (a delta-rs upgrade that changes any of it fails here)."""
    table = (
        rows([1, 2, 3])
        .append_column(pa.field('odd, "name"', pa.int16()), pa.array([1, None, -32768], pa.int16()))
        .append_column("ratio", pa.array([0.5, None, -0.25], pa.float32()))
        .append_column("f8", pa.array([1e300, None, float("-inf")], pa.float64()))
        .append_column("ok", pa.array([True, None, False]))
        .append_column("day", pa.array([dt.date(1, 1, 1), None, dt.date(9999, 12, 31)], pa.date32()))
        .append_column("words", pa.array([["a", None], None, []], pa.list_(pa.string())))
        .append_column("n32", pa.array([1, 2, None], pa.int32()))
    )
    layout = TableLayout("range", ("id",), 2)
    detected = engine_capabilities(spark)
    tables = {}
    try:
        for delta_rs in (False, True):
            set_engine_capabilities(spark, EngineCapabilities(detected.delta_commands, delta_rs))
            tables[delta_rs] = tmp_path / ("delta-rs" if delta_rs else "engine")
            write_snapshot(
                spark, table, table.schema, str(tables[delta_rs]), '{"pgcdc": {"kind": "snapshot"}}', layout=layout
            )
    finally:
        set_engine_capabilities(spark, detected)
    engine, delta_rs = _log_actions(tables[False]), _log_actions(tables[True])
    assert json.loads(delta_rs["metaData"]["schemaString"]) == json.loads(engine["metaData"]["schemaString"])
    for key in ("partitionColumns", "configuration", "format"):
        assert delta_rs["metaData"][key] == engine["metaData"][key], key
    assert delta_rs["metaData"]["partitionColumns"] == ["_pgcdc_bucket"]
    assert delta_rs["userMetadata"] == engine["userMetadata"] == '{"pgcdc": {"kind": "snapshot"}}'
    for key in ("minReaderVersion", "minWriterVersion", "readerFeatures"):
        assert delta_rs["protocol"].get(key) == engine["protocol"].get(key), key
    assert set(delta_rs["protocol"]["writerFeatures"]) <= set(engine["protocol"]["writerFeatures"])
    assert read_back(tables[True]).equals(read_back(tables[False]))


def _stats_columns(path: Path) -> set[str]:
    """Every column any live or removed data file of the table has min/max statistics on."""
    columns: set[str] = set()
    for commit in sorted((path / "_delta_log").glob("*.json")):
        for action in map(json.loads, commit.read_text().splitlines()):
            stats = json.loads((action.get("add") or {}).get("stats") or "{}")
            columns |= set(stats.get("minValues", {})) | set(stats.get("maxValues", {}))
    return columns


def test_a_bucketed_table_keeps_statistics_on_its_key_only(spark: SparkSession, tmp_path: Path) -> None:
    """A snapshot that creates a bucketed table records ``delta.dataSkippingStatsColumns`` = its key, by either
    writer; delta-rs's snapshot and the engine's MERGE then write statistics on the key alone, the MERGE's
    result is exact, and delta-rs reads the table back; an unbucketed table keeps them on every column but
    floats; a table without the property (an earlier pgcdc's) keeps statistics on every column and merges alike."""
    layout = TableLayout("range", ("id",), 2)
    detected = engine_capabilities(spark)
    batch = changes(ops=["U", "D", "I"], ids=[1, 3, 10], names=["renamed", None, "new"], keep_name=[False] * 3)
    bucketed = batch.append_column("_pgcdc_bucket", pa.array([0, 1, 5], pa.int64()))
    try:
        for delta_rs in (False, True):
            set_engine_capabilities(spark, EngineCapabilities(detected.delta_commands, delta_rs))
            path = tmp_path / ("delta-rs" if delta_rs else "engine")
            write_snapshot(
                spark, rows([1, 2, 3, 4]), SCHEMA, str(path), '{"pgcdc": {"kind": "snapshot"}}', layout=layout
            )
            assert _log_actions(path)["metaData"]["configuration"][STATISTICS_COLUMNS_PROPERTY] == "`id`"  # type: ignore[index]
            merge_batch(spark, str(path), bucketed, ["id"])
            assert _stats_columns(path) == {"id"}, delta_rs
            table = read_back(path).drop_columns(["_pgcdc_bucket"])
            assert table["name"].to_pylist() == ["renamed", "n2", "n4", "new"]
    finally:
        set_engine_capabilities(spark, detected)
    unbucketed = tmp_path / "unbucketed"
    write_snapshot(spark, rows([1, 2, 3, 4]), SCHEMA, str(unbucketed), '{"pgcdc": {"kind": "snapshot"}}')
    assert {"id", "name", "amount", "seen", "at"} <= _stats_columns(unbucketed)
    earlier = tmp_path / "earlier"
    deltalake.write_deltalake(str(earlier), rows([1, 2, 3, 4]))  # no property: every column's statistics
    merge_batch(spark, str(earlier), batch, ["id"])
    assert {"id", "name", "amount"} <= _stats_columns(earlier)
    assert read_back(earlier)["name"].to_pylist() == ["renamed", "n2", "n4", "new"]
    flagged = pa.schema([("flag", pa.bool_()), ("id", pa.int64()), ("blob", pa.binary()), ("f", pa.float32())])
    # Delta on Spark refuses the property naming a boolean or a binary; floats are kept out (Sail's NaN reads)
    assert statistics_columns(flagged, ["flag", "id"]) == {STATISTICS_COLUMNS_PROPERTY: "`id`"}
    assert statistics_columns(flagged, None) == {STATISTICS_COLUMNS_PROPERTY: "`id`"}
    assert statistics_columns(flagged, ["flag", "blob", "f"]) == {"delta.dataSkippingNumIndexedCols": "0"}
    odd = pa.schema([("odd, `name`", pa.int64())])
    assert statistics_columns(odd, None) == {STATISTICS_COLUMNS_PROPERTY: "`odd, ``name```"}


def test_empty_snapshot_keeps_schema(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "t"
    write_snapshot(spark, [], SCHEMA, str(path), "empty")
    table = read_back(path)
    assert table.num_rows == 0 and table.schema.names == SCHEMA.names


def test_converted_postgres_values_survive_delta(spark: SparkSession, tmp_path: Path) -> None:
    """Infinity and BC timestamps are written and read back bit for bit."""
    column = PgColumnType(
        column="valid_to", type_oid=1184, type_name="timestamp with time zone", base_name="timestamptz"
    )
    values = to_arrow(pa.array(["infinity", "0044-03-15 12:00:00+00 BC", "-infinity", None]), column)
    table = pa.table({"valid_to": values}, schema=arrow_schema([column]))
    write_snapshot(spark, table, table.schema, str(tmp_path / "t"), "m")
    back = deltalake.DeltaTable(str(tmp_path / "t")).to_pyarrow_table()["valid_to"]
    assert back.cast(pa.int64()).to_pylist() == [TIMESTAMP_POSITIVE_INFINITY, -63517780800000000, -(2**63), None]


def changes(ops: list[str], ids: list[int], names: list[str | None], keep_name: list[bool]) -> pa.Table:
    base = rows(ids).set_column(1, "name", pa.array(names, pa.string()))
    return base.append_column(OP_COLUMN, pa.array(ops)).append_column(
        unchanged_flag_column("name"), pa.array(keep_name)
    )


def test_merge_inserts_updates_deletes_and_keeps_unchanged_toast(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "t"
    write_snapshot(spark, rows([1, 2, 3, 4]), SCHEMA, str(path), "snap")
    batch = changes(
        ops=["U", "U", "D", "I", "D"],
        ids=[1, 2, 3, 10, 99],
        names=["renamed", None, None, "new", None],
        keep_name=[False, True, False, False, False],
    )
    merge_batch(spark, str(path), batch, ["id"])
    table = read_back(path)
    assert table["id"].to_pylist() == [1, 2, 4, 10]
    assert table["name"].to_pylist() == ["renamed", "n2", "n4", "new"]
    assert table.drop_columns(["name"]).equals(expected([1, 2, 4, 10]).drop_columns(["name"]))


def test_replace_rows_rewrites_the_rows_equal_to_the_probe_in_one_commit_with_its_marker(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Duplicates of a row (lists, timestamps with a time zone: types Sail's replaceWhere is picky
    about) are handed to the rewrite, replaced by what it returns; every other row stays."""
    path = tmp_path / "t"
    write_snapshot(spark, rows([1, 1, 1, 2, 3]), SCHEMA, str(path), "s")
    seen: list[pa.Table] = []

    def keep_one(current: pa.Table) -> pa.Table:
        seen.append(current)
        copies = [i for i, value in enumerate(current.column("id").to_pylist()) if value == 1]
        return current.filter(pa.array([i not in copies[1:] for i in range(current.num_rows)]))

    replace_rows(spark, str(path), rows([1]).select(["id", "name", "tags", "at"]), keep_one, "marker")
    assert seen[0].num_rows >= 3 and seen[0].column("id").to_pylist().count(1) == 3  # every copy (and collisions)
    assert read_back(path).equals(expected([1, 2, 3]))
    assert [(c.version, c.user_metadata) for c in read_commit_metadata(spark, str(path), limit=1)] == [(2, "marker")]

    replace_rows(spark, str(path), rows([2]), lambda current: current.filter(pc.not_equal(current["id"], 2)), "gone")
    assert read_back(path).equals(expected([1, 3]))
    assert [c.user_metadata for c in read_commit_metadata(spark, str(path), limit=1)] == ["gone"]


def test_add_column_then_rows_carry_it(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "t"
    write_snapshot(spark, rows([1]), SCHEMA, str(path), "s")
    add_columns(spark, str(path), pa.schema([("note", pa.string()), ("when", pa.timestamp("us"))]))
    table = read_back(path)
    assert table.schema.names == [*SCHEMA.names, "note", "when"]
    assert table.schema.field("when").type == pa.timestamp("us")
    assert table["note"].to_pylist() == [None]
    batch = (
        rows([2])
        .append_column("note", pa.array(["hello"]))
        .append_column("when", pa.array([None], pa.timestamp("us")))
        .append_column(OP_COLUMN, pa.array(["I"]))
    )
    merge_batch(spark, str(path), batch, ["id"])
    assert read_back(path)["note"].to_pylist() == [None, "hello"]


def test_the_schema_read_from_the_log_is_the_engines(spark: SparkSession, tmp_path: Path) -> None:
    """pgcdc reads a table's schema from its Delta log (no engine round trip): the same schema the
    engine gives the table, for the types pgcdc writes, after an added column and past a checkpoint."""
    path = str(tmp_path / "t")
    more = pa.table({
        "id": pa.array([1], pa.int64()), "small": pa.array([1], pa.int16()), "real": pa.array([1.5], pa.float32()),
        "wide": pa.array([Decimal("1.5")], pa.decimal128(38, 10)), "day": pa.array([dt.date(2024, 1, 1)], pa.date32()),
        "flag": pa.array([True]), "amounts": pa.array([[Decimal("1.5")]], pa.list_(pa.decimal128(10, 1))),
    })  # fmt: skip
    table = rows([1])
    for field in list(more.schema)[1:]:
        table = table.append_column(field, more[field.name])
    write_snapshot(spark, table, table.schema, path, "s")

    def engines() -> pa.Schema:
        return to_arrow_schema(spark.read.format("delta").load(path).schema)

    assert table_schema(path) == engines()
    add_columns(spark, path, pa.schema([("note", pa.string()), ("when", pa.timestamp("us"))]))
    assert table_schema(path) == engines() and table_schema(path).names[-2:] == ["note", "when"]
    for key in range(2, 13):  # the engine writes a checkpoint every 10 commits
        merge_batch(spark, path, pa.table({"id": pa.array([key], pa.int64()), OP_COLUMN: pa.array(["I"])}), ["id"])
    assert any(log.name.endswith(".checkpoint.parquet") for log in (Path(path) / "_delta_log").iterdir())
    assert table_schema(path) == engines()
    with pytest.raises(FileNotFoundError):
        table_schema(str(tmp_path / "none"))


def test_delete_all_rows_keeps_schema_and_history(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "t"
    write_snapshot(spark, rows([1, 2]), SCHEMA, str(path), "s")
    delete_all_rows(spark, str(path))
    table = read_back(path)
    assert table.num_rows == 0 and table.schema.names == SCHEMA.names
    latest = read_commit_metadata(spark, str(path), limit=1)
    assert [(c.version, c.operation) for c in latest] == [(2, "DELETE")]


@pytest.mark.parametrize("deletion_vectors", [False, True], ids=["copy-on-write", "deletion-vectors"])
def test_the_in_memory_destination_merges_like_sail(
    spark: SparkSession, tmp_path: Path, deletion_vectors: bool
) -> None:
    """The same folded batches through merge_batch on Sail and through InMemoryDestination give the same rows.

    This keeps the fast applier tests (test_applier_memory.py) honest: their destination must
    mean what the MERGE means, including unchanged flags and rows moved from an old key. Batches
    of whole-row changes run as a delete-and-insert MERGE, those keeping values as an update
    (resources/delta/merge.py: merge_statement); both on tables with and without deletion vectors.
    """
    schema = pa.schema([pa.field("id", pa.int64()), pa.field("body", pa.string()), pa.field("n", pa.int32())])
    start = pa.table(
        {"id": [1, 2, 3, 4], "body": ["a", "b", "c", "d"], "n": pa.array([1, 2, 3, 4], pa.int32())}, schema=schema
    )
    flag = unchanged_flag_column("body")
    batches = [
        pa.table(
            {
                "id": [1, 2, 9],
                "body": ["a1", None, "new"],
                "n": pa.array([10, None, 90], pa.int32()),
                OP_COLUMN: ["U", "D", "I"],
            }
        ),
        pa.table(
            {
                "id": [3, 7, 4],
                "body": [None, None, "d2"],
                "n": pa.array([30, 70, 40], pa.int32()),
                flag: [True, True, False],
                "_pgcdc_oldkey_id": pa.array([None, 1, None], pa.int64()),
                OP_COLUMN: ["U", "U", "U"],
            }
        ),
        pa.table({"id": [8, 9], "body": [None, "x"], "n": pa.array([None, 99], pa.int32()), OP_COLUMN: ["D", "U"]}),
        # 4 deleted, 3 moved onto 4 keeping its value: the match under 4 is stale, 3's value wins.
        pa.table(
            {
                "id": [3, 4],
                "body": [None, None],
                "n": pa.array([None, 41], pa.int32()),
                flag: [None, True],
                "_pgcdc_oldkey_id": pa.array([None, 3], pa.int64()),
                OP_COLUMN: ["D", "U"],
            }
        ),
    ]
    path = str(tmp_path / "t")
    memory = InMemoryDestination()
    write_snapshot(spark, start, schema, path, "{}", deletion_vectors=deletion_vectors)
    memory.write_snapshot(start, schema, path, "{}")
    for batch in batches:
        merge_batch(spark, path, batch, ["id"])
        memory.merge_batch(path, batch, ["id"])
    on_sail = spark.read.format("delta").load(path).toArrow().sort_by("id").to_pylist()
    assert on_sail == memory.tables[path].sort_by("id").to_pylist()
    assert {row["id"]: row["body"] for row in on_sail} == {1: "a1", 4: "c", 7: "a1", 9: "x"}
    log = [
        json.loads(line)
        for commit in (Path(path) / "_delta_log").glob("*.json")
        for line in commit.read_text().splitlines()
    ]
    marked = [action["add"]["deletionVector"] for action in log if action.get("add", {}).get("deletionVector")]
    assert bool(marked) == deletion_vectors  # rows marked deleted, not files rewritten
