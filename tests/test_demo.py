"""``make demo`` end to end: embedded PostgreSQL 18, two pipelines in one code location, runs under load, all verified."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from dagster import DagsterInstance

from pgcdc_assets.demo import inventory, shop
from pgcdc_assets.demo.project import write_dagster_yaml
from resources.testing.verify import assert_delta_equals_postgres

REPO_ROOT = Path(__file__).resolve().parents[1]
SHOP_VERIFIED = "verified: Delta == PostgreSQL for 5 shop tables"
INVENTORY_VERIFIED = "verified: Delta == PostgreSQL for 2 inventory tables"


@pytest.fixture
def demo_dir() -> Iterator[Path]:
    """The demo's directory, outside pytest's tmp root.

    As root, the demo's PostgreSQL runs as an unprivileged user, which must traverse every parent of
    its data directory; ``LocalPostgres.init`` grants that, but every pytest session that starts on
    the machine sets its base directory ``pytest-of-<user>`` back to 0700 (``_pytest/tmpdir.py``), so a server
    starting under ``tmp_path`` while another pytest run starts cannot open its data directory,
    postgresql.conf or pg_hba.conf (Permission denied). A ``tempfile`` directory is left alone, as
    the ``tempfile.mkdtemp`` ones of ``start_local_postgres`` (every other test's servers) are.
    """
    with tempfile.TemporaryDirectory(prefix="pgcdc-demo-test-") as directory:
        yield Path(directory) / "demo"


@pytest.mark.slow  # PostgreSQL and Sail in the demo's own process
@pytest.mark.timeout(300)
def test_demo_runs_and_verifies_every_run(demo_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pgcdc_assets.demo", "--no-dagster", "--runs", "2", "--keep", "--dir", str(demo_dir)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=290,
    )
    out = done.stdout
    assert done.returncode == 0, f"exit {done.returncode}\n{out}\n{done.stderr}"
    # Success is quiet: a first user reads an ERROR or a traceback as a broken install.
    alarming = [line for line in (out + done.stderr).splitlines() if "ERROR" in line or "Traceback" in line]
    assert alarming == [], "\n".join(alarming)
    # pgcdc changes printed decoded JSON lines of the scratch slot, which was dropped again.
    for kind in ("begin", "insert", "update", "delete", "commit"):
        assert f'  {{"type": "{kind}", "lsn": ' in out, kind
    commit = next(line for line in out.splitlines() if line.startswith('  {"type": "commit"'))
    assert json.loads(commit)["end_lsn"]
    assert "scratch slot pgcdc_demo_peek dropped" in out
    # Each pipeline's snapshot, both runs under load and the final run were each verified value for value.
    assert out.count(SHOP_VERIFIED) == 4 and out.count(INVENTORY_VERIFIED) == 4, out
    for pipeline in ("shop", "inventory"):
        assert f"{pipeline} run 1/2:" in out and f"{pipeline} run 2/2:" in out and f"{pipeline} final run:" in out
    assert out.count("confirmed_flush_lsn ") >= 6
    # The slot asset records every drain; its lag check once per pipeline; no schema change, so no schema check.
    assert out.count("slot asset confirmed_flush_lsn ") >= 6
    assert "checks 1/1 passed" in out.split("shop final run:")[1]
    assert "checks 1/1 passed" in out.split("inventory final run:")[1]
    # Each pipeline's reconcile job, exact under load: two checks per table.
    assert "shop reconciled at LSN " in out and "inventory reconciled at LSN " in out
    assert "while the load wrote on: checks 10/10 passed" in out.split("shop reconciled")[1].splitlines()[0]
    assert "while the load wrote on: checks 4/4 passed" in out.split("inventory reconciled")[1].splitlines()[0]
    assert "all verifications passed" in out
    # shop.orders keeps SCD type 2 versions: read back as of its snapshot, it has the snapshot's rows.
    assert "$ pgcdc as-of --table shop.orders --lsn " in out and "rows, as many as the snapshot copied at " in out
    assert "dagster dev -m pgcdc_demo_project.definitions" in out  # --no-dagster prints the command
    # The project and Dagster history stay; the PostgreSQL server and the lake are gone without --keep.
    defs_file = demo_dir / "project" / "pgcdc_demo_project" / "defs" / "pipelines" / "defs.yaml"
    defs_yaml = yaml.safe_load(defs_file.read_text())
    assert defs_yaml["type"] == "pgcdc_assets.component.PgcdcComponent"
    pipelines = defs_yaml["attributes"]["pipelines"]
    assert set(pipelines) == {"shop", "inventory"}
    assert pipelines["inventory"]["postgres"]["dsn"] == "{{ env('PGCDC_DEMO_INVENTORY_DSN') }}"
    assert "default_limit: 1" in (demo_dir / "dagster_home" / "dagster.yaml").read_text()
    # --keep left PostgreSQL running and the lake: the test's own oracle, not the demo's word, says
    # every Delta table equals its PostgreSQL table after the final run (the load has stopped).
    kept = out.split("--keep: PostgreSQL still running at ", 1)[1].split(";", 1)[0]
    stop = shlex.split(out.split("stop it with: ", 1)[1].splitlines()[0])
    try:
        for pipeline, module, database in (("shop", shop, "shop"), ("inventory", inventory, inventory.DATABASE)):
            dsn = kept.rsplit("/", 1)[0] + f"/{database}"
            for table in module.TABLES:
                path = str(demo_dir / "lake" / pipeline / module.SCHEMA / table)
                rows = assert_delta_equals_postgres(
                    dsn, f"{module.SCHEMA}.{table}", path, key=module.KEYS.get(table, ())
                )
                assert rows > 0, (pipeline, table)
    finally:
        subprocess.run(stop, check=True, capture_output=True, timeout=60)


def test_the_demo_instance_limits_drains_and_shows_no_onboarding_dialog(tmp_path: Path) -> None:
    """Dagster's onboarding dialog ("nux") would open over the asset page the demo sends its user to."""
    write_dagster_yaml(tmp_path)
    with DagsterInstance.from_config(str(tmp_path)) as instance:
        assert instance.nux_enabled is False
        assert instance.telemetry_enabled is False
        assert instance.get_concurrency_config().pool_config.default_pool_limit == 1
