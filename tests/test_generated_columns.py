"""Generated columns: what each PostgreSQL version publishes, and Delta holding exactly that.

Before 18, pgoutput never sends a generated column (``pg_publication_tables`` lists it all the same, on
15 to 17): pgcdc leaves it out of the snapshot and the drains. From 18, a stored generated column is
published when the publication says ``publish_generated_columns = stored`` (or names it in a column
list), and left out otherwise; a virtual one (new in 18) is never published. Real PostgreSQL 15 and 18,
the whole snapshot and drain runs through the in-memory destination (the same seam as Delta).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from resources.config import parse_config
from resources.runs.incremental import run_incremental
from resources.runs.snapshot import snapshot_tables
from resources.testing.memory_destination import InMemoryDestination
from tests.support.postgres import PgDatabase

CHANGES = """
    INSERT INTO g (id, price, qty) VALUES (3, 2.5, 4);
    UPDATE g SET qty = qty + 1 WHERE id = 1;
    DELETE FROM g WHERE id = 2;
"""


@pytest.mark.parametrize("published", [False, True], ids=["default", "publish_generated_columns"])
def test_generated_columns_are_replicated_as_the_version_publishes_them(
    pg: PgDatabase, tmp_path: Path, published: bool
) -> None:
    virtual = ", half numeric GENERATED ALWAYS AS (price / 2) VIRTUAL" if pg.major >= 18 else ""
    option = " WITH (publish_generated_columns = stored)" if published and pg.major >= 18 else ""
    pg.execute(f"""
        CREATE TABLE g (id int PRIMARY KEY, price numeric(10,2), qty int,
                        total numeric GENERATED ALWAYS AS (price * qty) STORED{virtual});
        INSERT INTO g (id, price, qty) VALUES (1, 1.5, 2), (2, 10, 1);
        CREATE PUBLICATION pub FOR TABLE g{option};
    """)
    config = parse_config({"postgres": {"dsn": pg.dsn}, "publication": "pub", "slot": "pgcdc_slot",
                           "delta": {"root": str(tmp_path / "lake")}})  # fmt: skip
    destination = InMemoryDestination()
    snapshot_tables(config, destination)
    pg.execute(CHANGES)
    run_incremental(config, destination)

    expected = ["id", "price", "qty", *(["total"] if published and pg.major >= 18 else [])]
    data = destination.tables[config.table_path("public", "g")]
    assert [name for name in data.column_names if not name.startswith("_pgcdc_")] == expected
    delta = Counter(tuple(row.values()) for row in data.select(expected).to_pylist())
    # unconstrained numeric is replicated as PostgreSQL's text (docs/type-mapping.md)
    assert delta == Counter(pg.execute(f"SELECT {', '.join(expected).replace('total', 'total::text')} FROM g"))
