"""A sensor that re-snapshots quarantined tables whose cause is fixed (off by default, like every pgcdc sensor).

A quarantined table (``resources/runs/quarantine.py``) comes back only through a re-snapshot. For
some faults the re-snapshot is the whole fix: a schema change Delta could not follow in place
(the snapshot takes the new schema), and a write the engine refused after one. For a value Delta
cannot hold, the cause is fixed in PostgreSQL or by replicating the column as text, and no cheap
read tells when that happened (finding the value again is a scan of the table), so the sensor
leaves those to the operator, whose re-snapshot is the sign the cause is fixed. Each quarantine is
requested once (the cursor remembers it), so a re-snapshot that fails again does not loop.

It reads one LIST of the lake's quarantine records per tick; the snapshot run it requests is the
table's snapshot asset, in the snapshot job, as a user's click would be.
"""

# No `from __future__ import annotations`: Dagster reads the decorated functions' annotations at runtime.

import json
from collections.abc import Mapping

from dagster import (
    AssetKey,
    DefaultSensorStatus,
    RunRequest,
    sensor,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
)

from pgcdc_assets.dagster_resources import PostgresResource
from resources.names import PipelineNames, QUARANTINE_SENSOR, SNAPSHOT_JOB
from resources.postgres.catalog import TableName

#: The faults a re-snapshot fixes by itself (``Quarantine.fault``).
FIXED_BY_RESNAPSHOT = ("schema", "engine")


def build_quarantine_sensor(
    snapshot_keys: Mapping[TableName, AssetKey], names: PipelineNames, minimum_interval_seconds: int = 300
) -> SensorDefinition:
    """Request the snapshot of each quarantined table a re-snapshot fixes, once per quarantine."""

    @sensor(
        name=names.scoped(QUARANTINE_SENSOR),
        job_name=names.scoped(SNAPSHOT_JOB),
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=DefaultSensorStatus.STOPPED,
        required_resource_keys={names.postgres_key},
        description="Re-snapshots quarantined tables whose fault a re-snapshot fixes (a schema change, an engine refusal).",
    )
    def pgcdc_quarantine_sensor(context: SensorEvaluationContext, **_invoked_with: object) -> SensorResult | SkipReason:
        from resources.delta.lake_storage import open_lake
        from resources.runs.quarantine import read_quarantines

        postgres: PostgresResource = getattr(context.resources, names.postgres_key)
        config = postgres.config
        quarantines = read_quarantines(config, open_lake(config.delta.root, config.delta.storage))
        requested: dict[str, str] = json.loads(context.cursor) if context.cursor else {}
        due = {
            name: quarantine
            for name, quarantine in quarantines.items()
            if quarantine.fault in FIXED_BY_RESNAPSHOT
            and requested.get(name) != quarantine.since
            and config.table_at(name, quarantine.path) in snapshot_keys
        }
        left = sorted(set(quarantines) - set(due))
        if not due:
            why = (
                f"{len(left)} quarantined table(s) wait for their cause to be fixed: {', '.join(left)}" if left else ""
            )
            return SkipReason(why or "no table is quarantined")
        requested = {name: since for name, since in requested.items() if name in quarantines}
        requested.update({name: quarantine.since for name, quarantine in due.items()})
        return SensorResult(
            run_requests=[
                RunRequest(
                    asset_selection=[snapshot_keys[config.table_at(name, due[name].path)] for name in sorted(due)],
                    tags={"pgcdc/trigger": "quarantine"},
                )
            ],
            cursor=json.dumps(requested, sort_keys=True),
        )

    return pgcdc_quarantine_sensor
