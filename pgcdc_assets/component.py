"""The pgcdc Dagster Component: several replication pipelines in one code location, configured in ``defs.yaml``.

Each entry of ``pipelines`` holds the keys of a ``PGCDC_CONFIG`` file: the component's schema
names them (``PipelineKeys``), so editors complete them and ``dg check defs`` refuses a misspelled
one at the YAML stage; the values are checked by the same validator as that file's. A pipeline
gets its own asset key prefix (``pgcdc/<pipeline>/...``), groups,
jobs, schedule, sensors and resource keys (``pgcdc_<pipeline>_*``); its drains run in its
slot's pool (``pgcdc_slot_<slot>``), so pipelines with different slots drain at the same
time. Scaffold one with ``dg scaffold defs pgcdc_assets.component.PgcdcComponent <path>``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

from dagster import Definitions
from dagster.components import (
    Component,
    ComponentLoadContext,
    Model,
    ResolutionContext,
    Resolvable,
    Resolver,
    scaffold_with,
    Scaffolder,
    ScaffoldRequest,
)
from dagster.components.resolved.errors import ResolutionException
from psycopg.conninfo import conninfo_to_dict
from pydantic import BaseModel

from pgcdc_assets.builder import build_pipeline_definitions
from pgcdc_assets.common import discover_tables
from pgcdc_assets.dagster_resources import PostgresResource
from pgcdc_assets.pipelines_file import load_pipeline_config, PipelineKeys, read_raw_pipelines, validate_pipeline
from pgcdc_assets.translator import PgcdcTranslator
from resources.config import PgcdcConfig
from resources.errors import ConfigurationError, PgcdcError
from resources.names import PipelineNames
from resources.postgres.catalog import TableName

DEFS_FILE = "defs.yaml"

#: What ``dg scaffold defs`` writes: two pipelines on two databases, DSNs from the environment.
SCAFFOLD_YAML = textwrap.dedent(
    """\
    type: {type_name}

    attributes:
      # One entry per replication pipeline; each takes the keys of a PGCDC_CONFIG file.
      # Asset keys pgcdc/<pipeline>/<schema>/<table> and pgcdc/<pipeline>/slot, jobs pgcdc_<pipeline>_snapshot,
      # pgcdc_<pipeline>_incremental, ..., resources pgcdc_<pipeline>_postgres/_spark.
      pipelines:
        shop:
          postgres:
            # env('X') fails the load when X is unset; never write env.X (it gives None).
            dsn: "{{{{ env('PGCDC_SHOP_DSN') }}}}"
          publication: pgcdc_shop
          create_publication: true
          slot: pgcdc_shop_slot
          tables: [public.orders, public.customers]
          delta:
            root: ./lake/shop
          schedule:
            cron: "*/5 * * * *"
        billing:
          postgres:
            dsn: "{{{{ env('PGCDC_BILLING_DSN') }}}}"
          publication: pgcdc_billing
          create_publication: true
          slot: pgcdc_billing_slot
          tables: [public.invoices]
          delta:
            root: ./lake/billing
          schedule:
            cron: "*/10 * * * *"
    """
)


class PgcdcComponentScaffolder(Scaffolder):
    """Writes a ``defs.yaml`` with two example pipelines that loads once their DSN variables are set."""

    def scaffold(self, request: ScaffoldRequest) -> None:
        request.target_path.mkdir(parents=True, exist_ok=True)
        defs_file = request.target_path / DEFS_FILE
        defs_file.write_text(SCAFFOLD_YAML.format(type_name=request.type_name), encoding="utf-8")


def _server(config: PgcdcConfig) -> tuple[str, str]:
    """(host, port) of the pipeline's server: slot names are unique per server, not per database."""
    parts = conninfo_to_dict(config.postgres.dsn)
    return str(parts.get("host") or ""), str(parts.get("port") or "")


