"""Names of pgcdc's Dagster jobs, schedule, sensors, checks and pools: plain strings, no Dagster import.

Both pgcdc_assets/ and sensors/ define or target these, and the engines' error messages name
the jobs in their fixes, so they live below all three.
"""

from __future__ import annotations

from dataclasses import dataclass


SNAPSHOT_JOB = "pgcdc_snapshot"
RESNAPSHOT_JOB = "pgcdc_resnapshot"
INCREMENTAL_JOB = "pgcdc_incremental"
INCREMENTAL_SCHEDULE = "pgcdc_incremental_schedule"
RECONCILE_JOB = "pgcdc_reconcile"
MAINTENANCE_JOB = "pgcdc_maintenance"
MAINTENANCE_SCHEDULE = "pgcdc_maintenance_schedule"


def slot_pool(slot: str) -> str:
    """The Dagster concurrency pool of every step that drains ``slot``, and of the maintenance
    of its tables (compaction must not race a drain's MERGE on the same files).

    With a limit of 1 on it (``dagster instance concurrency set pgcdc_slot_<slot> 1``, or
    ``concurrency: pools: default_limit: 1`` in dagster.yaml) a second drain waits for the
    first instead of failing on the busy slot.
    """
    return f"pgcdc_slot_{slot}"


LAG_SENSOR = "pgcdc_slot_lag_sensor"
NEW_TABLES_SENSOR = "pgcdc_new_tables_sensor"
SLOT_HEALTH_SENSOR = "pgcdc_slot_health_sensor"


SCHEMA_CHECK = "schema_matches_postgres"
SLOT_LAG_CHECK = "slot_lag_within_bound"
# Evaluated by the pgcdc_reconcile job, at one fixed LSN:
ROW_COUNT_CHECK = "row_count_matches_postgres"
ROWS_MATCH_CHECK = "rows_match_postgres"


@dataclass(frozen=True, slots=True)
class PipelineNames:
    """The Dagster names of one pipeline's definitions, so several pipelines share a code location.

    ``pipeline`` None is the single-file (``PGCDC_CONFIG``) path and keeps every name as it
    always was (``pgcdc_snapshot``, resource keys ``postgres``/``spark``, op ``drain_slot``),
    so existing run configs, schedules' histories and asset keys stay valid. A named pipeline
    puts its name after the ``pgcdc_`` prefix of each: ``pgcdc_shop_snapshot``,
    ``pgcdc_shop_postgres``, ``pgcdc_shop_drain_slot``. Pools stay per slot (``slot_pool``):
    two pipelines drain at the same time exactly when their slots differ.
    """

    pipeline: str | None = None

    def scoped(self, name: str) -> str:
        """``name`` (a ``pgcdc_*`` job, schedule or sensor name, or a bare op/resource name) for this pipeline."""
        if self.pipeline is None:
            return name
        bare = name.removeprefix("pgcdc_")
        return f"pgcdc_{self.pipeline}_{bare}"

    @property
    def postgres_key(self) -> str:
        return self.scoped("postgres")

    @property
    def spark_key(self) -> str:
        return self.scoped("spark")
