"""Tables named any way PostgreSQL allows load into Dagster and replicate: asset keys keep the real
names, every name Dagster derives gets pgcdc's encoding (``resources.names.dagster_name``), Delta
locations stay apart.

The encoding on its own (valid, injective over twins, read back, the same at every load); the
definitions of such tables loaded and validated by Dagster; then a real PostgreSQL whose
``FOR ALL TABLES`` publication holds them (odd schema, table and column names), snapshotted and
drained through Dagster's jobs into Delta and compared with PostgreSQL value for value.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from dagster import AssetCheckKey, AssetKey, DagsterInstance, Definitions, SensorResult

from pgcdc_assets.builder import build_definitions, build_pipeline_definitions
from pgcdc_assets.dagster_resources import PostgresResource
from pgcdc_assets.named_outputs import check_output_name, input_name, output_name
from pgcdc_assets.translator import PgcdcTranslator
from resources.config import parse_config, PgcdcConfig
from resources.names import dagster_name, dagster_name_parts, PipelineNames, TableName
from resources.sql import quote_ident
from resources.testing.verify import assert_delta_equals_postgres
from tests.support.dagster_runs import check_outcomes, evaluate, materializations, run_job, write_config
from tests.support.postgres import NEWEST_POSTGRES_ONLY, PgDatabase

DAGSTER_NAME = re.compile(r"^[A-Za-z0-9_]+$")  # what Dagster accepts as an op, output or input name

LONG = "é" * 31 + "x"  # 63 bytes in UTF-8: the longest name PostgreSQL keeps (NAMEDATALEN - 1)

#: Tables whose names differ only where a careless encoding would merge them.
TWINS = [
    TableName("public", "order_items"),
    TableName("public", "order-items"),  # -/_ twins
    TableName("public", "order.items"),
    TableName("public", "order items"),
    TableName("public", "Orders"),  # case twins
    TableName("public", "orders"),
    TableName("public", "ORDERS"),
    TableName("a.b", "c"),  # the dot inside the schema, or inside the table
    TableName("a", "b.c"),
    TableName("a__b", "c"),  # the separator inside a part
    TableName("a", "b__c"),
    TableName("a_", "b"),
    TableName("a", "_b"),
    TableName("public", 'say "hi"'),
    TableName("public", "a$b"),
    TableName("public", "café"),
    TableName("public", "cafe\u0301"),  # the same word, decomposed
    TableName("My Schema", "Order Items"),
    TableName("public", LONG),
    TableName("public", "x" * 63),
    TableName("public", "😀"),
    TableName("public", "_5f"),  # looks like an escape
    TableName("public", "order_5fitems"),  # what order_items would be, escaped
]


# --------------------------------------------------------------------------- the encoding


def test_dagster_names_of_twins_are_valid_distinct_and_read_back() -> None:
    for role in ("asset", "check", "upstream"):
        names = [dagster_name(role, "pgcdc", table.schema, table.name) for table in TWINS]
        assert all(DAGSTER_NAME.fullmatch(name) for name in names), names
        assert len(set(names)) == len(TWINS)
        assert [dagster_name_parts(name) for name in names] == [(role, "pgcdc", t.schema, t.name) for t in TWINS]
    keys = [AssetKey(["pgcdc", table.schema, table.name]) for table in TWINS]
    derived = [output_name(key) for key in keys] + [input_name(key) for key in keys]
    derived += [check_output_name(AssetCheckKey(key, "schema_matches_postgres")) for key in keys]
    assert len(set(derived)) == 3 * len(TWINS) and all(DAGSTER_NAME.fullmatch(name) for name in derived)


def test_dagster_names_are_the_documented_ones() -> None:
    """Fixed strings: a name must not change between loads, processes or releases (it names outputs in run logs)."""
    assert dagster_name("asset", "pgcdc", "public", "orders") == "asset__pgcdc__public__orders"
    assert dagster_name("asset", "pgcdc", "public", "order_items") == "asset__pgcdc__public__order_items"
    assert dagster_name("asset", "pgcdc", "public", "order-items") == "asset__pgcdc__public__order_2ditems_"
    assert dagster_name("asset", "pgcdc", "My Schema", "Order Items") == "asset__pgcdc__My_20Schema__Order_20Items_"
    assert dagster_name("t", "public", "order_items", "café") == "t__public__order_5fitems__caf_e9_"
    assert dagster_name("t", "a", 'say "hi"', "😀") == "t__a__say_20_22hi_22___U01f600_"
    assert dagster_name("t", "a", " b") == "t__a___20b_"


def test_dagster_names_of_random_parts_read_back() -> None:
    """Parts drawn from the characters an encoding could confuse; any two different tuples get different names."""
    rng = random.Random(20261128)
    alphabet = ["_", "__", "-", ".", " ", '"', "a", "Z", "0", "f", "u", "U", "é", "€", "😀", "_20", "_u"]
    seen: dict[str, tuple[str, ...]] = {}
    for _ in range(3000):
        parts = tuple("".join(rng.choices(alphabet, k=rng.randint(0, 5))) for _ in range(rng.randint(1, 4)))
        name = dagster_name(*parts)
        assert DAGSTER_NAME.fullmatch(name), (parts, name)
        assert dagster_name_parts(name) == parts
        assert seen.setdefault(name, parts) == parts, f"{parts} and {seen[name]} share {name}"


@pytest.mark.parametrize("name", ["a___b", "x_zz_", "a__", "_a__", "A_2D_", "Order Items"])
def test_names_the_encoding_never_gives_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="not a name dagster_name gives"):
        dagster_name_parts(name)


def test_twins_get_delta_locations_of_their_own(tmp_path: Path) -> None:
    config = _config(tmp_path)
    paths = [config.table_path(table.schema, table.name) for table in TWINS]
    assert len(set(paths)) == len(TWINS)
    assert config.table_path("public", "order_items") == str(tmp_path / "lake" / "public" / "order_items")
    assert config.table_path("public", "order-items") == str(tmp_path / "lake" / "public" / "order-2ditems")
    assert config.table_path("public", "Orders") == str(tmp_path / "lake" / "public" / "Orders")


def test_written_names_read_back_and_quote_only_when_needed() -> None:
    assert [table.written for table in TWINS[:3]] == [
        "public.order_items",
        'public."order-items"',
        'public."order.items"',
    ]
    assert TableName("public", 'say "hi"').written == 'public."say ""hi"""'
    assert all(TableName.parse(table.written) == table for table in TWINS)
    assert (
        parse_config({**_settings(Path("/x")), "tables": [t.written for t in TWINS]}).tables[13]
        == 'public."say ""hi"""'
    )


