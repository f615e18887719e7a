"""The ``catalog:`` block: the names pgcdc registers its Delta tables under in the engine's catalog.

A table's name is three parts: the catalog (``catalog.name``), a schema from the template
(``catalog.schema``, where ``{schema}`` stands for the PostgreSQL schema: ``pg_{schema}`` names
``shop.orders`` ``pg_shop.orders``), and the PostgreSQL table's own name; its changelog and SCD
type 2 table take the suffix their location takes (``orders__changes``, ``orders__history``). The
template must hold ``{schema}`` once: two PostgreSQL schemas then never share a catalog schema, so
two tables can only clash where the catalog folds names (the Hive metastore lower-cases them), and
that clash is refused when it is met (``resources/delta/catalog_names.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator

SCHEMA_PLACEHOLDER = "{schema}"

DEFAULT_CATALOG = "spark_catalog"
"""Spark's session catalog: the Hive metastore (or Unity Catalog's default catalog on Databricks, Glue with
the Glue client), whatever the engine's ``spark.sql.catalogImplementation`` and catalog settings make it."""


@dataclass(frozen=True, slots=True)
class CatalogName:
    """A table's name in the catalog: ``catalog.schema.table``, each part as written (never folded)."""

    catalog: str
    schema: str
    table: str

    @property
    def sql(self) -> str:
        """The name as Spark SQL writes it: each part in backticks, a backtick inside doubled."""
        return ".".join(quote_part(part) for part in (self.catalog, self.schema, self.table))

    @property
    def schema_sql(self) -> str:
        """The namespace (``catalog.schema``) as Spark SQL writes it."""
        return f"{quote_part(self.catalog)}.{quote_part(self.schema)}"

    def __str__(self) -> str:
        """The name as readers type it when no part needs quotes (``spark_catalog.pg_shop.orders``)."""
        return ".".join(part if _plain(part) else quote_part(part) for part in (self.catalog, self.schema, self.table))


def quote_part(part: str) -> str:
    """One identifier in Spark SQL's quotes: backticks, a backtick inside doubled."""
    return "`" + part.replace("`", "``") + "`"


def _plain(part: str) -> bool:
    return part.isascii() and part.replace("_", "a").isalnum() and not part[:1].isdigit()


class CatalogSettings(BaseModel):
    """``catalog``: register every table pgcdc creates as an external Delta table (docs/configuration.md)."""

    # ``schema`` is the key (``BaseModel.schema`` takes the attribute name); dumped under it too, so a dump reads back.
    model_config = ConfigDict(extra="forbid", frozen=True, serialize_by_alias=True)

    name: str = Field(
        default=DEFAULT_CATALOG,
        min_length=1,
        description="the catalog the tables are registered in (spark_catalog: the session catalog; a Unity Catalog "
        "catalog such as main; glue_catalog when Spark's Glue catalog is configured under that name)",
    )
    schema_template: str = Field(
        default=SCHEMA_PLACEHOLDER,
        alias="schema",
        min_length=1,
        description="the catalog schema of a PostgreSQL schema's tables: {schema} is the PostgreSQL schema name "
        "(pg_{schema} puts shop.orders at <name>.pg_shop.orders)",
    )

    @field_validator("schema_template")
    @classmethod
    def _one_placeholder(cls, value: str) -> str:
        if value.count(SCHEMA_PLACEHOLDER) != 1:
            raise ValueError(
                f"got {value!r}: write {SCHEMA_PLACEHOLDER} once, with an optional prefix or suffix (pg_{SCHEMA_PLACEHOLDER}),"
                " so that tables of two PostgreSQL schemas never share a name"
            )
        if "{" in value.replace(SCHEMA_PLACEHOLDER, "") or "}" in value.replace(SCHEMA_PLACEHOLDER, ""):
            raise ValueError(f"got {value!r}: {SCHEMA_PLACEHOLDER} is the only placeholder")
        return value

    def name_of(self, schema: str, table: str, suffix: str = "") -> CatalogName:
        """The catalog name of ``schema.table`` (with ``suffix``: its changelog's or SCD type 2 table's)."""
        return CatalogName(self.name, self.schema_template.replace(SCHEMA_PLACEHOLDER, schema), table + suffix)
