"""Dagster resources: the PostgreSQL source and the Spark session that writes Delta.

Both are built from the pgcdc configuration file. The PostgreSQL resource keeps only the
*path* of that file (and, for a pipeline of the pgcdc Component, the pipeline's name in
that ``defs.yaml``) as Dagster config and reads the DSN from it when used: Dagster shows
resource config in its UI and in run config snapshots, and a DSN may carry a password.
Its ``repr`` shows the masked DSN.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import psycopg
from dagster import ConfigurableResource, DagsterLogManager, InitResourceContext
from dagster_pyspark import PySparkResource
from pydantic import Field, PrivateAttr
from pyspark.sql import SparkSession

from pgcdc_assets.pipelines_file import load_pipeline_config
from resources.config import DEFAULT_KEEP_ALIVE_S, load_config, PgcdcConfig
from resources.delta.lake_storage import LakeStorage, open_lake
from resources.delta.spark_destination import SparkDeltaDestination
from resources.engines.capabilities import SAIL_CAPABILITIES
from resources.engines.engine import classic_delta_config, classic_session_builder, SparkEngine
from resources.engines.lazy_session import deferred_session
from resources.engines.s3a import s3a_settings
from resources.errors import ConfigurationError, explain, mask_dsn
from resources.locations import StorageSettings
from resources.lsn import LSN
from resources.postgres.catalog import TableName
from resources.postgres.connections import connect
from resources.postgres.publication import published_tables
from resources.postgres.slots import read_slot, SlotState, wal_position

SparkMode = Literal["embedded", "spark", "remote", "classic"]


class SparkDeltaResource(PySparkResource):
    """A Spark session able to read and write Delta, started on first use and stopped when the run (or step) ends.

    ``embedded`` starts a Sail Spark Connect server in a child process on a free loopback
    port, so a laptop needs no cluster or JVM; ``spark`` starts a Spark Connect server with
    Delta on ``local[N]`` the same way (``resources.engines.spark_server``); ``remote`` connects to
    ``sc://host:port``. All three are Spark Connect: one client code path. ``classic`` builds an
    in-process JVM session with Delta's jars, for code that needs the classic API; it cannot
    share a process with Spark Connect sessions. ``spark_config`` goes to the session (to the
    server in ``spark`` mode).
    """

    spark_config: dict[str, Any] = Field(default_factory=dict, description="Spark settings for the session")
    mode: SparkMode = Field(
        default="embedded",
        description="embedded (Sail in a child process), spark (managed Spark + Delta), remote or classic",
    )
    remote: str | None = Field(default=None, description="sc://host:port of the Spark Connect server (remote mode)")
    app_name: str = Field(default="pgcdc", description="Spark application name (classic mode)")
    lake_root: str | None = Field(default=None, description="delta.root, when the embedded engine must reach a store")
    lake_storage: dict[str, Any] = Field(
        default_factory=dict, description="delta.storage (secrets only as ${ENV} references, resolved on start)"
    )
    keep_alive_s: int = Field(
        default=DEFAULT_KEEP_ALIVE_S,
        description="spark mode: seconds the JVM stays after the last run (0: one per run)",
    )

    _engine: SparkEngine | None = PrivateAttr(default=None)
    _log: DagsterLogManager | None = PrivateAttr(default=None)
    _opened_lake: LakeStorage | None = PrivateAttr(default=None)

    @classmethod
    def _is_dagster_maintained(cls) -> bool:
        return False

    @classmethod
    def from_pgcdc_config(cls, config: PgcdcConfig) -> SparkDeltaResource:
        """Remote when the configuration names a Spark Connect server, else the engine it names."""
        mode: SparkMode = (
            "remote" if config.spark.remote else ("spark" if config.spark.engine == "spark" else "embedded")
        )
        return cls(
            spark_config=dict(config.spark.config),
            mode=mode,
            remote=config.spark.remote,
            lake_root=config.delta.root,
            lake_storage=config.delta.storage.model_dump(exclude_defaults=True),
            keep_alive_s=config.spark.keep_alive_s,
        )

    def session_config(self) -> dict[str, str]:
        """The settings the session is built with: a classic session also needs Delta's extension and catalog."""
        settings = {key: str(value) for key, value in self.spark_config.items()}
        return classic_delta_config(settings) if self.mode == "classic" else settings

    def setup_for_execution(self, context: InitResourceContext) -> None:
        """Start nothing yet (unlike PySparkResource): the engine starts on first use of
        ``spark_session``, so a sensor tick or step that needs no Spark pays nothing."""
        self._log = context.log

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
            self._spark_session = None

    def _start(self) -> SparkEngine:
        if self.mode == "embedded":
            return SparkEngine.embedded(self.session_config(), self._lake().engine_environment())
        if self.mode == "spark":
            lake = self._lake()
            return SparkEngine.managed_spark(
                {**s3a_settings(lake), **self.session_config()},
                storage_environment=lake.engine_environment(),
                keep_alive_s=self.keep_alive_s,
            )
        if self.mode == "remote":
            if not self.remote:
                raise ConfigurationError("Spark mode 'remote' without a URL", "set spark.remote: sc://host:port")
            return SparkEngine.remote(self.remote, self.session_config())
        return SparkEngine(classic_session_builder(self.app_name, self.session_config()).getOrCreate())

    def _lake(self) -> LakeStorage:
        return LakeStorage(self.lake_root or ".", StorageSettings(**self.lake_storage))

    @property
    def spark_session(self) -> SparkSession:
        if self._engine is None:
            self._engine = self._start()
            self._spark_session = self._engine.spark
            if self._engine.start_note and self._log is not None:
                self._log.info(self._engine.start_note)
        return self._engine.spark

    def _checked_lake(self) -> LakeStorage:
        """The lake, checked once (``open_lake``: a wrong bucket or missing credentials fail here,
        before the engine starts or a slot is touched)."""
        if self._opened_lake is None:
            self._opened_lake = open_lake(self.lake_root or ".", StorageSettings(**self.lake_storage))
        return self._opened_lake

    @property
    def destination(self) -> SparkDeltaDestination:
        """What the runs write and read the lake through: the lake checked once, then the engine's session."""
        lake = self._checked_lake()
        return SparkDeltaDestination(self.spark_session, lake)

    def snapshot_destination(self) -> SparkDeltaDestination:
        """What a snapshot step writes through: for the embedded engine, a session started on first
        use (its snapshots are written by delta-rs, so most steps never start it:
        ``resources/engines/lazy_session.py``); for the others, the session, started now (their
        snapshots are the engine's writes)."""
        lake = self._checked_lake()
        if self.mode == "embedded" and self._engine is None:
            return SparkDeltaDestination(deferred_session(lambda: self.spark_session, SAIL_CAPABILITIES), lake)
        return SparkDeltaDestination(self.spark_session, lake)


