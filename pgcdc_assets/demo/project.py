"""The demo's pipelines and the dg project that serves them: one pgcdc Component listing both, and
a ``dagster.yaml`` with one drain per slot."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pgcdc_assets.demo import inventory, shop
from pgcdc_assets.demo.inventory import InventoryLoad
from pgcdc_assets.demo.load import LoadGenerator
from resources.names import PipelineNames

#: The table whose past the demo keeps (an SCD type 2 table, docs/history.md) and reads back as of its snapshot.
HISTORY_TABLE = f"{shop.SCHEMA}.orders"

#: The demo project's package; ``dagster dev -m`` loads its definitions module.
PROJECT_PACKAGE = "pgcdc_demo_project"


@dataclass(frozen=True)
class DemoPipeline:
    """One pipeline of the demo's code location: its database on the shared server and what to verify."""

    name: str
    database: str
    schema: str
    tables: list[str]
    keys: dict[str, list[str]]
    publication: str
    slot: str
    create: Callable[[str], dict[str, int]]
    load: type[LoadGenerator]
    dsn: str
    lake: Path

    @property
    def env_var(self) -> str:
        """The variable defs.yaml reads the DSN from (``{{ env('...') }}``)."""
        return f"PGCDC_DEMO_{self.name.upper()}_DSN"

    def job(self, base: str) -> str:
        return PipelineNames(self.name).scoped(base)


def demo_pipelines(server: Any, directory: Path) -> list[DemoPipeline]:
    """The shop and the inventory pipeline, on two databases of ``server``."""
    return [
        DemoPipeline(
            "shop", "shop", shop.SCHEMA, shop.TABLES, shop.KEYS, shop.PUBLICATION, shop.SLOT, shop.create_shop,
            LoadGenerator, server.dsn("shop"), directory / "lake" / "shop",
        ),
        DemoPipeline(
            "inventory", inventory.DATABASE, inventory.SCHEMA, inventory.TABLES, inventory.KEYS,
            inventory.PUBLICATION, inventory.SLOT, inventory.create_inventory, InventoryLoad,
            server.dsn(inventory.DATABASE), directory / "lake" / "inventory",
        ),
    ]  # fmt: skip


def write_project(directory: Path, pipelines: Sequence[DemoPipeline]) -> Path:
    """A dg project whose one component lists both pipelines; returns its defs.yaml.

    DSNs come from the environment through Dagster's templating, as a deployment would keep them.
    """
    import yaml

    from pgcdc_assets.component import PgcdcComponent

    project = directory / "project"
    package = project / PROJECT_PACKAGE
    (package / "defs" / "pipelines").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "defs" / "__init__.py").write_text("")
    (package / "definitions.py").write_text(
        "from pathlib import Path\n\nimport dagster as dg\n\n\n@dg.definitions\ndef defs() -> dg.Definitions:\n"
        "    return dg.load_from_defs_folder(path_within_project=Path(__file__).parent)\n"
    )
    (project / "pyproject.toml").write_text(
        f'[project]\nname = "{PROJECT_PACKAGE}"\nversion = "0.1.0"\n\n[tool.dg]\ndirectory_type = "project"\n\n'
        f'[tool.dg.project]\nroot_module = "{PROJECT_PACKAGE}"\ncode_location_name = "{PROJECT_PACKAGE}.definitions"\n'
    )
    component = {
        "type": f"{PgcdcComponent.__module__}.{PgcdcComponent.__name__}",
        "attributes": {
            "pipelines": {
                p.name: {
                    "postgres": {"dsn": f"{{{{ env('{p.env_var}') }}}}"},
                    "publication": p.publication,
                    "slot": p.slot,
                    "tables": [f"{p.schema}.{name}" for name in p.tables],
                    "delta": {"root": str(p.lake)},
                    "snapshot": {"parallel_tables": 2},
                    "schedule": {"cron": "* * * * *"},
                    "sensors": {"lag_bytes": 1024 * 1024},
                    "checks": {"max_lag_bytes": 64 * 1024 * 1024},
                    **({"history": {"tables": {HISTORY_TABLE: "scd2"}}} if p.name == "shop" else {}),
                }
                for p in pipelines
            }
        },
    }
    path = package / "defs" / "pipelines" / "defs.yaml"
    path.write_text("# written by `make demo` (pgcdc_assets/demo/)\n" + yaml.safe_dump(component, sort_keys=False))
    return path


def write_dagster_yaml(dagster_home: Path) -> Path:
    """The demo instance: one drain per slot, no telemetry, and no onboarding dialog (Dagster's ``nux``), which
    would open over the asset page the demo points to."""
    dagster_home.mkdir(parents=True, exist_ok=True)
    path = dagster_home / "dagster.yaml"
    path.write_text(
        "# written by `make demo`: one drain per slot at a time (a drain step's pool is pgcdc_slot_<slot>)\n"
        "concurrency:\n"
        "  pools:\n"
        "    default_limit: 1\n"
        "telemetry:\n"
        "  enabled: false\n"
        "nux:\n"
        "  enabled: false\n"
    )
    return path
