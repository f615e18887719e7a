"""Markers and table properties read back through the engine: the commit log as one Spark query over
``_delta_log`` (:func:`read_commit_metadata`, newest commit first), the snapshot marker and the layout
property. The runs read them through the lake's storage client (``resources/delta/table_log.py``);
the tests read them so too, as an oracle that shares nothing with it but the marker format
(``resources/delta/markers.py`` builds and parses what these read).
"""

from __future__ import annotations

from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, functions as F, SparkSession

from resources.delta.layout import TableLayout
from resources.delta.markers import (
    CommitRecord,
    EXPIRED_SNAPSHOT_LSN,
    layout_from_property,
    LAYOUT_PROPERTY,
    marker_layout,
    marker_snapshot_lsn,
    pgcdc_marker,
)
from resources.engines.capabilities import engine_capabilities
from resources.lsn import LSN

_COMMIT_INFO_SCHEMA = "commitInfo STRUCT<timestamp: BIGINT, operation: STRING, userMetadata: STRING>"


def read_commit_metadata(spark: SparkSession, path: str, limit: int | None = None) -> list[CommitRecord]:
    """Commits of the table at ``path``, newest first, read from its log through the engine.

    Commits removed by log cleanup (after a checkpoint and ``delta.logRetentionDuration``)
    are gone; keep that retention longer than the longest a table may sit idle. Delta on
    Spark reads them with ``DESCRIBE HISTORY`` (the capability seam); other engines scan the
    log's JSON files: the same records.
    """
    if engine_capabilities(spark).delta_commands:
        table = "`" + path.replace("`", "``") + "`"
        try:
            history = spark.sql(f"DESCRIBE HISTORY delta.{table}" + (f" LIMIT {int(limit)}" if limit else ""))
        except AnalysisException as error:
            if error.getCondition() == "DELTA_TABLE_ONLY_OPERATION":  # no table (yet): no commits, as the log scan says
                return []
            raise
        return [
            CommitRecord(row["version"], row["timestamp_ms"], row["operation"], row["userMetadata"])
            for row in history.select(
                "version", F.unix_millis("timestamp").alias("timestamp_ms"), "operation", "userMetadata"
            )
            .orderBy(F.desc("version"))
            .collect()
        ]
    commits = _log_actions(spark, path, "commitInfo", _COMMIT_INFO_SCHEMA).select("version", "action.commitInfo.*")
    if limit is not None:
        commits = commits.limit(limit)
    return [
        CommitRecord(row["version"], row["timestamp"], row["operation"], row["userMetadata"])
        for row in commits.collect()
    ]


def _log_actions(spark: SparkSession, path: str, action: str, schema: str) -> DataFrame:
    """The ``action`` actions (parsed by ``schema`` as column ``action``) of the JSON commits left in
    the table's log, with their ``version``, newest first: a scan of the log's JSON files."""
    return (
        spark.read.format("binaryFile")
        .option("pathGlobFilter", "*.json")
        .load(f"{path.rstrip('/')}/_delta_log")
        .select(
            F.regexp_extract("path", r"(\d+)\.json$", 1).cast("bigint").alias("version"),
            F.explode(F.split(F.col("content").cast("string"), "\n")).alias("line"),
        )
        .where(F.col("line").startswith('{"' + action + '"'))
        .select("version", F.from_json("line", schema).alias("action"))
        .orderBy(F.desc("version"))
    )


def read_snapshot_lsn(spark: SparkSession, path: str) -> LSN | None:
    """The snapshot LSN of the newest snapshot commit at ``path``; None without table or marker."""
    return read_snapshot_marker(spark, path)[0]


def read_snapshot_marker(spark: SparkSession, path: str) -> tuple[LSN | None, TableLayout | None]:
    """The snapshot LSN of the newest snapshot commit at ``path`` (None without table or marker)
    and the layout it recorded (None: unbucketed, or the marker is gone: :data:`EXPIRED_SNAPSHOT_LSN`)."""
    try:
        commits = read_commit_metadata(spark, path)
    except AnalysisException as exc:
        if exc.getCondition() == "PATH_NOT_FOUND":  # JVM Spark; Sail lists no commits instead
            return None, None
        raise
    for commit in commits:
        marker = pgcdc_marker(commit.user_metadata)
        if marker is not None and marker.get("kind") == "snapshot":
            return marker_snapshot_lsn(marker), marker_layout(marker)
    if commits and min(commit.version for commit in commits) > 0:
        return EXPIRED_SNAPSHOT_LSN, layout_from_property(read_layout_property(spark, path))
    return None, None


def read_layout_property(spark: SparkSession, path: str) -> str | None:
    """:data:`LAYOUT_PROPERTY` in the table's newest metadata (None: no table, or created by an earlier
    pgcdc): from the newest ``metaData`` action of the commits left in the log, or the newest
    checkpoint's when that is newer. A scan of the log through the engine (:func:`read_snapshot_marker`
    once the snapshot marker is gone)."""
    try:
        return _layout_property(spark, path)
    except AnalysisException as exc:
        if exc.getCondition() == "PATH_NOT_FOUND":  # no table yet (JVM Spark; Sail finds no files)
            return None
        raise


def _layout_property(spark: SparkSession, path: str) -> str | None:
    log = f"{path.rstrip('/')}/_delta_log"
    configuration = "metaData STRUCT<configuration: MAP<STRING, STRING>>"
    newest = (
        _log_actions(spark, path, "metaData", configuration)
        .select("version", F.col("action.metaData.configuration").getItem(LAYOUT_PROPERTY).alias("layout"))
        .limit(1)
        .collect()
    )
    checkpoint = (
        spark.read.format("binaryFile")
        .option("pathGlobFilter", "*.checkpoint.parquet")
        .load(log)
        .select(F.regexp_extract("path", r"(\d+)\.checkpoint\.parquet$", 1).cast("bigint").alias("version"))
        .orderBy(F.desc("version"))
        .limit(1)
        .collect()
    )
    value = newest[0]["layout"] if newest else None
    if checkpoint and (not newest or checkpoint[0]["version"] >= newest[0]["version"]):
        rows = (
            spark.read.parquet(f"{log}/{int(checkpoint[0]['version']):020d}.checkpoint.parquet")
            .where(F.col("metaData").isNotNull())
            .select(F.col("metaData.configuration").getItem(LAYOUT_PROPERTY).alias("layout"))
            .collect()
        )
        value = rows[0]["layout"] if rows else value
    return value
