"""Names of pgcdc's Dagster jobs, schedule, sensors, checks and pools: plain strings, no Dagster import.

Both pgcdc_assets/ and sensors/ define or target these, and the engines' error messages name
the jobs in their fixes, so they live below all three.
"""

from __future__ import annotations


SNAPSHOT_JOB = "pgcdc_snapshot"
RESNAPSHOT_JOB = "pgcdc_resnapshot"
INCREMENTAL_JOB = "pgcdc_incremental"
INCREMENTAL_SCHEDULE = "pgcdc_incremental_schedule"
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


ROW_COUNT_CHECK = "row_count_matches_postgres"
SCHEMA_CHECK = "schema_matches_postgres"
SLOT_LAG_CHECK = "slot_lag_within_bound"
