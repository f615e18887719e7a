"""The catalog query describing column types (domains and array elements resolved) and its rows as
:class:`~resources.pgtypes.mapping.PgColumnType`: what the snapshot and the change stream share."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from resources.pgtypes.mapping import PgColumnType


def pg_type_catalog_query() -> str:
    """SQL describing types for ``PgColumnType``, given ``%(type_oids)s`` and ``%(typmods)s``.

    Both the snapshot (pg_attribute) and CDC (pgoutput Relation messages) paths know each
    column's type oid and typmod, so one query serves both. Domains are resolved
    recursively, taking the domain's own typmod (``CREATE DOMAIN d AS numeric(10,2)``),
    and so are domains used as array elements. Rows come back in input order with the
    1-based ``ord``; pass each to :func:`column_type_from_catalog`.
    """
    return """
WITH RECURSIVE
wanted AS (
    SELECT w.ord, w.type_oid, w.typmod
    FROM ROWS FROM (pg_catalog.unnest(%(type_oids)s::pg_catalog.oid[]),
                    pg_catalog.unnest(%(typmods)s::pg_catalog.int4[]))
         WITH ORDINALITY AS w(type_oid, typmod, ord)
),
base_chain AS (
    SELECT w.ord, w.type_oid AS oid, w.typmod, 0 AS depth FROM wanted w
    UNION ALL
    SELECT c.ord, t.typbasetype, CASE WHEN c.typmod OPERATOR(pg_catalog.<>) -1 THEN c.typmod ELSE t.typtypmod END,
           c.depth OPERATOR(pg_catalog.+) 1
    FROM base_chain c JOIN pg_catalog.pg_type t ON t.oid OPERATOR(pg_catalog.=) c.oid
    WHERE t.typtype OPERATOR(pg_catalog.=) 'd'
),
base AS (
    SELECT DISTINCT ON (ord) ord, oid, typmod FROM base_chain ORDER BY ord, depth DESC
),
element_chain AS (
    SELECT b.ord, t.typelem AS oid, b.typmod, 0 AS depth
    FROM base b JOIN pg_catalog.pg_type t ON t.oid OPERATOR(pg_catalog.=) b.oid
    WHERE t.typcategory OPERATOR(pg_catalog.=) 'A' AND t.typelem OPERATOR(pg_catalog.<>) 0::pg_catalog.oid
    UNION ALL
    SELECT c.ord, t.typbasetype, CASE WHEN c.typmod OPERATOR(pg_catalog.<>) -1 THEN c.typmod ELSE t.typtypmod END,
           c.depth OPERATOR(pg_catalog.+) 1
    FROM element_chain c JOIN pg_catalog.pg_type t ON t.oid OPERATOR(pg_catalog.=) c.oid
    WHERE t.typtype OPERATOR(pg_catalog.=) 'd'
),
element AS (
    SELECT DISTINCT ON (ord) ord, oid, typmod FROM element_chain ORDER BY ord, depth DESC
)
SELECT w.ord, w.type_oid, w.typmod,
       pg_catalog.format_type(w.type_oid, w.typmod) AS type_name,
       bt.typname AS base_name, bt.typtype AS kind, b.typmod AS base_typmod,
       et.typname AS element_name, et.typtype AS element_kind, e.typmod AS element_typmod
FROM wanted w
JOIN base b ON b.ord OPERATOR(pg_catalog.=) w.ord
JOIN pg_catalog.pg_type bt ON bt.oid OPERATOR(pg_catalog.=) b.oid
LEFT JOIN element e ON e.ord OPERATOR(pg_catalog.=) w.ord
LEFT JOIN pg_catalog.pg_type et ON et.oid OPERATOR(pg_catalog.=) e.oid
ORDER BY w.ord
"""


def pg_type_catalog_params(types: Iterable[tuple[int, int]]) -> dict[str, str]:
    """The parameters of :func:`pg_type_catalog_query` for (type oid, typmod) pairs, as array text.

    Text rather than Python lists: a client-side-binding cursor (the snapshot's walsender
    session) renders a list with an unqualified cast such as ``'{...}'::int4[]``, which a
    type planted on the session's search path could capture.
    """
    pairs = list(types)
    return {
        "type_oids": "{" + ",".join(str(oid) for oid, _ in pairs) + "}",
        "typmods": "{" + ",".join(str(typmod) for _, typmod in pairs) + "}",
    }


def column_type_from_catalog(
    column: str, row: Sequence[object], *, nullable: bool = True, as_text: bool = False
) -> PgColumnType:
    """Build a ``PgColumnType`` from one row of :func:`pg_type_catalog_query`."""
    (_, type_oid, _, type_name, base_name, kind, base_typmod, element_name, element_kind, element_typmod) = row
    return PgColumnType(
        column=column,
        type_oid=int(type_oid),  # type: ignore[call-overload]
        type_name=str(type_name),
        base_name=str(base_name),
        kind=str(kind),
        typmod=int(base_typmod),  # type: ignore[call-overload]
        element_name=None if element_name is None else str(element_name),
        element_kind=None if element_kind is None else str(element_kind),
        element_typmod=-1 if element_typmod is None else int(element_typmod),  # type: ignore[call-overload]
        nullable=nullable,
        as_text=as_text,
    )
