"""Sensors that watch the replication slot and the publication without ever draining the slot.

They only read ``pg_replication_slots`` and the catalog (plus, for new tables, the Delta
snapshot marker), so a sensor tick can never move the slot or compete with a drain.

Each sensor names its resources by the pipeline's keys (``PipelineNames.postgres_key``) and
reads them from ``context.resources``. Calling a sensor directly (``sensor(context)``, as
tests do) also passes those resources as keyword arguments, which ``**_invoked_with`` absorbs;
the daemon passes none.
"""

# No `from __future__ import annotations`: Dagster reads the decorated functions' annotations at runtime.

from collections.abc import Mapping, Sequence

from dagster import (
    AssetKey,
    DagsterRunStatus,
    DefaultSensorStatus,
    RunRequest,
    RunsFilter,
    sensor,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
)

from pgcdc_assets.dagster_resources import PostgresResource
from pgcdc_assets.translator import schedule_interval
from resources.errors import SlotError
from resources.names import (
    INCREMENTAL_JOB,
    LAG_SENSOR,
    NEW_TABLES_SENSOR,
    PipelineNames,
    RESNAPSHOT_JOB,
    SLOT_HEALTH_SENSOR,
    SNAPSHOT_JOB,
)
from resources.postgres.catalog import TableName
from resources.postgres.failover import failover_problems
from resources.postgres.preflight import idle_timeout_risk
from resources.postgres.slots import invalidated_slot


def _pending_runs(context: SensorEvaluationContext, job_names: Sequence[str]) -> list[str]:
    """Ids of runs of these jobs that are queued or in flight."""
    run_ids: list[str] = []
    for job_name in job_names:
        runs = context.instance.get_runs(RunsFilter(job_name=job_name, statuses=PENDING_RUN_STATUSES))
        run_ids.extend(run.run_id for run in runs)
    return run_ids


def build_slot_lag_sensor(names: PipelineNames, minimum_interval_seconds: int = 30) -> SensorDefinition:
    """Request a drain when the slot has more unconfirmed WAL than ``sensors.lag_bytes``.

    Between schedule ticks a burst of writes would otherwise pile up WAL on the source;
    this starts the drain early. It skips while a drain is queued or running (or the slot
    is held by any consumer), so bursts never stack runs on one slot.
    """
    incremental_job, snapshot_job = names.scoped(INCREMENTAL_JOB), names.scoped(SNAPSHOT_JOB)

    @sensor(
        name=names.scoped(LAG_SENSOR),
        job_name=incremental_job,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=DefaultSensorStatus.STOPPED,
        required_resource_keys={names.postgres_key},
        description=f"Requests a {incremental_job} run when the slot's lag exceeds sensors.lag_bytes.",
    )
    def pgcdc_slot_lag_sensor(context: SensorEvaluationContext, **_invoked_with: object) -> RunRequest | SkipReason:
        postgres: PostgresResource = getattr(context.resources, names.postgres_key)
        config = postgres.config
        state = postgres.read_slot()
        if state is None:
            return SkipReason(f'replication slot "{config.slot}" does not exist: run the {snapshot_job} job')
        lag = postgres.slot_lag_bytes(state)
        threshold = config.sensors.lag_bytes
        if lag <= threshold:
            return SkipReason(f'slot "{config.slot}" lags {lag} bytes, at or below sensors.lag_bytes={threshold}')
        pending = _pending_runs(context, [incremental_job])
        if pending:
            return SkipReason(f"slot lags {lag} bytes but a {incremental_job} run is already pending: {pending[0]}")
        if state.active:
            return SkipReason(f"slot lags {lag} bytes but is in use by PID {state.active_pid}")
        return RunRequest(tags={"pgcdc/trigger": "slot_lag", "pgcdc/slot_lag_bytes": str(lag)})

    return pgcdc_slot_lag_sensor


