"""``make demo`` end to end: embedded PostgreSQL 18, Dagster runs under load, every run verified."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
VERIFIED = "verified: Delta == PostgreSQL for 5 tables"


@pytest.mark.timeout(180)
def test_demo_runs_and_verifies_every_run(tmp_path: Path) -> None:
    directory = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "pgcdc_assets.demo", "--no-dagster", "--runs", "2", "--dir", str(directory)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    out = done.stdout
    assert done.returncode == 0, f"exit {done.returncode}\n{out}\n{done.stderr}"
    # pgcdc changes printed decoded JSON lines of the scratch slot, which was dropped again.
    for kind in ("begin", "insert", "update", "delete", "commit"):
        assert f'  {{"type": "{kind}", "lsn": ' in out, kind
    commit = next(line for line in out.splitlines() if line.startswith('  {"type": "commit"'))
    assert json.loads(commit)["end_lsn"]
    assert "scratch slot pgcdc_demo_peek dropped" in out
    # The snapshot, both runs under load and the final run were each verified value for value.
    assert out.count(VERIFIED) == 4, out
    assert "run 1/2:" in out and "run 2/2:" in out and "final run:" in out
    assert out.count("confirmed_flush_lsn ") >= 3
    assert "checks 5/5 passed" in out.split("final run:")[1]  # slot lag; no schema change, so no schema check
    assert "while the load wrote on: checks 10/10 passed" in out  # pgcdc_reconcile, exact under load
    assert "all verifications passed" in out
    assert "dagster dev -m pgcdc_assets.definitions" in out  # --no-dagster prints the command
    # Config and Dagster history stay; the PostgreSQL server and the lake are gone without --keep.
    assert (directory / "pgcdc.yaml").exists()
    assert "default_limit: 1" in (directory / "dagster_home" / "dagster.yaml").read_text()
    assert not (directory / "postgres").exists() and not (directory / "lake").exists()
