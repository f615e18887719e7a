"""The Dagster tests' shop: its tables and configuration file, jobs and sensors run in process,
the CLI, and the rows on both sides to compare."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import yaml
from dagster import AssetKey, build_sensor_context, DagsterInstance, Definitions, ExecuteInProcessResult

from pgcdc_assets.dagster_resources import PostgresResource, SparkDeltaResource
from resources.config import CONFIG_ENV_VAR
from resources.delta.reads import delta_rs_rows
from resources.lsn import LSN
from resources.testing.verify import assert_buckets_right
from tests.support.postgres import PgDatabase

REPO = Path(__file__).resolve().parents[2]

DAGSTER = str(Path(sys.executable).with_name("dagster"))

ORDERS_KEY = AssetKey(["pgcdc", "snapshot", "public", "orders"])

NOTES_KEY = AssetKey(["pgcdc", "snapshot", "public", "notes"])


def write_config(tmp_path: Path, pg: PgDatabase, **overrides: object) -> Path:
    """A pgcdc configuration file in ``tmp_path``; Delta goes to ``tmp_path/lake``."""
    settings: dict[str, object] = {
        "postgres": {"dsn": pg.dsn},
        "publication": "pgcdc_pub",
        "slot": "pgcdc_slot",
        "delta": {"root": str(tmp_path / "lake")},
        "snapshot": {"parallel_tables": 2},
        **overrides,
    }
    path = tmp_path / "pgcdc.yaml"
    path.write_text(yaml.safe_dump(settings), encoding="utf-8")
    return path


def create_shop(pg: PgDatabase) -> None:
    """Two published tables: a keyed one with a spread of types, and a keyless one."""
    pg.execute(
        "CREATE TABLE orders (id bigint PRIMARY KEY, customer text, amount numeric(10,2), tags int[], placed timestamp)"
    )
    pg.execute("CREATE TABLE notes (body text)")
    pg.execute(
        "INSERT INTO orders SELECT g, 'c' || g, g * 1.25, ARRAY[g, NULL], timestamp '2024-01-01' + g * interval '1 s'"
        " FROM generate_series(1, 500) g"
    )
    pg.execute("INSERT INTO notes VALUES ('first'), (NULL), ('')")
    pg.execute("CREATE PUBLICATION pgcdc_pub FOR TABLE orders, notes")


def delta_rows(root: Path, table: str) -> list[tuple]:
    """A Delta table's rows (without pgcdc's LSN and bucket columns, after checking the buckets) through
    delta-rs, in sorted_rows order."""
    assert_buckets_right(str(root / "public" / table))
    data = delta_rs_rows(str(root / "public" / table))
    columns = [name for name in data.column_names if name not in ("_pgcdc_lsn", "_pgcdc_bucket")]
    return sorted_rows([tuple(record[name] for name in columns) for record in data.select(columns).to_pylist()])


def pg_orders(pg: PgDatabase) -> list[tuple]:
    return sorted_rows(pg.execute("SELECT id, customer, amount, tags, placed FROM orders"))


def pg_notes(pg: PgDatabase) -> list[tuple]:
    return sorted_rows(pg.execute("SELECT body FROM notes"))


def sorted_rows(rows: list[tuple]) -> list[tuple]:
    """Rows in one order whatever their source, so two sources compare with ==."""
    return sorted(rows, key=repr)


def materializations(result: ExecuteInProcessResult) -> dict[AssetKey, dict[str, object]]:
    """Each materialized asset's metadata values."""
    found = (event.event_specific_data.materialization for event in result.get_asset_materialization_events())
    return {m.asset_key: {key: value.value for key, value in m.metadata.items()} for m in found}


def run_cli(tmp_path: Path, config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The ``dagster`` CLI in a subprocess with PGCDC_CONFIG and a DAGSTER_HOME of its own."""
    home = tmp_path / "dagster_home"
    home.mkdir(exist_ok=True)
    env = {**os.environ, CONFIG_ENV_VAR: str(config), "DAGSTER_HOME": str(home)}
    return subprocess.run([DAGSTER, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)


def invalidate_slot(pg: PgDatabase, slot: str) -> None:
    """Make PostgreSQL invalidate the slot the way production does: WAL past max_slot_wal_keep_size, then a checkpoint."""
    with psycopg.connect(pg.server.dsn(), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
        conn.execute("SELECT pg_reload_conf()")
        try:
            pg.execute("CREATE TABLE filler (x text)")  # unpublished: only makes WAL
            for _ in range(4):
                pg.execute("INSERT INTO filler SELECT repeat('x', 100) FROM generate_series(1, 5000)")
                pg.execute("SELECT pg_switch_wal()")
                pg.execute("CHECKPOINT")
            (status,) = pg.execute(f"SELECT wal_status FROM pg_replication_slots WHERE slot_name = '{slot}'")
            assert status[0] == "lost"
        finally:
            conn.execute("ALTER SYSTEM RESET max_slot_wal_keep_size")
            conn.execute("SELECT pg_reload_conf()")


def run_job(defs: Definitions, instance: DagsterInstance, job: str, **kwargs: object) -> ExecuteInProcessResult:
    result = defs.resolve_job_def(job).execute_in_process(instance=instance, **kwargs)
    assert result.success
    return result


def check_outcomes(result: ExecuteInProcessResult) -> dict[tuple[AssetKey, str], bool]:
    return {
        (evaluation.asset_key, evaluation.check_name): evaluation.passed
        for evaluation in result.get_asset_check_evaluations()
    }


def slot_position(pg: PgDatabase) -> LSN:
    ((confirmed,),) = pg.execute(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'pgcdc_slot'"
    )
    return LSN.parse(confirmed)


def sensor_resources(config: Path) -> dict[str, object]:
    return {"postgres": PostgresResource(config_file=str(config)), "spark": SparkDeltaResource()}


def evaluate(defs: Definitions, name: str, instance: DagsterInstance, config: Path) -> object:
    sensor = defs.resolve_sensor_def(name)
    with build_sensor_context(instance=instance, resources=sensor_resources(config), sensor_name=name) as context:
        return sensor(context)
