"""``make demo`` end to end: embedded PostgreSQL 18, two pipelines in one code location, runs under load, all verified."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
SHOP_VERIFIED = "verified: Delta == PostgreSQL for 5 shop tables"
INVENTORY_VERIFIED = "verified: Delta == PostgreSQL for 2 inventory tables"


@pytest.mark.timeout(300)
def test_demo_runs_and_verifies_every_run(tmp_path: Path) -> None:
    directory = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "pgcdc_assets.demo", "--no-dagster", "--runs", "2", "--dir", str(directory)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=290,
    )
    out = done.stdout
    assert done.returncode == 0, f"exit {done.returncode}\n{out}\n{done.stderr}"
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
    assert "checks 15/15 passed" in out.split("shop final run:")[1]
    assert "checks 6/6 passed" in out.split("inventory final run:")[1]
    assert "all verifications passed" in out
    assert "dagster dev -m pgcdc_demo_project.definitions" in out  # --no-dagster prints the command
    # The project and Dagster history stay; the PostgreSQL server and the lake are gone without --keep.
    defs_file = directory / "project" / "pgcdc_demo_project" / "defs" / "pipelines" / "defs.yaml"
    defs_yaml = yaml.safe_load(defs_file.read_text())
    assert defs_yaml["type"] == "pgcdc_assets.component.PgcdcComponent"
    pipelines = defs_yaml["attributes"]["pipelines"]
    assert set(pipelines) == {"shop", "inventory"}
    assert pipelines["inventory"]["postgres"]["dsn"] == "{{ env('PGCDC_DEMO_INVENTORY_DSN') }}"
    assert "default_limit: 1" in (directory / "dagster_home" / "dagster.yaml").read_text()
    assert not (directory / "postgres").exists() and not (directory / "lake").exists()