# --------------------------------------------------------------------------- definitions


def _settings(tmp_path: Path) -> dict[str, object]:
    return {"postgres": {"dsn": "host=x"}, "publication": "p", "delta": {"root": str(tmp_path / "lake")}}


def _config(tmp_path: Path) -> PgcdcConfig:
    return parse_config({**_settings(tmp_path), "history": {"default": "changelog"}})


@pytest.mark.parametrize("pipeline", [None, "shop"])
def test_definitions_of_the_twins_load_and_validate(tmp_path: Path, pipeline: str | None) -> None:
    names = PipelineNames(pipeline)
    postgres = PostgresResource(config_file=str(tmp_path / "pgcdc.yaml"))
    defs = build_pipeline_definitions(_config(tmp_path), names, postgres, PgcdcTranslator(), TWINS)
    Definitions.validate_loadable(defs)

    prefix = ["pgcdc"] if pipeline is None else ["pgcdc", pipeline]
    graph = defs.resolve_asset_graph()
    expected = {AssetKey([*prefix, "slot"])}
    for role in ([], ["snapshot"], ["history"]):
        expected |= {AssetKey([*prefix, *role, table.schema, table.name]) for table in TWINS}
    assert set(graph.get_all_asset_keys()) == expected
    table = graph.get(AssetKey([*prefix, "My Schema", "Order Items"]))
    assert table.parent_keys == {AssetKey([*prefix, "snapshot", "My Schema", "Order Items"])}
    assert table.metadata["pgcdc/table"] == '"My Schema"."Order Items"'
    location = _config(tmp_path).table_path("My Schema", "Order Items")
    assert (table.metadata["dagster/table_name"], table.metadata["dagster/uri"]) == (location, f"file://{location}")
    history = graph.get(AssetKey([*prefix, "history", "My Schema", "Order Items"])).metadata["dagster/table_name"]
    assert history == _config(tmp_path).history_path("My Schema", "Order Items")
    assert 'PostgreSQL table "My Schema"."Order Items" at ' in (table.description or "")
    for job in ("snapshot", "resnapshot", "incremental", "reconcile", "maintenance"):
        assert defs.resolve_job_def(names.scoped(f"pgcdc_{job}")).name == names.scoped(f"pgcdc_{job}")
    checks = defs.resolve_job_def(names.scoped("pgcdc_reconcile")).asset_layer.asset_graph.asset_check_keys
    assert len(checks) == 2 * len(TWINS)
    drain = defs.resolve_assets_def(AssetKey([*prefix, "slot"])).node_def
    assert drain.name == names.scoped("drain_slot")
    # slot, tables, histories; the lag check, each table's schema and quarantine checks
    assert len(drain.output_dict) == 1 + 2 * len(TWINS) + 1 + 2 * len(TWINS)
    assert len(drain.input_dict) == len(TWINS)  # each table waits for its snapshot


