"""The pgcdc Component: two pipelines on two databases of one real PostgreSQL server, in one code location.

The code location is a real dg project in a temporary directory (pyproject.toml, a package,
``defs/pipelines/defs.yaml``), loaded as ``dagster dev`` loads it; runs use the real Sail
engine and the Delta tables are compared with PostgreSQL value for value.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from dagster import (
    AssetCheckKey,
    AssetKey,
    build_sensor_context,
    DagsterInstance,
    Definitions,
    ExecuteInProcessResult,
    FreshnessPolicy,
    instance_for_test,
    load_from_defs_folder,
)
from dagster.components.resolved.errors import ResolutionException

from pgcdc_assets.pipelines_file import PipelineKeys, validate_pipeline
from resources.config.columns import ColumnChoice
from resources.engines.engine import EMBEDDED_ENVIRONMENT
from resources.errors import SlotError
from resources.names import ROW_COUNT_CHECK, ROWS_MATCH_CHECK, SCHEMA_CHECK, SLOT_LAG_CHECK, TableName
from resources.testing.local_postgres import LocalPostgres
from resources.testing.verify import assert_delta_equals_postgres
from tests.support.postgres import fresh_database, NEWEST_POSTGRES_ONLY, PgDatabase

pytestmark = pytest.mark.slow  # Dagster runs and `dg` commands; tiers: docs/testing.md

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
COMPONENT_TYPE = "pgcdc_assets.component.PgcdcComponent"
#: Trust authentication ignores it; it must still never reach Dagster's records.
PASSWORD = "s3cret-pw-do-not-log"


def make_project(root: Path) -> Path:
    """A dg project (pyproject.toml, package, definitions.py) with an empty defs folder; returns its defs folder."""
    package = f"pgcdc_project_{uuid.uuid4().hex[:8]}"  # a fresh module name: loads never share imports
    (root / package / "defs").mkdir(parents=True)
    (root / package / "__init__.py").write_text("")
    (root / package / "defs" / "__init__.py").write_text("")
    (root / package / "definitions.py").write_text(
        "from pathlib import Path\n\nimport dagster as dg\n\n\n@dg.definitions\ndef defs() -> dg.Definitions:\n"
        "    return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)\n"
    )
    (root / "pyproject.toml").write_text(
        f'[project]\nname = "{package}"\nversion = "0.1.0"\n\n[tool.dg]\ndirectory_type = "project"\n\n'
        f'[tool.dg.project]\nroot_module = "{package}"\ncode_location_name = "{package}.definitions"\n'
        'registry_modules = ["pgcdc_assets.component"]\n'
    )
    return root / package / "defs"


def write_pipelines(defs: Path, pipelines: dict[str, object]) -> Path:
    folder = defs / "pipelines"
    folder.mkdir(exist_ok=True)
    path = folder / "defs.yaml"
    path.write_text(yaml.safe_dump({"type": COMPONENT_TYPE, "attributes": {"pipelines": pipelines}}, sort_keys=False))
    return path


def pipeline(
    env_var: str, slot: str, tables: list[str], lake: Path, spark: str | None = None, **overrides: object
) -> dict[str, object]:
    """One pipeline's settings; the DSN comes from ``env_var`` through Dagster's env templating."""
    return {
        "spark": {"remote": spark},
        "postgres": {"dsn": f"{{{{ env('{env_var}') }}}}"},
        "publication": f"{slot}_pub",
        "create_publication": True,
        "slot": slot,
        "tables": tables,
        "delta": {"root": str(lake)},
        **overrides,
    }


def evaluate_sensor(defs: Definitions, name: str, instance: DagsterInstance) -> Any:
    """One tick of sensor ``name`` with the code location's own resources."""
    sensor = defs.resolve_sensor_def(name)
    with build_sensor_context(instance=instance, resources=defs.resources, sensor_name=name) as context:
        return sensor(context)


def defs_folder(project: Path) -> Path:
    return next(project.glob("*/defs"))


def load(project: Path) -> Definitions:
    """The project's definitions, as a code-location (re)load builds them."""
    return load_from_defs_folder(path_within_project=project)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A dg project on sys.path, as an installed code location's package is."""
    root = tmp_path / "project"
    make_project(root)
    monkeypatch.syspath_prepend(str(root))
    return root


