"""Dagster instances for tests and benchmarks: SQLite under a directory, or PostgreSQL-backed
from exactly the ``dagster.yaml`` that docs/deployment.md shows (so the documented file is the tested one)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dagster import DagsterInstance

from resources.testing.local_postgres import LocalPostgres

DEPLOYMENT_DOC = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"
#: The HTML comment right before the documented file's YAML block.
MARKER = "<!-- dagster.yaml for PostgreSQL storage -->"


def documented_dagster_yaml() -> str:
    """The YAML block following ``MARKER`` in docs/deployment.md."""
    text = DEPLOYMENT_DOC.read_text(encoding="utf-8")
    found = re.search(re.escape(MARKER) + r"\s*```yaml\n(.*?)```", text, re.DOTALL)
    if found is None:
        raise AssertionError(f"{DEPLOYMENT_DOC} has no ```yaml block after {MARKER}")
    return found.group(1)


@contextmanager
def sqlite_instance(home: Path) -> Iterator[DagsterInstance]:
    """A default instance in ``home``: what a bare ``DAGSTER_HOME`` gives (SQLite files)."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text("concurrency:\n  pools:\n    default_limit: 1\n", encoding="utf-8")
    instance = DagsterInstance.from_config(str(home))
    try:
        yield instance
    finally:
        instance.dispose()


@contextmanager
def postgres_instance(home: Path, server: LocalPostgres, database: str) -> Iterator[DagsterInstance]:
    """An instance whose storage is ``database`` on ``server``, configured by the documented dagster.yaml.

    The file's variables are set for the instance's lifetime and restored afterwards.
    """
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text(documented_dagster_yaml(), encoding="utf-8")
    variables = {
        "DAGSTER_PG_HOST": "127.0.0.1",
        "DAGSTER_PG_PORT": str(server.port),
        "DAGSTER_PG_DB": database,
        "DAGSTER_PG_USER": server.superuser,
        "DAGSTER_PG_PASSWORD": "unused-by-trust-authentication",
    }
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        instance = DagsterInstance.from_config(str(home))
        try:
            yield instance
        finally:
            instance.dispose()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