# --------------------------------------------------------------------------- a real run


#: The run's tables: odd schema names, -/_ and case twins, quotes, dots, dollars, non-ASCII, 63 bytes.
REPLICATED = [
    TableName("My Schema", "Order Items"),
    TableName("public", "order-items"),
    TableName("public", "order_items"),
    TableName("public", "Orders"),
    TableName("public", "orders"),
    TableName("sch.é$", 'say "hi"'),
    TableName("public", LONG),
]

#: Each table's columns: a key with a space, then dots, dollars, quotes, non-ASCII, -/_ twins, 63 bytes.
#: No case twins (``"Amount"`` and ``amount``): Delta refuses two columns that differ only in case.
COLUMNS = {"Item Id": "bigint PRIMARY KEY", "Qty.$": "int", 'naïve "col"': "text", "a-b": "text", "a_b": "text"}
COLUMNS["ü" * 31 + "y"] = "numeric(8,2)"


@pytest.fixture
def instance() -> Iterator[DagsterInstance]:
    with DagsterInstance.ephemeral() as instance:
        yield instance


def _create_tables(pg: PgDatabase) -> None:
    columns = ", ".join(f"{quote_ident(name)} {kind}" for name, kind in COLUMNS.items())
    pg.execute('CREATE SCHEMA "My Schema"; CREATE SCHEMA "sch.é$"')
    for number, table in enumerate(REPLICATED):
        pg.execute(f"CREATE TABLE {table.quoted} ({columns})")
        pg.execute(
            f"INSERT INTO {table.quoted} SELECT g, g * %s, 'v' || g, 'dash' || g, NULL, g / 4.0"
            " FROM generate_series(1, 20) g",
            (number,),
        )
    pg.execute("CREATE PUBLICATION pgcdc_pub FOR ALL TABLES")


def _change_tables(pg: PgDatabase) -> None:
    for number, table in enumerate(REPLICATED):
        pg.execute(f'UPDATE {table.quoted} SET "a_b" = %s, "Qty.$" = NULL WHERE "Item Id" <= 3', (table.written,))
        pg.execute(f'DELETE FROM {table.quoted} WHERE "Item Id" = 20')
        pg.execute(f"INSERT INTO {table.quoted} VALUES (100 + %s, 7, 'é\"', '-', '_', 1.5)", (number,))


@NEWEST_POSTGRES_ONLY
@pytest.mark.slow  # Dagster runs on the embedded engine
def test_odd_names_replicate_through_dagster(pg: PgDatabase, tmp_path: Path, instance: DagsterInstance) -> None:
    _create_tables(pg)
    config_file = write_config(tmp_path, pg)
    defs = build_definitions(config_file)  # the tables come from the FOR ALL TABLES publication
    Definitions.validate_loadable(defs)
    snapshot_keys = {AssetKey(["pgcdc", "snapshot", t.schema, t.name]) for t in REPLICATED}
    table_keys = {AssetKey(["pgcdc", t.schema, t.name]) for t in REPLICATED}
    assert set(defs.resolve_asset_graph().get_all_asset_keys()) == snapshot_keys | table_keys | {
        AssetKey(["pgcdc", "slot"])
    }

    request = evaluate(defs, "pgcdc_new_tables_sensor", instance, config_file)
    assert isinstance(request, SensorResult) and set(request.run_requests[0].asset_selection or []) == snapshot_keys

    # The first snapshot through the resnapshot job, every table named in its run config as a person writes it.
    listed = {"ops": {"snapshot_tables": {"config": {"tables": [t.written for t in REPLICATED]}}}}
    snapshot = run_job(defs, instance, "pgcdc_resnapshot", run_config=listed)
    assert set(materializations(snapshot)) == snapshot_keys

    _change_tables(pg)
    drain = run_job(defs, instance, "pgcdc_incremental")
    assert set(materializations(drain)) == table_keys | {AssetKey(["pgcdc", "slot"])}
    schema_checks = {
        key: passed for (key, check), passed in check_outcomes(drain).items() if check == "schema_matches_postgres"
    }
    assert schema_checks == dict.fromkeys(table_keys, True)  # snapshotted since the last drain: all evaluated

    config = parse_config({"postgres": {"dsn": pg.dsn}, "publication": "p", "delta": {"root": str(tmp_path / "lake")}})
    paths = {table: config.table_path(table.schema, table.name) for table in REPLICATED}
    assert len(set(paths.values())) == len(REPLICATED)
    for table, path in paths.items():
        assert assert_delta_equals_postgres(pg.dsn, table, path, key=("Item Id",)) == 20, table