@pytest.fixture(scope="module")
def sail_url() -> Iterator[str]:
    """One Sail server (the embedded engine's, ``resources.engines.sail_server``) for every run of this module.

    The pipelines reach it in remote mode: an engine started per run would dominate the
    module's time. ``make demo`` and tests/test_demo.py run pipelines on embedded engines.
    """
    server = subprocess.Popen(
        [sys.executable, "-m", "resources.engines.sail_server"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**EMBEDDED_ENVIRONMENT, **os.environ},
    )
    assert server.stdin is not None and server.stdout is not None
    try:
        yield f"sc://127.0.0.1:{int(server.stdout.readline())}"
    finally:
        server.stdin.close()
        server.wait(timeout=60)


@pytest.fixture
def billing(pg_server: LocalPostgres) -> Iterator[PgDatabase]:
    """A second database on the server of ``pg``."""
    with fresh_database(pg_server) as database:
        yield database


@pytest.fixture
def instance() -> Iterator[DagsterInstance]:
    with instance_for_test(overrides={"concurrency": {"pools": {"default_limit": 1}}}) as instance:
        yield instance


def run(defs: Definitions, instance: DagsterInstance, job: str) -> ExecuteInProcessResult:
    result = defs.resolve_job_def(job).execute_in_process(instance=instance)
    assert result.success
    return result


def create_tables(shop: PgDatabase, billing: PgDatabase) -> None:
    shop.execute("CREATE TABLE orders (id bigint PRIMARY KEY, customer text, amount numeric(10,2))")
    shop.execute("CREATE TABLE notes (body text)")
    shop.execute("INSERT INTO orders SELECT g, 'c' || g, g * 1.25 FROM generate_series(1, 300) g")
    shop.execute("INSERT INTO notes VALUES ('first'), (NULL)")
    billing.execute("CREATE TABLE invoices (id int PRIMARY KEY, total numeric(12,2), paid boolean)")
    billing.execute("INSERT INTO invoices SELECT g, g * 10, g % 2 = 0 FROM generate_series(1, 200) g")


def change(shop: PgDatabase, billing: PgDatabase) -> None:
    shop.execute("INSERT INTO orders SELECT g, 'n' || g, 1 FROM generate_series(301, 350) g")
    shop.execute("UPDATE orders SET amount = amount + 1 WHERE id % 7 = 0; DELETE FROM orders WHERE id % 11 = 0")
    shop.execute("INSERT INTO notes VALUES ('first'), ('again')")
    billing.execute("UPDATE invoices SET paid = true WHERE id < 50; DELETE FROM invoices WHERE id > 190")
    billing.execute("INSERT INTO invoices VALUES (1000, 1.5, false)")


def assert_exact(database: PgDatabase, lake: Path, tables: list[str]) -> None:
    for table in tables:
        schema, name = table.split(".")
        assert_delta_equals_postgres(database.dsn, table, str(lake / schema / name))


