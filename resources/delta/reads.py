"""Reading a whole Delta table back as Arrow in one scan, with the client's memory bounded.

Reconciliation reads whole tables. ``DataFrame.toArrow`` collects the result in the client,
and ``toLocalIterator`` streams it but turns every value into a Python object (a timestamp
beyond Python's datetime, such as PostgreSQL's infinity, cannot even be represented). Over
Spark Connect (every engine pgcdc runs: embedded Sail, the managed Spark server, a remote
server) the result arrives as a stream of Arrow batches; :func:`delta_batches` hands those on
as they come, which is what ``toLocalIterator`` does underneath before its Row conversion.
An in-process classic session (tests only) shares the driver's memory anyway and is collected whole.

Without an engine, :func:`delta_rs_rows` reads a table in this process through delta-rs's DataFusion
(``deltalake.QueryBuilder``), which applies deletion vectors; ``DeltaTable.to_pyarrow_table`` and
``to_pyarrow_dataset`` refuse a table with them, and ``DeltaTable.count`` counts the rows they delete.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import pyarrow as pa
from pyspark.sql import Column, DataFrame, functions as F, SparkSession

from resources.delta.dataframes import spark_dataframe


def delta_batches(spark: SparkSession, path: str, columns: Sequence[str]) -> Iterator[pa.Table]:
    """``columns`` of every row of the table at ``path``, in pieces as the engine sends them."""
    frame = spark.read.format("delta").load(path).select(*[_column(name) for name in columns])
    yield from _arrow_stream(frame)


def read_rows(spark: SparkSession, path: str, keys: pa.Table | None) -> pa.Table:
    """The rows of the table at ``path`` whose ``keys`` columns equal one of ``keys``' rows (all rows when None).

    ``keys`` holds distinct rows of non-NULL values (a changelog's lookups of unchanged TOAST values)."""
    frame = spark.read.format("delta").load(path)
    if keys is not None:
        frame = frame.join(spark_dataframe(spark, keys), on=list(keys.column_names), how="inner")
    pieces = list(_arrow_stream(frame))
    return pa.concat_tables(pieces) if pieces else frame.limit(0).toArrow()


def _arrow_stream(frame: DataFrame) -> Iterator[pa.Table]:
    from pyspark.sql.connect.dataframe import DataFrame as ConnectDataFrame

    if not isinstance(frame, ConnectDataFrame):
        yield frame.toArrow()
        return
    # pyspark 4.1's own streaming path (DataFrame.toLocalIterator), without its Row conversion.
    client = frame.sparkSession.client
    for item in client.to_table_as_iterator(frame._plan.to_proto(client), frame._plan.observations):
        if isinstance(item, pa.Table):  # the first item is the result's schema
            yield item


def _column(name: str) -> Column:
    """A column by its exact name (backtick-quoted: names may hold dots or spaces)."""
    return F.col("`" + name.replace("`", "``") + "`")


def delta_rs_rows(
    path: str,
    columns: Sequence[str] | None = None,
    *,
    version: int | None = None,
    storage_options: Mapping[str, str] | None = None,
    where: str | None = None,
) -> pa.Table:
    """``columns`` (default: all) of the rows of the Delta table at ``path`` (at ``version``, default
    the newest) that ``where`` (a DataFusion SQL predicate) selects, read by delta-rs's DataFusion with
    the table's deletion vectors applied; typed as the table's Arrow schema (DataFusion hands strings
    and binaries back as views). ``storage_options`` reach an object-store lake."""
    from deltalake import DeltaTable, QueryBuilder

    table = DeltaTable(path, version=version, storage_options=dict(storage_options) if storage_options else None)
    schema = pa.schema(table.schema().to_arrow())
    names = list(columns) if columns is not None else schema.names
    query = f"SELECT {', '.join(map(_sql_identifier, names))} FROM t" + (f" WHERE {where}" if where else "")
    result = pa.table(QueryBuilder().register("t", table).execute(query).read_all())
    return result.cast(pa.schema([schema.field(name) for name in names]))


def _sql_identifier(name: str) -> str:
    """A column by its exact name in DataFusion SQL (double-quoted: names keep their case)."""
    return '"' + name.replace('"', '""') + '"'