def _check_no_collisions(
    defs_file: Path, configs: dict[str, PgcdcConfig], tables: Mapping[str, Sequence[TableName]]
) -> None:
    """Two pipelines must not consume one slot of one server, nor write one Delta table."""
    slot_owner: dict[tuple[tuple[str, str], str], str] = {}
    path_owner: dict[str, str] = {}
    for name, config in configs.items():
        owner = slot_owner.setdefault((_server(config), config.slot), name)
        if owner != name:
            raise ConfigurationError(
                f"{defs_file}: pipelines '{owner}' and '{name}' both use slot '{config.slot}' on one server",
                f"give pipeline '{name}' its own 'slot'",
            )
        for table in tables[name]:
            path = config.table_path(table.schema, table.name)
            owner = path_owner.setdefault(path, name)
            if owner != name:
                raise ConfigurationError(
                    f"{defs_file}: pipelines '{owner}' and '{name}' both write {table} to {path}",
                    f"give pipeline '{name}' its own 'delta.root'",
                )


def _render_pipelines(context: ResolutionContext, pipelines: dict[str, BaseModel]) -> dict[str, dict[str, Any]]:
    """Each pipeline's keys as written (``PipelineKeys`` checked their names), templates rendered;
    the values are checked by ``validate_pipeline`` when the definitions are built."""
    return {
        name: context.at_path(name).resolve_value(keys.model_dump(exclude_unset=True))
        for name, keys in pipelines.items()
    }


@scaffold_with(PgcdcComponentScaffolder)
class PgcdcComponent(Component, Resolvable, Model):
    """PostgreSQL tables replicated into Delta Lake by logical replication, one entry of ``pipelines`` per slot.

    Subclass it and override ``get_translator`` to change asset keys, groups, tags, owners or
    descriptions of one pipeline's tables.
    """

    pipelines: Annotated[
        dict[str, dict[str, Any]],
        Resolver(
            _render_pipelines,
            model_field_type=dict[str, PipelineKeys],
            description="pipeline name -> the keys of a pgcdc configuration file (postgres, publication, slot, tables,"
            " delta, spark, snapshot, schedule, sensors, checks, maintenance); secrets as {{ env('VAR') }}",
        ),
    ]

    def get_translator(self, pipeline: str) -> PgcdcTranslator:
        """The translator of ``pipeline``'s assets; the default puts them under ``pgcdc/<pipeline>``."""
        return PgcdcTranslator()

    def build_defs(self, context: ComponentLoadContext) -> Definitions:
        """Every pipeline's definitions; a bad pipeline fails the load with one line naming file, pipeline, key and fix.

        The error is a ``ResolutionException`` so ``dg check defs`` and ``dagster definitions
        validate`` print it as it is.
        """
        defs_file = context.path / DEFS_FILE
        try:
            return self._build(defs_file)
        except PgcdcError as error:
            raise ResolutionException(str(error)) from None

    def _build(self, defs_file: Path) -> Definitions:
        if not self.pipelines:
            raise ConfigurationError(
                f"{defs_file}: 'pipelines' is empty", "add at least one pipeline under 'pipelines'"
            )
        raw = read_raw_pipelines(defs_file)
        configs = {
            name: validate_pipeline(name, settings, raw.get(name), defs_file)
            for name, settings in self.pipelines.items()
        }
        for name, config in configs.items():
            if load_pipeline_config(defs_file, name) != config:
                raise ConfigurationError(
                    f"{defs_file} pipeline '{name}': its templates render differently when a run re-reads the file",
                    "use only {{ env('VAR') }} templates in pipelines",
                )
        tables = {name: discover_tables(config) for name, config in configs.items()}
        _check_no_collisions(defs_file, configs, tables)
        return Definitions.merge(
            *(
                build_pipeline_definitions(
                    config,
                    PipelineNames(name),
                    PostgresResource(config_file=str(defs_file), pipeline=name),
                    self.get_translator(name),
                    tables[name],
                )
                for name, config in configs.items()
            )
        )