def build_new_tables_sensor(
    snapshot_keys: Mapping[TableName, AssetKey],
    names: PipelineNames,
    minimum_interval_seconds: int = 300,
) -> SensorDefinition:
    """Request snapshots for defined tables that have none yet; name the ones that need a reload.

    Assets are fixed when the code location loads, so a table added to the publication
    afterwards has no asset until the location is reloaded; the sensor can only report it.
    Once defined (after the reload), a table with no snapshot in Dagster's records and no
    snapshot marker in its Delta log gets a snapshot run for just that table. The log is read
    through the lake's storage client (``resources/delta/table_log.py``), never through an engine,
    and only when Dagster has no record of a table's snapshot, so quiet ticks stay cheap.
    """

    @sensor(
        name=names.scoped(NEW_TABLES_SENSOR),
        job_name=names.scoped(SNAPSHOT_JOB),
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=DefaultSensorStatus.STOPPED,
        required_resource_keys={names.postgres_key},
        description="Snapshots published tables that have no Delta snapshot; reports tables needing a reload.",
    )
    def pgcdc_new_tables_sensor(context: SensorEvaluationContext, **_invoked_with: object) -> SensorResult | SkipReason:
        from resources.delta.lake_storage import open_lake
        from resources.delta.table_log import read_table_log

        lake = None
        postgres: PostgresResource = getattr(context.resources, names.postgres_key)

        config = postgres.config
        published = postgres.publication_tables()
        undefined = [table for table in published if table not in snapshot_keys]
        reload_note = (
            f"{len(undefined)} published table(s) have no asset, reload the code location to add them: "
            + ", ".join(table.written for table in undefined)
            if undefined
            else ""
        )
        unrecorded = [
            table
            for table in published
            if table in snapshot_keys
            and context.instance.get_latest_materialization_event(snapshot_keys[table]) is None
        ]
        if unrecorded:
            lake = open_lake(config.delta.root, config.delta.storage)
        missing = [
            table
            for table in unrecorded
            if read_table_log(config.table_path(table.schema, table.name), None, lake).snapshot_lsn is None
        ]
        if not missing:
            return SkipReason(reload_note or "every published table has a snapshot")
        pending = _pending_runs(context, [names.scoped(SNAPSHOT_JOB), names.scoped(RESNAPSHOT_JOB)])
        if pending:
            return SkipReason(f"{len(missing)} table(s) need a snapshot but snapshot run {pending[0]} is pending")
        if reload_note:
            context.log.warning(reload_note)
        return SensorResult(
            run_requests=[
                RunRequest(
                    asset_selection=[snapshot_keys[table] for table in missing],
                    tags={"pgcdc/trigger": "new_tables"},
                )
            ]
        )

    return pgcdc_new_tables_sensor


def build_slot_health_sensor(names: PipelineNames, minimum_interval_seconds: int = 60) -> SensorDefinition:
    """Fail the tick, with the one-line cause and fix, when the slot is missing, lost, or at risk.

    At risk: ``wal_status`` unreserved (the next checkpoint can invalidate it), an
    ``idle_replication_slot_timeout`` (PostgreSQL 18) the schedule's gaps can outlast, or,
    with ``slot_failover``, a slot that would not survive a failover yet
    (``resources.postgres.failover``). A failed tick is red on the sensor's page and in the
    overview, where a skipped tick's message is easy to miss; nothing is requested, because
    recovering a lost slot means re-snapshotting every table, which an operator should start
    (pgcdc_resnapshot).
    """
    snapshot_job, resnapshot_job = names.scoped(SNAPSHOT_JOB), names.scoped(RESNAPSHOT_JOB)
    incremental_job = names.scoped(INCREMENTAL_JOB)

    @sensor(
        name=names.scoped(SLOT_HEALTH_SENSOR),
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=DefaultSensorStatus.STOPPED,
        required_resource_keys={names.postgres_key},
        description="Fails with the fix when the replication slot is missing, lost (wal_status='lost') or at risk.",
    )
    def pgcdc_slot_health_sensor(context: SensorEvaluationContext, **_invoked_with: object) -> SkipReason:
        postgres: PostgresResource = getattr(context.resources, names.postgres_key)
        config = postgres.config
        state = postgres.read_slot()
        if state is None:
            raise SlotError(
                f'replication slot "{config.slot}" does not exist on {postgres.masked_dsn}',
                f"run the {snapshot_job} job (it creates the slot and snapshots every table), or fix 'slot'",
            )
        if state.invalidated:
            raise invalidated_slot(
                state,
                f"run the {resnapshot_job} job with no table list: it recreates the slot and re-snapshots every table",
            )
        if state.wal_status == "unreserved":
            raise SlotError(
                f'replication slot "{config.slot}" is unreserved (safe_wal_size {state.safe_wal_size} bytes):'
                " the next checkpoint can invalidate it",
                f"run the {incremental_job} job now, then raise max_slot_wal_keep_size or drain more often",
            )
        with postgres.connect() as conn:
            idle = idle_timeout_risk(conn, config.slot, schedule_interval(config.schedule.cron))
            problems = failover_problems(conn, state, config.postgres.standby_dsn) if config.slot_failover else []
        if idle is not None:
            raise idle
        if problems:
            for later in problems[1:]:
                context.log.warning(str(later))
            raise problems[0]
        lag = postgres.slot_lag_bytes(state)
        return SkipReason(f'slot "{config.slot}" is healthy: wal_status {state.wal_status}, lag {lag} bytes')

    return pgcdc_slot_health_sensor


#: Runs that will drain (or are draining) the slot: queued ones count, since they are about to.
PENDING_RUN_STATUSES = [
    DagsterRunStatus.QUEUED,
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
    DagsterRunStatus.CANCELING,
]
