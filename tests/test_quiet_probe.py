"""Success is quiet: the engine-capability probe's expected refusal logs nothing at ERROR.

Spark Connect's client logs every failed call at ERROR with its traceback ("GRPC Error received")
once its logger is enabled, which Dagster's logging set-up does; a first user read those lines,
from the probe (``DESCRIBE HISTORY`` on Sail, expected to fail), as a broken install.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from resources.engines import capabilities
from resources.engines.capabilities import CONNECT_CLIENT_LOGGER

pytest_plugins = ["tests.support.spark_fixtures"]


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def client_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[Records]:
    """The Connect client's logger enabled, as under Dagster, its records kept."""
    logger = logging.getLogger(CONNECT_CLIENT_LOGGER)
    monkeypatch.setattr(logger, "disabled", False)
    records = Records()
    logger.addHandler(records)
    try:
        yield records
    finally:
        logger.removeHandler(records)


def test_the_probe_logs_nothing_and_a_real_failure_still_logs(spark: SparkSession, client_log: Records) -> None:
    assert capabilities._has_describe_history(spark) is False  # embedded Sail has no DESCRIBE HISTORY
    assert [record.getMessage() for record in client_log.records] == []
    with pytest.raises(Exception, match="HISTORY"):
        spark.sql("DESCRIBE HISTORY delta.`/nonexistent-pgcdc-test`").collect()
    assert [record.levelno for record in client_log.records] == [logging.ERROR]
    assert logging.getLogger(CONNECT_CLIENT_LOGGER).filters == []