def wait_for_lock_wait(database: PgDatabase, timeout_s: float = 60.0) -> None:
    """Until a session of ``database`` waits for a lock: the shop drain step, behind our lock."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        waiting = database.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        if waiting[0][0]:
            return
        time.sleep(0.1)
    raise AssertionError("the shop drain never reached the locked table")


@NEWEST_POSTGRES_ONLY
def test_two_pipelines_in_one_code_location_drain_concurrently_and_exactly(
    pg: PgDatabase,
    billing: PgDatabase,
    sail_url: str,
    project: Path,
    tmp_path: Path,
    instance: DagsterInstance,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shop = pg
    create_tables(shop, billing)
    monkeypatch.setenv("PGCDC_TEST_SHOP_DSN", shop.server.dsn(shop.name, password=PASSWORD))
    monkeypatch.setenv("PGCDC_TEST_BILLING_DSN", billing.server.dsn(billing.name, password=PASSWORD))
    shop_lake, billing_lake = tmp_path / "lake" / "shop", tmp_path / "lake" / "billing"
    pipelines = {
        "shop": pipeline("PGCDC_TEST_SHOP_DSN", "shop_slot", ["public.orders", "public.notes"], shop_lake, sail_url),
        "billing": pipeline(
            "PGCDC_TEST_BILLING_DSN",
            "billing_slot",
            ["public.invoices"],
            billing_lake,
            sail_url,
            schedule={"cron": "*/10 * * * *"},
        ),
    }
    write_pipelines(defs_folder(project), pipelines)
    defs = load(project)

    # Names, keys, groups, pools and freshness per pipeline.
    graph = defs.resolve_asset_graph()
    orders, invoices = (
        AssetKey(["pgcdc", "shop", "public", "orders"]),
        AssetKey(["pgcdc", "billing", "public", "invoices"]),
    )
    shop_slot, billing_slot = AssetKey(["pgcdc", "shop", "slot"]), AssetKey(["pgcdc", "billing", "slot"])
    assert {key for key in graph.get_all_asset_keys()} == {
        orders,
        AssetKey(["pgcdc", "shop", "public", "notes"]),
        invoices,
        shop_slot,
        billing_slot,
        AssetKey(["pgcdc", "shop", "snapshot", "public", "orders"]),
        AssetKey(["pgcdc", "shop", "snapshot", "public", "notes"]),
        AssetKey(["pgcdc", "billing", "snapshot", "public", "invoices"]),
    }
    assert graph.get(orders).group_name == "pgcdc_shop"
    assert (
        graph.get(AssetKey(["pgcdc", "billing", "snapshot", "public", "invoices"])).group_name
        == "pgcdc_billing_snapshot"
    )
    assert graph.get(billing_slot).group_name == "pgcdc_billing"
    assert graph.get(billing_slot).freshness_policy == FreshnessPolicy.time_window(
        fail_window=timedelta(minutes=30), warn_window=timedelta(minutes=20)
    )
    assert graph.get(invoices).freshness_policy is None
    assert {job.name for job in defs.jobs} >= {
        f"pgcdc_{p}_{job}"
        for p in pipelines
        for job in ("snapshot", "resnapshot", "incremental", "reconcile", "maintenance")
    }
    assert {s.name for s in defs.schedules} == {
        f"pgcdc_{p}_{schedule}" for p in pipelines for schedule in ("incremental_schedule", "maintenance_schedule")
    }
    maintenance_nodes = defs.resolve_job_def("pgcdc_billing_maintenance").nodes
    assert [(node.name, node.definition.pool) for node in maintenance_nodes] == [
        ("pgcdc_billing_maintain_tables", "pgcdc_slot_billing_slot")
    ]
    assert maintenance_nodes[0].definition.required_resource_keys == {"pgcdc_billing_postgres", "pgcdc_billing_spark"}
    assert {s.name for s in defs.sensors} == {
        f"pgcdc_{p}_{sensor}"
        for p in pipelines
        for sensor in ("slot_lag_sensor", "new_tables_sensor", "slot_health_sensor", "quarantine_sensor")
    }
    pools = {node.name: node.definition.pool for node in defs.resolve_job_def("pgcdc_shop_incremental").nodes}
    assert pools == {"pgcdc_shop_drain_slot": "pgcdc_slot_shop_slot"}
    assert set(defs.resources) == {
        "pgcdc_shop_postgres",
        "pgcdc_shop_spark",
        "pgcdc_billing_postgres",
        "pgcdc_billing_spark",
    }
    # The reconcile job too: its op, resource keys and pool are the pipeline's, its checks only its own tables'.
    reconcile = defs.resolve_job_def("pgcdc_shop_reconcile")
    (reconcile_op,) = reconcile.nodes
    assert (reconcile_op.name, reconcile_op.definition.pool) == ("pgcdc_shop_reconcile_tables", "pgcdc_slot_shop_slot")
    assert reconcile_op.definition.required_resource_keys == {"pgcdc_shop_postgres", "pgcdc_shop_spark"}
    shop_tables = [orders, AssetKey(["pgcdc", "shop", "public", "notes"])]
    reconcile_checks = {AssetCheckKey(key, n) for key in shop_tables for n in (ROW_COUNT_CHECK, ROWS_MATCH_CHECK)}
    assert reconcile.asset_layer.asset_graph.asset_check_keys == reconcile_checks
    # The scheduled drain plans the pipeline's slot asset and its lag check, nothing per table.
    incremental = defs.resolve_job_def("pgcdc_shop_incremental")
    assert set(incremental.asset_layer.executable_asset_keys) == {shop_slot}
    assert incremental.asset_layer.asset_graph.asset_check_keys == {AssetCheckKey(shop_slot, SLOT_LAG_CHECK)}
    assert {spec.key for spec in defs.resolve_assets_def(orders).check_specs} >= {
        AssetCheckKey(key, SCHEMA_CHECK) for key in shop_tables
    }

    run(defs, instance, "pgcdc_shop_snapshot")
    run(defs, instance, "pgcdc_billing_snapshot")
    change(shop, billing)

    # The shop drain holds its pool while it waits behind a lock; billing's drain, in its own pool, runs meanwhile.
    # (Runs start one at a time: two in-process runs setting up at once can deadlock in Dagster's logging set-up.)
    outcome: dict[str, ExecuteInProcessResult] = {}
    with shop.connect() as blocker:
        blocker.execute("BEGIN; LOCK TABLE public.orders IN ACCESS EXCLUSIVE MODE")
        shop_drain = threading.Thread(
            target=lambda: outcome.setdefault("shop", run(defs, instance, "pgcdc_shop_incremental"))
        )
        shop_drain.start()
        wait_for_lock_wait(shop)
        assert instance.event_log_storage.get_concurrency_info("pgcdc_slot_shop_slot").active_slot_count == 1
        run(defs, instance, "pgcdc_billing_incremental")
        assert shop_drain.is_alive()
        blocker.execute("ROLLBACK")
    shop_drain.join()
    assert outcome["shop"].success
    drained = {
        e.asset_key: e.event_specific_data.materialization.metadata
        for e in outcome["shop"].get_asset_materialization_events()
    }
    assert set(drained) == {shop_slot, *shop_tables}
    assert drained[shop_slot]["pgcdc/tables_changed"].value == 2
    ((confirmed,),) = shop.execute(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'shop_slot'"
    )
    assert drained[shop_slot]["pgcdc/confirmed_flush_lsn"].value == confirmed
    assert_exact(shop, shop_lake, ["public.orders", "public.notes"])
    assert_exact(billing, billing_lake, ["public.invoices"])
    # One pipeline's reconcile job runs on its own resources and evaluates exactly its own checks.
    reconciled = run(defs, instance, "pgcdc_billing_reconcile").get_asset_check_evaluations()
    assert {(e.asset_key, e.check_name) for e in reconciled} == {
        (invoices, ROW_COUNT_CHECK),
        (invoices, ROWS_MATCH_CHECK),
    }
    assert all(e.passed for e in reconciled), reconciled

    # No password in resource config, run config or any event.
    events = [event for record in instance.get_runs() for event in instance.all_logs(record.run_id)]
    assert len(events) > 20
    assert PASSWORD not in repr(defs.resources) + repr(events)

    # Each pipeline's schedules and sensors target its own jobs and watch its own slot: with billing's
    # slot gone, billing's sensors say so, naming its own jobs, and shop's still see shop's healthy slot.
    for name in pipelines:
        assert defs.resolve_schedule_def(f"pgcdc_{name}_incremental_schedule").job_name == f"pgcdc_{name}_incremental"
        assert defs.resolve_schedule_def(f"pgcdc_{name}_maintenance_schedule").job_name == f"pgcdc_{name}_maintenance"
        assert defs.resolve_sensor_def(f"pgcdc_{name}_slot_lag_sensor").job_name == f"pgcdc_{name}_incremental"
        assert defs.resolve_sensor_def(f"pgcdc_{name}_new_tables_sensor").job_name == f"pgcdc_{name}_snapshot"
    billing.execute("SELECT pg_drop_replication_slot('billing_slot')")
    healthy = evaluate_sensor(defs, "pgcdc_shop_slot_health_sensor", instance)
    assert healthy.skip_message.startswith('slot "shop_slot" is healthy: wal_status reserved'), healthy
    assert "shop_slot" in evaluate_sensor(defs, "pgcdc_shop_slot_lag_sensor", instance).skip_message
    missing = evaluate_sensor(defs, "pgcdc_billing_slot_lag_sensor", instance)
    assert missing.skip_message == 'replication slot "billing_slot" does not exist: run the pgcdc_billing_snapshot job'
    with pytest.raises(
        SlotError, match='replication slot "billing_slot" does not exist on .*run the pgcdc_billing_snapshot job'
    ):
        evaluate_sensor(defs, "pgcdc_billing_slot_health_sensor", instance)

    # A pipeline added to the YAML appears once the code location reloads; the others stay as they were.
    pipelines["audit"] = pipeline("PGCDC_TEST_SHOP_DSN", "audit_slot", ["public.notes"], tmp_path / "lake" / "audit")
    write_pipelines(defs_folder(project), pipelines)
    reloaded = load(project)
    assert AssetKey(["pgcdc", "audit", "public", "notes"]) in reloaded.resolve_asset_graph().get_all_asset_keys()
    assert graph.get_all_asset_keys() < reloaded.resolve_asset_graph().get_all_asset_keys()
    assert reloaded.resolve_job_def("pgcdc_audit_incremental").name == "pgcdc_audit_incremental"


@NEWEST_POSTGRES_ONLY
@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda p: p["shop"]["postgres"].update(dsn="{{ env.PGCDC_TEST_SHOP_DSN }}"),
         ["pipeline 'shop'", "'postgres.dsn'", "env('PGCDC_TEST_SHOP_DSN')"]),
        (lambda p: p["shop"]["postgres"].update(dsn="{{ env('PGCDC_TEST_UNSET_DSN') }}"),
         ["PGCDC_TEST_UNSET_DSN is not set"]),
        (lambda p: p["other"].update(slot="shop_slot"), ["'shop' and 'other'", "slot 'shop_slot'", "'slot'"]),
        (lambda p: p.update({"Bad-Name": p.pop("other")}), ["pipeline name 'Bad-Name'", "lower-case"]),
        (lambda p: p["shop"]["delta"].update(storage={"secret_access_key": "{{ env('PGCDC_TEST_SHOP_DSN') }}"}),
         ["pipeline 'shop'", "'delta.storage.secret_access_key'", "${VAR}"]),
        (lambda p: p["other"]["delta"].update(root=p["shop"]["delta"]["root"]), ["both write public.orders", "'delta.root'"]),
        (lambda p: p["shop"].update(columns={"public.orders.note": "txt"}),
         ["pipeline 'shop'", "'columns'", "public.orders.note: got 'txt': write text, exclude or {rename: new_name}"]),
    ],
    ids=["env-attribute", "unset-variable", "shared-slot", "bad-name", "rendered-secret", "shared-table", "bad-column"],
)  # fmt: skip
def test_yaml_errors_are_one_line_and_write_nothing(
    pg: PgDatabase, project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: object, expected: list[str]
) -> None:
    monkeypatch.setenv("PGCDC_TEST_SHOP_DSN", pg.dsn)
    lake = tmp_path / "lake"
    pipelines = {
        "shop": pipeline("PGCDC_TEST_SHOP_DSN", "shop_slot", ["public.orders"], lake / "shop"),
        "other": pipeline("PGCDC_TEST_SHOP_DSN", "other_slot", ["public.orders"], lake / "other"),
    }
    edit(pipelines)  # type: ignore[operator]
    defs_file = write_pipelines(defs_folder(project), pipelines)

    with pytest.raises(Exception) as raised:
        load(project)

    error = raised.value
    while not isinstance(error, ResolutionException) and error.__cause__ is not None:
        error = error.__cause__
    message = str(error).strip()
    assert isinstance(error, ResolutionException), message
    if "is not set" not in message:  # Dagster's own message for env('X') names the variable, not the file
        assert len(message.splitlines()) == 1 and str(defs_file) in message, message
    for part in expected:
        assert part in message, message
    assert not lake.exists()
    assert pg.execute("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()") == [(0,)]
    assert pg.execute("SELECT count(*) FROM pg_publication") == [(0,)]


@NEWEST_POSTGRES_ONLY
@pytest.mark.parametrize("edit", [lambda p: p["shop"].update(slott="x"), lambda p: p["shop"]["delta"].update(roott="x")],
                         ids=["top-level", "nested"])  # fmt: skip
def test_misspelled_keys_fail_the_schema_at_their_file_and_line(
    pg: PgDatabase, project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: object
) -> None:
    """Each pipeline is typed in the component's schema: a misspelled key fails the YAML stage, named with its path."""
    monkeypatch.setenv("PGCDC_TEST_SHOP_DSN", pg.dsn)
    pipelines = {"shop": pipeline("PGCDC_TEST_SHOP_DSN", "shop_slot", ["public.orders"], tmp_path / "lake")}
    edit(pipelines)  # type: ignore[operator]
    defs_file = write_pipelines(defs_folder(project), pipelines)
    misspelled = "slott" if "slott" in pipelines["shop"] else "delta.roott"
    # Dagster places the error at the 'pipelines' key (the field may also be a template) and names the key's path.
    line = defs_file.read_text().splitlines().index("  pipelines:") + 1

    with pytest.raises(Exception) as raised:
        load(project)

    messages, error = [], raised.value
    while error is not None:
        messages.append(str(error))
        error = error.__cause__ or error.__context__
    message = "\n".join(messages)
    assert f"pipelines.dict[str,PgcdcConfigKeys].shop.{misspelled} at {defs_file}:{line}" in message, message
    assert "Extra inputs are not permitted" in message
    assert not (tmp_path / "lake").exists()
    assert pg.execute("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()") == [(0,)]


