"""The one engine-capability seam: what the engine can do beyond the SQL every engine shares.

pgcdc's logic never forks per engine: every operation has one formulation that works on
embedded Sail, on Spark with Delta's jars and on any Spark Connect server, and the Delta
tables come out the same. Where Delta on Spark has a cheaper way to the same result, the
Delta writers ask this module, and only there (docs/engine-notes.md):

* commit metadata: ``DESCRIBE HISTORY ... LIMIT n`` reads the newest commits from Delta's log
  instead of a ``binaryFile`` scan of every JSON commit (a Spark job per call on a JVM);
* new columns: ``ALTER TABLE ... ADD COLUMNS`` commits the schema alone instead of an empty
  append with ``mergeSchema`` (a write job).

And one the other way round: an engine without Delta's commands (embedded Sail 0.7.2) has its
snapshots' overwrites written by delta-rs in pgcdc's process, streamed from the COPY, instead of
reading staged Parquet and rewriting it (``delta_rs_snapshots``; ``snapshot_writes.py``): the same
Delta schema and marker, at 1.6-2x the speed on 2 cores (docs/engine-notes.md, "Snapshots
written by delta-rs"). On Delta on Spark the engine creates a new table (an empty write with the
snapshot's options, so protocol and properties are Spark's own) and delta-rs writes the rows into it
in the snapshot commit (``delta_rs_snapshot_rows``), as it does into an existing table whose
protocol, schema and partitioning the snapshot keeps; otherwise Spark's own write. A key range of a
snapshot in key ranges (``replaceWhere``) is the engine's everywhere.

Delta on Spark also has ``OPTIMIZE``, ``VACUUM``, ``TRUNCATE TABLE`` and MERGE ``userMetadata``
(``spark.databricks.delta.commitInfo.userMetadata``); Sail 0.7.2 has none of these. pgcdc
does not need them for correctness; table maintenance (``maintenance.py``) runs ``OPTIMIZE`` and
``VACUUM`` where ``delta_commands`` says the engine has them, and delta-rs elsewhere.
"""

from __future__ import annotations

import logging
import threading
import uuid
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pyspark.sql import SparkSession


@dataclass(frozen=True, slots=True)
class EngineCapabilities:
    #: Delta Lake's SQL commands (DESCRIBE HISTORY, ALTER TABLE ADD COLUMNS, OPTIMIZE, VACUUM, ...).
    delta_commands: bool
    #: Whether a snapshot's overwrite is written by delta-rs in pgcdc's process (streamed from the
    #: COPY) instead of by the engine (docs/engine-notes.md, "Snapshots written by delta-rs").
    delta_rs_snapshots: bool
    #: Whether a MERGE of whole-row changes deletes and re-inserts the changed rows instead of
    #: updating them (``merge.py``: ``merge_statement``): cheaper on Sail, which then reads only the
    #: target's key columns; dearer on Delta on Spark, whose MERGE then joins the source twice over
    #: (docs/engine-notes.md, "The costs a user sees first").
    merge_delete_and_insert: bool = True
    #: Whether a snapshot's rows are written by delta-rs in pgcdc's process into a table the engine
    #: created (Delta on Spark: its protocol and properties; ``snapshot_writes.py``), where the table's
    #: protocol, schema and partitioning allow it, instead of by the engine's own overwrite
    #: (docs/engine-notes.md, "Snapshots on Spark: the engine creates, delta-rs writes the rows").
    delta_rs_snapshot_rows: bool = False


_DETECTED: weakref.WeakKeyDictionary[SparkSession, EngineCapabilities] = weakref.WeakKeyDictionary()


def engine_capabilities(spark: SparkSession) -> EngineCapabilities:
    """Detected once per session, by asking for the history of a path that holds no table.

    Delta on Spark answers that the table does not exist (an analysis error naming Delta); an
    engine without the command fails to parse it. Any other outcome counts as "no": the
    common path is always correct.
    """
    known = _DETECTED.get(spark)
    if known is None:
        delta_commands = _has_describe_history(spark)
        known = EngineCapabilities(
            delta_commands=delta_commands,
            delta_rs_snapshots=not delta_commands,
            merge_delete_and_insert=not delta_commands,
            delta_rs_snapshot_rows=delta_commands,
        )
        _DETECTED[spark] = known
    return known


SAIL_CAPABILITIES = EngineCapabilities(delta_commands=False, delta_rs_snapshots=True, merge_delete_and_insert=True)
"""What embedded Sail 0.7.2 can do: an engine pgcdc started itself is known, not probed (the probe
is a fresh engine's first statement: 0.3-0.6 s on Sail, 4-7 s on a fresh JVM)."""

DELTA_SPARK_CAPABILITIES = EngineCapabilities(
    delta_commands=True, delta_rs_snapshots=False, merge_delete_and_insert=False, delta_rs_snapshot_rows=True
)
"""What the managed Apache Spark with Delta's jars can do (declared like :data:`SAIL_CAPABILITIES`)."""


def set_engine_capabilities(spark: SparkSession, capabilities: EngineCapabilities) -> None:
    """Use ``capabilities`` for ``spark`` instead of detecting them: an engine pgcdc starts itself
    (``resources/engines/engine.py``) declares them; ``bench.snapshot`` measures both snapshot writers
    on one engine this way."""
    _DETECTED[spark] = capabilities


#: Spark Connect's client logs every failed call here at ERROR ("GRPC Error received"), with the
#: traceback, once anything (Dagster's logging set-up, say) has enabled its loggers.
CONNECT_CLIENT_LOGGER = "pyspark.sql.connect.logging"


class _OnThread(logging.Filter):
    """Drops the records of one thread: the probe's expected refusal, not another thread's failure."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread


@contextmanager
def expected_refusal() -> Iterator[None]:
    """The client logs nothing for a call of this thread expected to fail; other threads log as before."""
    logger = logging.getLogger(CONNECT_CLIENT_LOGGER)
    on_this_thread = _OnThread()
    logger.addFilter(on_this_thread)
    try:
        yield
    finally:
        logger.removeFilter(on_this_thread)


def _has_describe_history(spark: SparkSession) -> bool:
    probe = f"/nonexistent-pgcdc-capability-probe-{uuid.uuid4().hex}"
    try:
        with expected_refusal():
            spark.sql(f"DESCRIBE HISTORY delta.`{probe}`").collect()
    except Exception as error:  # noqa: BLE001 - the kind of refusal is the answer
        condition = getattr(error, "getCondition", lambda: None)() or ""
        return condition.startswith("DELTA_")
    return True