class PostgresResource(ConfigurableResource):
    """The source database and the pgcdc settings, read from the configuration file.

    Only ``config_file`` is Dagster config, so the DSN (and any password in it) never shows
    in Dagster's UI; ``repr`` and every metadata value use the masked DSN.
    """

    config_file: str = Field(
        description="path of the pgcdc YAML configuration (what PGCDC_CONFIG names), or of the component's defs.yaml"
    )
    pipeline: str | None = Field(default=None, description="the pipeline's name in defs.yaml; null for PGCDC_CONFIG")

    _config: PgcdcConfig | None = PrivateAttr(default=None)

    @property
    def config(self) -> PgcdcConfig:
        if self._config is None:
            self._config = (
                load_config(self.config_file)
                if self.pipeline is None
                else load_pipeline_config(self.config_file, self.pipeline)
            )
        return self._config

    @property
    def dsn(self) -> str:
        return self.config.postgres.dsn

    @property
    def masked_dsn(self) -> str:
        return mask_dsn(self.dsn)

    def __repr__(self) -> str:
        pipeline = "" if self.pipeline is None else f", pipeline={self.pipeline!r}"
        return f"PostgresResource(config_file={self.config_file!r}{pipeline}, dsn={self.masked_dsn!r})"

    __str__ = __repr__

    @contextmanager
    def connect(self) -> Iterator[psycopg.Connection]:
        """An autocommit connection; driver errors become one-line ``PgcdcError``s naming the fix."""
        conn = connect(self.dsn, application_name="pgcdc-dagster")
        try:
            with conn:
                yield conn
        except psycopg.Error as error:
            raise explain(error, self.dsn, slot=self.config.slot) from None

    def read_slot(self) -> SlotState | None:
        """The configured slot's row in pg_replication_slots.

        A plain query over a normal connection: watching the slot never opens a walsender
        and never moves the slot.
        """
        with self.connect() as conn:
            return read_slot(conn, self.config.slot)

    def wal_lsn(self) -> LSN:
        """Where WAL stands on the source (a standby: its replayed WAL), which a slot's lag is measured against."""
        with self.connect() as conn:
            return wal_position(conn)

    def slot_lag_bytes(self, state: SlotState) -> int:
        """WAL bytes the slot has not confirmed yet: what the next drain has to read."""
        if state.confirmed_flush_lsn is None:
            raise ConfigurationError(
                f'replication slot "{state.slot_name}" is not a logical slot', "use a logical pgoutput slot"
            )
        return max(0, self.wal_lsn() - state.confirmed_flush_lsn)

    def publication_tables(self) -> list[TableName]:
        """What the publication publishes right now."""
        with self.connect() as conn:
            return published_tables(conn, self.config.publication)
