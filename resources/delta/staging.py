"""Arrow staged as Parquet files for the engine to read: a MERGE's source, an append's rows, a snapshot the
engine writes (``resources/delta/snapshot_writes.py``). The files live in :data:`STAGING_DIRECTORY` of the
table they are for, and go once the engine has read them."""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, functions as F, SparkSession
from pyspark.sql.pandas.types import from_arrow_schema

from resources.delta.dataframes import chunks, nullable_schema, prepare_writes
from resources.delta.lake_storage import LakeStorage, storage_client
from resources.locations import is_object_store

STAGING_DIRECTORY = "_pgcdc_staging"
"""Inside a table directory; Delta readers and VACUUM ignore directories starting with '_'."""


STAGE_FILE_BYTES = 16 * 1024 * 1024
"""Most Arrow bytes per staged Parquet file (and at most ``chunk_bytes``); smaller batches are
gathered to :data:`STAGE_FILE_MIN_BYTES` first, so a table of many small batches is not a
file each."""


STAGE_FILE_MIN_BYTES = 4 * 1024 * 1024


STAGE_COMPRESSION = "snappy"
"""Staged files are read once, by the engine, right after they are written: no dictionaries or
statistics (CPU the final write does not use), and snappy, the cheapest codec every engine
reads, which keeps an object-store lake's staging upload near the table's compressed size."""


def stage_parquet(
    data: pa.Table | Iterable[pa.RecordBatch],
    schema: pa.Schema,
    staging: str,
    file_bytes: int,
    lake: LakeStorage | None = None,
) -> None:
    """Write ``data`` as Parquet files of about ``file_bytes`` Arrow bytes into ``staging``, columns
    named by position (``c0``, ``c1``, ...; :func:`staged_source_sql` names them back); at least one
    file, so the engine finds the schema of an empty table too."""
    filesystem, directory = storage_client(staging, lake)
    if not is_object_store(staging):  # an object store has no directories (creating one leaves marker objects)
        filesystem.create_dir(directory, recursive=True)  # type: ignore[attr-defined]
    positional = pa.schema([field.with_name(f"c{i}") for i, field in enumerate(nullable_schema(schema))])
    for number, piece in enumerate(chunks(data, schema, file_bytes, min(file_bytes, STAGE_FILE_MIN_BYTES))):
        pq.write_table(
            piece.rename_columns(positional.names).cast(positional),
            f"{directory}/part-{number:05d}.parquet",
            filesystem=filesystem,
            compression=STAGE_COMPRESSION,
            use_dictionary=False,
            write_statistics=False,
            row_group_size=max(1, piece.num_rows),
        )
    # The encoder's buffers are free now, but pyarrow's default pool (mimalloc) keeps freed pages for
    # later allocations: returned, a drain holds about one chunk less while the engine runs its MERGE.
    pa.default_memory_pool().release_unused()


def staged_frame(spark: SparkSession, schema: pa.Schema, staging: str) -> DataFrame:
    """The staged files with the table's column names and exactly the Spark types that
    :func:`~resources.delta.dataframes.spark_dataframe` gives ``schema``."""
    prepare_writes(spark)
    spark_schema = from_arrow_schema(nullable_schema(schema), prefer_timestamp_ntz=True)
    return spark.read.parquet(staging).select(
        *(F.col(f"c{i}").cast(field.dataType).alias(field.name) for i, field in enumerate(spark_schema.fields))
    )


def staged_source_sql(schema: pa.Schema, staging: str) -> str:
    """A SQL query of the files :func:`stage_parquet` wrote into ``staging``: :func:`staged_frame`
    as SQL text (the table's column names, exactly the Spark types of
    :func:`~resources.delta.dataframes.spark_dataframe`), for a statement such as a MERGE's source."""
    spark_schema = from_arrow_schema(nullable_schema(schema), prefer_timestamp_ntz=True)
    columns = ", ".join(
        f"CAST(c{i} AS {field.dataType.simpleString()}) AS `{field.name.replace('`', '``')}`"
        for i, field in enumerate(spark_schema.fields)
    )
    return f"SELECT {columns} FROM parquet.`{staging.replace('`', '``')}`"
