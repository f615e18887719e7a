"""The variants of the managed Spark engine ``bench.scale busy --spark-variants`` measures side by side.

Each variant is pgcdc as built with one of its small-table choices for Delta on Spark undone (or one
setting added), so a run on a quiet machine shows what each choice is worth on the same drains
(docs/engine-notes.md, "A small table's MERGE on Delta on Spark"):

* ``pgcdc``: as pgcdc runs the managed engine;
* ``with-aqe``: Spark's adaptive execution back on (pgcdc turns it off on the managed engine:
  ``spark_server.SMALL_TABLE_CONFIG``);
* ``all-stats``: tables created without ``delta.dataSkippingStatsColumns`` (statistics on every
  column, as tables an earlier pgcdc created);
* ``fair``: Spark's FAIR scheduler, one pool in which the jobs of the tables committed at once share
  the task slots instead of queueing first come first served.

Variants differ in the engine's settings (a JVM of their own) or in how the set-up creates the tables.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from unittest import mock

FAIR_POOLS = """<?xml version="1.0"?>
<allocations>
  <pool name="default"><schedulingMode>FAIR</schedulingMode><weight>1</weight><minShare>0</minShare></pool>
</allocations>
"""

VARIANTS = ("pgcdc", "with-aqe", "all-stats", "fair")


def variant_config(variant: str, work: Path) -> dict[str, str]:
    """The settings the managed engine of ``variant`` gets beside pgcdc's (``spark.config``)."""
    if variant == "with-aqe":
        return {"spark.sql.adaptive.enabled": "true"}
    if variant == "fair":
        pools = work / "fairscheduler.xml"
        pools.write_text(FAIR_POOLS, encoding="utf-8")
        return {"spark.scheduler.mode": "FAIR", "spark.scheduler.allocation.file": f"file://{pools}"}
    if variant in VARIANTS:
        return {}
    raise SystemExit(f"--spark-variants: unknown variant {variant!r}; variants: {', '.join(VARIANTS)}")


def variant_set_up(variant: str) -> AbstractContextManager[object]:
    """Around the variant's snapshot: ``all-stats`` creates the tables without the statistics property."""
    return _all_stats() if variant == "all-stats" else nullcontext()


@contextmanager
def _all_stats() -> Iterator[None]:
    with mock.patch("resources.delta.snapshot_writes.statistics_columns", return_value={}):
        yield