def test_a_pipeline_takes_per_column_choices(tmp_path: Path) -> None:
    """``columns`` is a key of a pipeline in defs.yaml (the schema ``dg`` checks) and reads as a ``PGCDC_CONFIG`` file's."""
    raw = {
        "postgres": {"dsn": "postgresql://u@h/db"},
        "publication": "pub",
        "columns": {'public.t."Duration"': {"rename": "duration_2"}, "public.t.d": "text", "public.t.x": "exclude"},
    }
    PipelineKeys.model_validate(raw)
    config = validate_pipeline("shop", raw, raw, tmp_path / "defs.yaml")
    assert config.column_overrides.for_table(TableName("public", "t")) == {
        "Duration": ColumnChoice(rename="duration_2"),
        "d": ColumnChoice(as_text=True),
        "x": ColumnChoice(exclude=True),
    }


def test_scaffolded_project_validates(tmp_path: Path) -> None:
    """``dg scaffold defs`` writes a two-pipeline defs.yaml that Dagster validates (tables listed: no server needed)."""
    project = tmp_path / "project"
    make_project(project)
    env = {
        "PATH": f"{BIN}:/usr/bin:/bin",
        "PYTHONPATH": f"{REPO}:{project}",
        "HOME": str(tmp_path),
        "DAGSTER_HOME": str(tmp_path),
        "PGCDC_SHOP_DSN": f"postgresql://pgcdc:{PASSWORD}@db.invalid/shop",
        "PGCDC_BILLING_DSN": "postgresql://db.invalid/billing",
    }

    def cli(*args: str) -> str:
        done = subprocess.run(args, cwd=project, env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return done.stdout + done.stderr

    cli(str(BIN / "dg"), "scaffold", "defs", COMPONENT_TYPE, "pipelines")
    scaffolded = next(project.glob("*/defs/pipelines/defs.yaml"))
    assert set(yaml.safe_load(scaffolded.read_text())["attributes"]["pipelines"]) == {"shop", "billing"}
    # dg check defs checks the YAML against the component's schema, then runs `dagster definitions validate`'s
    # own implementation (dagster._cli.definitions.definitions_validate_command_impl): one CLI start for both.
    checked = cli(str(BIN / "dg"), "check", "defs")
    assert "All component YAML validated successfully" in checked
    assert "All definitions loaded successfully" in checked
    assert PASSWORD not in checked
    # A misspelled key fails the YAML stage, at its line, before any definitions are built.
    text = scaffolded.read_text()
    scaffolded.write_text(
        text.replace("      publication: pgcdc_billing\n", "      publication: pgcdc_billing\n      slott: x\n")
    )
    line = scaffolded.read_text().splitlines().index("  pipelines:") + 1
    done = subprocess.run([str(BIN / "dg"), "check", "defs"], cwd=project, env=env, capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert f"defs.yaml:{line} - pgcdc_assets.component.PgcdcComponent attributes.pipelines" in output, output
    assert "'slott': 'x'" in output and "is not valid under any of the given schemas" in output, output
    assert "All component YAML validated successfully" not in output
