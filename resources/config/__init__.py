"""The pgcdc configuration: one YAML file named by ``PGCDC_CONFIG``.

The key names are a contract with users' files, so the model forbids unknown
keys (a typo must not silently fall back to a default) and every validation
error names the key and how to fix it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator, ValidationError

from resources.config.catalog import CatalogSettings
from resources.config.columns import ColumnChoice, ColumnOverrides, parse_column_key
from resources.errors import ConfigurationError, mask_dsn
from resources.locations import join_location, StorageSettings
from resources.names import SLOT_NAME, TableName

CONFIG_ENV_VAR = "PGCDC_CONFIG"


def _check_table_names(names: Iterable[str]) -> None:
    """ValueError (pydantic's way of failing one key) unless each of ``names`` is ``schema.table`` as
    ``TableName.parse`` reads it, so any table PostgreSQL accepts can be named (quotes inside a quoted name doubled)."""
    for name in names:
        try:
            TableName.parse(name)
        except ConfigurationError:
            raise ValueError(f"{name!r} is not schema.table (write public.orders, quote odd names)") from None


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PostgresSettings(_Section):
    dsn: str = Field(description="libpq DSN or postgresql:// URL; secrets may come from PG* environment variables")
    standby_dsn: str | None = Field(
        default=None,
        description="a standby of the source, read only to check that the failover slot is synchronized to it",
    )

    def __repr__(self) -> str:
        standby = "" if self.standby_dsn is None else f", standby_dsn={mask_dsn(self.standby_dsn)!r}"
        return f"PostgresSettings(dsn={mask_dsn(self.dsn)!r}{standby})"

    __str__ = __repr__


DEFAULT_TARGET_ROWS = 1_000_000
"""Rows per bucket a snapshot's layout aims at (at most 128 MB of PostgreSQL heap: ``resources.delta.layout``)."""


@dataclass(frozen=True, slots=True)
class BucketOverride:
    """A table's configured layout (``delta.buckets.tables``): a range ``width``, a hash ``count``, or neither (no buckets)."""

    width: int | None = None
    count: int | None = None


class TableBuckets(_Section):
    """One table's layout, instead of the one its size gives it (docs/contracts.md, "Table layout")."""

    width: int | None = Field(default=None, ge=1, description="range buckets of this many keys (a single integer key)")
    count: int | None = Field(default=None, ge=1, description="this many hash buckets (any key)")
    bucketed: bool = Field(default=True, description="false: no bucket column, every MERGE reads the whole table")

    @model_validator(mode="after")
    def _one_choice(self) -> TableBuckets:
        if self.width is not None and self.count is not None:
            raise ValueError("give width (range buckets) or count (hash buckets), not both")
        if not self.bucketed and (self.width is not None or self.count is not None):
            raise ValueError("bucketed: false takes no width or count")
        if self.bucketed and self.width is None and self.count is None:
            raise ValueError("give width (range buckets) or count (hash buckets), or bucketed: false")
        return self


class BucketSettings(_Section):
    target_rows: int = Field(
        default=DEFAULT_TARGET_ROWS, ge=1, description="rows per bucket a snapshot aims at (at most 128 MB of heap)"
    )
    tables: dict[str, TableBuckets] = Field(default_factory=dict, description="schema.table -> its own layout")

    @field_validator("tables")
    @classmethod
    def _qualified_tables(cls, value: dict[str, TableBuckets]) -> dict[str, TableBuckets]:
        _check_table_names(value)
        return value

    def override(self, table: TableName) -> BucketOverride | None:
        """The configured layout of ``table``; None when its size decides."""
        for name, buckets in self.tables.items():
            if TableName.parse(name) == table:
                return BucketOverride(width=buckets.width, count=buckets.count)
        return None


class DeltaSettings(_Section):
    root: str = Field(
        default="./lake",
        description="directory or s3://bucket/prefix; the Delta table of schema.table lives at <root>/<schema>/<table>",
    )
    storage: StorageSettings = Field(default_factory=StorageSettings, description="object-store settings for root")
    buckets: BucketSettings = Field(default_factory=BucketSettings, description="how keyed tables are partitioned")
    deletion_vectors: bool = Field(
        default=True,
        description="keyed and REPLICA IDENTITY FULL tables are created with Delta's deletion vectors: a MERGE marks "
        "changed rows deleted instead of rewriting their files; false: copy-on-write, for readers without deletion vectors",
    )
    deletion_vectors_tables: dict[str, bool] = Field(
        default_factory=dict, description="schema.table -> deletion_vectors for that table, instead of the global value"
    )

    @field_validator("deletion_vectors_tables")
    @classmethod
    def _qualified_tables(cls, value: dict[str, bool]) -> dict[str, bool]:
        _check_table_names(value)
        return value

    def deletion_vectors_for(self, table: TableName) -> bool:
        """Whether ``table``'s Delta table is created with deletion vectors (when it is keyed or
        REPLICA IDENTITY FULL: docs/contracts.md, "Deletion vectors")."""
        for name, enabled in self.deletion_vectors_tables.items():
            if TableName.parse(name) == table:
                return enabled
        return self.deletion_vectors


DEFAULT_KEEP_ALIVE_S = 600
"""How long the managed Spark JVM (``spark.engine: spark``) stays after its last run: two ticks of the
default schedule (every 5 minutes), so scheduled drains share one JVM (a fresh JVM's start and
warm-up cost 10x Sail's drain of 160k changes, a kept one's later drains 3-5x: docs/benchmarks.md),
while a machine that stops running pgcdc gets the JVM's memory (1 GiB heap by default) back ten
minutes later. 0 keeps a JVM per run."""


DEFAULT_SPARK_WRITES = 4
"""Tables a drain commits at once on Delta on Spark (managed or remote): a commit of a few rows costs about
2 s there, nearly all of it planning, log state and commit round trips that overlap (docs/engine-notes.md)."""

DEFAULT_SAIL_WRITES = 2
"""Tables a drain commits at once on embedded Sail: its MERGE of a few rows costs about 0.1 s, much of it
CPU on the cores pgcdc decodes on, so more threads gain little (docs/engine-notes.md)."""


class SparkSettings(_Section):
    remote: str | None = Field(default=None, description="sc://host:port of a Spark Connect server; null = embedded")
    engine: Literal["sail", "spark"] = Field(
        default="sail",
        description="the engine pgcdc starts when remote is null: sail (embedded, no JVM) or spark "
        "(a Spark Connect server with Delta's jars on local[N]; needs Java 17)",
    )
    config: dict[str, str] = Field(
        default_factory=dict,
        description="extra Spark settings: session settings for sail and remote, server settings for spark",
    )

    keep_alive_s: int = Field(
        default=DEFAULT_KEEP_ALIVE_S,
        description="with engine spark: seconds the managed JVM stays after the last run leaves it, serving the "
        "runs after it (0: each run starts its own JVM, stopped when the run ends)",
    )

    write_concurrency: int | None = Field(
        default=None, ge=1, le=32,
        description="Delta writes of different tables a drain runs at once (each table's own writes stay in order); "
        f"null: {DEFAULT_SAIL_WRITES} on embedded sail, {DEFAULT_SPARK_WRITES} on spark and on a remote server",
    )  # fmt: skip

    def writes_at_once(self) -> int:
        """``write_concurrency``, or the engine's default: Spark Connect sessions take concurrent queries from
        several threads on every engine, and a table's commit on Delta on Spark is mostly fixed cost that
        overlaps well; embedded Sail shares pgcdc's own cores, so it gains less (docs/engine-notes.md)."""
        if self.write_concurrency is not None:
            return self.write_concurrency
        return DEFAULT_SAIL_WRITES if self.remote is None and self.engine == "sail" else DEFAULT_SPARK_WRITES

    @field_validator("keep_alive_s", mode="before")
    @classmethod
    def _keep_alive_is_whole_seconds(cls, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"got {value!r}: write a whole number of seconds, 0 or more (0: a JVM per run, stopped with the run)"
            )
        return value

    @field_validator("remote")
    @classmethod
    def _remote_is_spark_connect(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("sc://"):
            raise ValueError("must be a Spark Connect URL like sc://host:15002, or null for the embedded engine")
        return value


DEFAULT_WORKERS = 2
"""Sessions reading one big table; docs/engine-notes.md has the figures behind the choice."""

DEFAULT_CHUNK_MB = 64
"""Heap megabytes per ctid range: a table up to this size is read by one COPY."""


DEFAULT_CHUNKED_ABOVE_MB = 10240.0
"""10 GiB: below it one snapshot transaction lasts minutes (a few hundred MB/s), above it the
transaction would hold VACUUM back for long, so the table is copied in key ranges instead."""

DEFAULT_KEY_CHUNK_MB = 1024.0
"""Heap megabytes per key range: a few seconds of COPY per short transaction, a few hundred ranges for 1 TB."""


class SnapshotSettings(_Section):
    parallel_tables: int = Field(default=2, ge=1, le=64, description="tables copied at once")
    workers: int = Field(
        default=DEFAULT_WORKERS, ge=1, le=64,
        description="sessions copying one big table's ctid ranges under one snapshot (1 = one COPY per table)",
    )  # fmt: skip
    chunk_mb: int = Field(
        default=DEFAULT_CHUNK_MB,
        ge=1,
        le=1024 * 1024,
        description="heap megabytes per ctid range; a smaller table is one COPY",
    )
    chunked_above_mb: float = Field(
        default=DEFAULT_CHUNKED_ABOVE_MB, ge=0,
        description="heap megabytes above which a table with a one-column integer primary key is copied in key ranges, "
        "one short transaction each, resumable (docs/contracts.md); smaller or keyless tables use one snapshot",
    )  # fmt: skip
    key_chunk_mb: float = Field(
        default=DEFAULT_KEY_CHUNK_MB,
        gt=0,
        description="heap megabytes per primary-key range of a table copied in key ranges",
    )


class ScheduleSettings(_Section):
    cron: str = Field(default="*/5 * * * *", description="when pgcdc_incremental_schedule fires")


class SensorSettings(_Section):
    lag_bytes: int = Field(default=64 * 1024 * 1024, ge=0, description="slot lag that triggers an incremental run")


class CheckSettings(_Section):
    max_lag_bytes: int = Field(default=1024 * 1024 * 1024, ge=0, description="asset check bound on slot lag")


class MaintenanceSettings(_Section):
    """``maintenance``: what the ``pgcdc_maintenance`` job keeps (``resources/delta/maintenance.py``)."""

    cron: str = Field(default="0 3 * * *", description="when pgcdc_maintenance_schedule fires (stopped by default)")
    retention_hours: int = Field(
        default=168,
        ge=1,
        description="data files a newer version no longer references are deleted this long after their removal; "
        "time travel to any version of this window keeps working; maintenance sets each table's "
        "delta.logRetentionDuration and delta.deletedFileRetentionDuration to it (a hand-set value is overwritten)",
    )
    target_file_bytes: int = Field(
        default=128 * 1024 * 1024, ge=1024 * 1024, description="compaction writes files of about this size"
    )
    max_deleted_rows_ratio: float = Field(
        default=0.05, ge=0, le=1,
        description="a data file whose deletion vectors delete more than this fraction of its rows is rewritten "
        "without them (Delta's OPTIMIZE default), even alone in its bucket or above target_file_bytes",
    )  # fmt: skip


HistoryMode = Literal["none", "changelog", "scd2"]

HISTORY_SUFFIX = "__changes"
"""The changelog of ``schema.table`` lives beside its table, at ``<root>/<schema>/<table>__changes``."""

SCD2_SUFFIX = "__history"
"""The SCD type 2 table of ``schema.table`` lives beside its table, at ``<root>/<schema>/<table>__history``."""


class HistorySettings(_Section):
    """``history``: which tables keep a changelog or an SCD type 2 table (docs/history.md)."""

    default: HistoryMode = Field(default="none", description="every table's history unless tables names it")
    tables: dict[str, HistoryMode] = Field(default_factory=dict, description="schema.table -> its own history mode")

    @field_validator("tables")
    @classmethod
    def _qualified_tables(cls, value: dict[str, HistoryMode]) -> dict[str, HistoryMode]:
        _check_table_names(value)
        return value

    def mode(self, table: TableName) -> HistoryMode:
        """The history mode of ``table``: its own entry, else the default."""
        for name, mode in self.tables.items():
            if TableName.parse(name) == table:
                return mode
        return self.default


class ColumnSetting(_Section):
    """One column's entry of ``columns``: ``text``, ``exclude``, or ``{rename: name}`` (with ``text: true``)."""

    text: bool = Field(default=False, description="replicate the column as PostgreSQL's text output")
    rename: str | None = Field(default=None, min_length=1, description="the column's name in Delta")
    exclude: bool = Field(default=False, description="leave the column out of Delta")

    @model_validator(mode="after")
    def _one_choice(self) -> ColumnSetting:
        if self.exclude and (self.text or self.rename is not None):
            raise ValueError("exclude takes no text or rename")
        if self.rename is not None and self.rename.startswith("_pgcdc_"):
            raise ValueError(f"{self.rename!r}: names starting with _pgcdc_ are pgcdc's own columns")
        return self


def _column_settings(value: Any) -> Any:
    """``columns`` with ``text`` and ``exclude`` read as their settings; any other value refused in one line."""
    if not isinstance(value, dict):
        return value
    settings: dict[Any, Any] = {}
    named: dict[tuple[TableName, str], str] = {}
    for key, entry in value.items():
        column = parse_column_key(str(key))
        if column in named:
            raise ValueError(f"{named[column]!r} and {key!r} name the same column: keep one")
        named[column] = str(key)
        if entry in ("text", "exclude"):
            entry = {entry: True}
        elif not isinstance(entry, dict):
            raise ValueError(f"{key}: got {entry!r}: write text, exclude or {{rename: new_name}}")
        settings[key] = entry
    return settings


class PgcdcConfig(_Section):
    postgres: PostgresSettings
    publication: str = Field(min_length=1)
    create_publication: bool = False
    slot: str = "pgcdc_slot"
    slot_failover: bool = Field(
        default=False,
        description="PostgreSQL 17+: the slot is a failover slot, kept on standbys that run sync_replication_slots",
    )
    tables: list[str] = Field(default_factory=list, description="schema.table names; empty = the whole publication")
    delta: DeltaSettings = Field(default_factory=DeltaSettings)
    spark: SparkSettings = Field(default_factory=SparkSettings)
    snapshot: SnapshotSettings = Field(default_factory=SnapshotSettings)
    schedule: ScheduleSettings = Field(default_factory=ScheduleSettings)
    sensors: SensorSettings = Field(default_factory=SensorSettings)
    checks: CheckSettings = Field(default_factory=CheckSettings)
    maintenance: MaintenanceSettings = Field(default_factory=MaintenanceSettings)
    history: HistorySettings = Field(default_factory=HistorySettings)
    on_table_error: Literal["quarantine", "stop"] = Field(
        default="quarantine",
        description="a fault of one table (a value Delta cannot hold, a DDL that needs a re-snapshot, a write the "
        "engine refuses): quarantine sets that table aside and drains the others; stop fails the whole drain",
    )
    columns: dict[str, ColumnSetting] = Field(
        default_factory=dict,
        description="schema.table.column -> text (PostgreSQL's text output) | {rename: name} (in Delta) | exclude; "
        'quote odd names as PostgreSQL does: public."Order Items"."Due.Date"',
    )
    catalog: CatalogSettings | None = Field(
        default=None,
        description="register every table pgcdc creates in the engine's catalog (null: none, by path only)",
    )

    @field_validator("columns", mode="before")
    @classmethod
    def _column_values(cls, value: Any) -> Any:
        return _column_settings(value)

    @property
    def column_overrides(self) -> ColumnOverrides:
        """The ``columns`` choices by table and PostgreSQL column name."""
        return ColumnOverrides.from_keys(
            (key, ColumnChoice(as_text=entry.text, rename=entry.rename, exclude=entry.exclude))
            for key, entry in self.columns.items()
        )

    @field_validator("slot")
    @classmethod
    def _slot_name(cls, value: str) -> str:
        if not SLOT_NAME.match(value):
            raise ValueError("slot names use only lower-case letters, digits and underscores (at most 63)")
        return value

    @field_validator("tables")
    @classmethod
    def _qualified_tables(cls, value: list[str]) -> list[str]:
        _check_table_names(value)
        return value

    @model_validator(mode="after")
    def _standby_for_failover(self) -> PgcdcConfig:
        if self.postgres.standby_dsn is not None and not self.slot_failover:
            raise ValueError(
                "postgres.standby_dsn is only used to check a failover slot: set slot_failover: true or remove it"
            )
        if self.catalog is not None and self.spark.remote is None and self.spark.engine == "sail":
            raise ValueError(
                "catalog: the embedded engine (spark.engine: sail) keeps a table registered for one session only, gone"
                " when the run ends: set spark.engine: spark (a Hive metastore) or spark.remote, or remove catalog"
            )
        return self

    def table_path(self, schema: str, table: str) -> str:
        """Where the Delta table of ``schema.table`` lives: ``<root>/<schema>/<table>``.

        Each name is written as itself when it holds only ASCII letters, digits and ``_``
        (every ordinary name, so such paths never change). Any other character, ``-``
        included, becomes ``-`` and the two lower-case hex digits of each of its UTF-8 bytes:
        ``Mixed Case`` -> ``Mixed-20Case``, ``a.b`` -> ``a-2eb``, ``é`` -> ``-c3-a9``. Spark
        engines percent-encode paths inconsistently (Sail 0.7.2 writes ``Mixed Case``'s log
        under ``Mixed%20Case`` and its data under ``Mixed%2520Case``); this encoding leaves
        them nothing to encode, cannot produce ``.``/``..`` or a ``/``, and is reversible.
        A URL root (``s3://bucket/prefix``) is joined with ``/``; a local root is resolved
        against the working directory.
        Case is kept, so on a case-insensitive file system ``"Orders"`` and ``orders``
        share a directory.
        """
        return join_location(self.delta.root, _path_component(schema), _path_component(table))

    def table_at(self, key: str, path: str) -> TableName:
        """The table whose key (``str(TableName)``: ``schema.table`` unquoted, as pgcdc's state and quarantine
        records hold it) is ``key`` and whose Delta table is at ``path``. The key alone splits at a dot
        either name may hold (``"a.b".c``, ``a."b.c"``); :meth:`table_path` encodes both names apart, so the
        split whose path it is names the table (the first split when none is: a path under another root)."""
        splits = [TableName(key[:at], key[at + 1 :]) for at, char in enumerate(key) if char == "."]
        return next((t for t in splits if self.table_path(t.schema, t.name) == path), splits[0])

    def history_path(self, schema: str, table: str) -> str | None:
        """Where the history of ``schema.table`` lives: its changelog (``<table path>__changes``) or its SCD
        type 2 table (``<table path>__history``); None: no history kept."""
        mode = self.history.mode(TableName(schema, table))
        if mode == "none":
            return None
        suffix = SCD2_SUFFIX if mode == "scd2" else HISTORY_SUFFIX
        return join_location(self.delta.root, _path_component(schema), _path_component(table) + suffix)


_PLAIN_PATH_CHARACTER = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


def _path_component(name: str) -> str:
    """A PostgreSQL name as one safe directory name (see ``PgcdcConfig.table_path``)."""
    return "".join(
        char if char in _PLAIN_PATH_CHARACTER else "".join(f"-{byte:02x}" for byte in char.encode("utf-8"))
        for char in name
    )


def _describe(error: ValidationError) -> str:
    problems = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "<top level>"
        if item["type"] == "extra_forbidden":
            problems.append(f"unknown key '{key}' (remove it or fix its spelling)")
        elif item["type"] == "missing":
            problems.append(f"'{key}' is required")
        else:
            problems.append(f"'{key}': {item['msg']}")
    return "; ".join(problems)


def parse_config(data: Any, source: str = "configuration") -> PgcdcConfig:
    if not isinstance(data, dict):
        raise ConfigurationError(f"{source} is not a YAML mapping", "write keys like 'postgres:' and 'publication:'")
    try:
        return PgcdcConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigurationError(f"invalid {source}: {_describe(error)}", "fix the keys named") from None


def load_config(path: str | os.PathLike[str] | None = None) -> PgcdcConfig:
    """Load the file at ``path``, or at ``$PGCDC_CONFIG``."""
    location = path or os.environ.get(CONFIG_ENV_VAR)
    if not location:
        raise ConfigurationError(f"{CONFIG_ENV_VAR} is not set", f"export {CONFIG_ENV_VAR}=/path/to/pgcdc.yaml")
    try:
        text = Path(location).read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigurationError(
            f"cannot read config {location} ({error.strerror})", f"point {CONFIG_ENV_VAR} at a readable file"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigurationError(f"config {location} is not valid YAML ({error})", "fix the YAML syntax") from None
    return parse_config(data, f"config {location}")
