"""Delta schema changes that follow PostgreSQL: the current schema, safe type widenings, added columns and their back-filled values."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pyarrow as pa
from pyspark.sql import DataFrame, functions as F, SparkSession
from pyspark.sql.pandas.types import from_arrow_type, to_arrow_schema
from pyspark.sql.types import StructType

from resources.delta.dataframes import prepare_writes, spark_dataframe
from resources.delta.lake_storage import LakeStorage
from resources.delta.layout import BUCKET_COLUMN
from resources.delta.merge import quote_column
from resources.delta.table_log import read_table_metadata
from resources.engines.capabilities import engine_capabilities


def table_schema(path: str, lake: LakeStorage | None = None) -> pa.Schema:
    """The Delta table's current schema, as Arrow: its newest ``metaData`` read from the log by the
    lake's storage client (``table_log``), converted as the engine converts a DataFrame's schema.

    Not asked of the engine: on Delta on Spark the schema look-up was a drain's only statement besides
    its MERGEs and, as the table's first statement of a fresh JVM, cost 3.7-5.4 s (a job rebuilding
    the table's protocol and metadata; docs/engine-notes.md, "A drain on Delta on Spark, statement
    by statement")."""
    metadata = read_table_metadata(path, lake)
    if metadata is None or not metadata.schema_json:
        raise FileNotFoundError(f"no Delta table at {path}")
    return to_arrow_schema(StructType.fromJson(json.loads(metadata.schema_json)))


def widen_columns(spark: SparkSession, path: str, widened: Mapping[str, pa.DataType]) -> None:
    """Rewrite the table with some columns cast to wider types, in one overwrite commit.

    Neither Sail nor open-source Delta without the type-widening feature can ALTER a
    column's type, so the table is rewritten; readers see the old or the new table whole.
    """
    prepare_writes(spark)  # the rewrite writes every column anew, timestamps included
    frame = spark.read.format("delta").load(path)
    schema = to_arrow_schema(frame.schema)
    columns = [
        F.col(quote_column(field.name)).cast(from_arrow_type(widened[field.name])).alias(field.name)
        if field.name in widened
        else F.col(quote_column(field.name))
        for field in schema
    ]
    _rewrite(frame.select(*columns), schema, path)


def _rewrite(frame: DataFrame, schema: pa.Schema, path: str) -> None:
    """Overwrite the table with ``frame`` (its new schema), keeping a bucketed table's partitioning:
    an overwrite without ``partitionBy`` would write the table unpartitioned."""
    writer = frame.write.format("delta").mode("overwrite").option("overwriteSchema", "true")
    if BUCKET_COLUMN in schema.names:
        writer = writer.partitionBy(BUCKET_COLUMN)
    writer.save(path)


def add_columns(spark: SparkSession, path: str, new_columns: pa.Schema) -> None:
    """Add nullable columns to the table, committing the schema alone.

    Sail has no ``ALTER TABLE ... ADD COLUMNS``; an append of an empty Arrow frame with the
    widened schema commits the new schema (an empty list or query result commits nothing there),
    and Delta on a JVM Spark accepts it the same way. Where the engine has Delta's commands
    (the capability seam) the ALTER commits the same schema without a write job.
    """
    if engine_capabilities(spark).delta_commands:
        columns = ", ".join(
            f"{quote_column(field.name)} {from_arrow_type(field.type, prefer_timestamp_ntz=True).simpleString()}"
            for field in new_columns
        )
        spark.sql(f"ALTER TABLE delta.{quote_column(path)} ADD COLUMNS ({columns})").collect()
        return
    existing = to_arrow_schema(spark.read.format("delta").load(path).schema)
    frame = spark_dataframe(spark, pa.schema([*existing, *new_columns]).empty_table())
    frame.write.format("delta").mode("append").option("mergeSchema", "true").save(path)


def fill_columns(spark: SparkSession, path: str, values: pa.Table, lsn_column: str, up_to_lsn: int) -> None:
    """Set each column of the one-row ``values`` to its value in every row whose ``lsn_column``
    is at most ``up_to_lsn``, adding the columns the table lacks (NULL in the other rows).

    One overwrite commit, so the new columns never exist without their values. Sail has
    neither ALTER TABLE nor UPDATE; this is a rewrite of the table, like :func:`widen_columns`.
    A column the table has takes the type of ``values`` (a column dropped and added again in
    PostgreSQL under its name, with another type: every row it keeps is filled).
    """
    frame = spark.read.format("delta").load(path)
    existing = to_arrow_schema(frame.schema)
    retyped = {
        field.name: field.type
        for field in values.schema
        if field.name in existing.names and existing.field(field.name).type != field.type
    }
    lsn_column_le = F.col(quote_column(lsn_column)) <= F.lit(int(up_to_lsn))
    if frame.where(lsn_column_le).limit(1).count() == 0:  # nothing to fill (an empty query result commits no schema)
        missing = [field for field in values.schema if field.name not in existing.names]
        if retyped:
            widen_columns(spark, path, retyped)
        if missing:
            add_columns(spark, path, pa.schema(missing))
        return
    fill_names = {name: f"_pgcdc_fill_{i}" for i, name in enumerate(values.column_names)}
    fill = spark_dataframe(spark, values.rename_columns([fill_names[name] for name in values.column_names]))
    joined = frame.crossJoin(fill)
    columns = [
        F.when(lsn_column_le, F.col(fill_names[field.name]))
        .otherwise(
            F.col(quote_column(field.name)).cast(from_arrow_type(retyped[field.name]))
            if field.name in retyped
            else F.col(quote_column(field.name))
        )
        .alias(field.name)
        if field.name in fill_names
        else F.col(quote_column(field.name))
        for field in existing
    ]
    columns += [
        F.when(lsn_column_le, F.col(fill_names[name])).alias(name)
        for name in values.column_names
        if name not in existing.names
    ]
    _rewrite(joined.select(*columns), existing, path)
