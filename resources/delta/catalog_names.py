"""A Delta table registered by name in the engine's catalog, as an external table at its location.

Registration is three statements through the engine's session, never the Delta log: the namespace
(``CREATE SCHEMA IF NOT EXISTS``), the table (``CREATE TABLE IF NOT EXISTS ... USING DELTA LOCATION``),
and ``DESCRIBE TABLE EXTENDED`` to check what the name holds now. ``IF NOT EXISTS`` makes it idempotent,
and also silent when the name is already taken, so only the check tells a table registered earlier at
this location (done) from another table under the name (refused). The catalog keeps no schema of its
own for a Delta table: it reads the table's log, so a schema change or a re-snapshot at the same
location needs nothing more.
"""

from __future__ import annotations

from pyspark.sql import SparkSession

from resources.config.catalog import CatalogName
from resources.engines.capabilities import expected_refusal
from resources.errors import CatalogRefusal


def register_table(
    spark: SparkSession, name: CatalogName, location: str, what: str, *, new_schema: bool = True
) -> None:
    """Register the Delta table at ``location`` as ``name``; nothing when it already is. ``what`` names the
    table in the refusal (``shop.orders``, ``shop.orders (changelog)``); ``new_schema``: its namespace may not
    exist yet (False: this session made it already, one statement fewer).

    Raises :class:`CatalogRefusal` when the catalog refuses the name or the name holds another table (not
    Delta, or at another location); any other failure (the engine gone, say) is raised as it is."""
    from pyspark.errors import AnalysisException

    try:
        with expected_refusal():  # the refusal is said here, in one line; the client would log its traceback
            if new_schema:
                spark.sql(f"CREATE SCHEMA IF NOT EXISTS {name.schema_sql}").collect()
            spark.sql(f"CREATE TABLE IF NOT EXISTS {name.sql} USING DELTA LOCATION {spark_literal(location)}").collect()
            rows = spark.sql(f"DESCRIBE TABLE EXTENDED {name.sql}").collect()
    except AnalysisException as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        condition = getattr(error, "getCondition", lambda: None)() or ""
        fix = (
            "set catalog.schema to a schema the catalog accepts, or rename the table in PostgreSQL"
            if "NAME" in condition or "IDENTIFIER" in condition
            else 'give the engine\'s identity what registering needs (docs/deployment.md, "Tables by name in a catalog")'
        )
        raise CatalogRefusal(
            f"{what} cannot be registered in catalog {name.catalog} as {name} ({reason})",
            f"{fix}; it is written at {location} meanwhile",
        ) from None
    details = {str(row[0]): str(row[1]) for row in rows}
    provider, registered_at = details.get("Provider", ""), details.get("Location", "")
    if provider.lower() != "delta" or not same_location(registered_at, location):
        held = f"a {provider.lower() or details.get('Type', 'non-Delta')} table at {registered_at or 'no location'}"
        raise CatalogRefusal(
            f"{what} cannot be registered in catalog {name.catalog} as {name}: the name holds {held}",
            f"drop or rename that table (DROP TABLE {name.sql} drops only the catalog entry of an external table), "
            "or set another catalog.schema; the next drain registers the table at "
            f"{location}",
        )


def same_location(registered: str, location: str) -> bool:
    """Whether the catalog's location and pgcdc's name one directory: the catalog writes a local path as a
    ``file:`` URI and may add a trailing ``/``; S3A's scheme is S3's."""
    return _normalized(registered) == _normalized(location)


def _normalized(location: str) -> str:
    if location.startswith("file:"):
        location = "/" + location.removeprefix("file:").lstrip("/")
    if location.startswith("s3a://"):
        location = "s3://" + location.removeprefix("s3a://")
    return location.rstrip("/")


def spark_literal(value: str) -> str:
    """A Spark SQL string literal: single quotes, a backslash and a quote inside escaped by a backslash."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
