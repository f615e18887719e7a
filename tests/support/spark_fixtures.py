"""One embedded Sail engine for the whole test session: starting it per test would dominate."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from resources.engines.engine import SparkEngine


@pytest.fixture(scope="session")
def spark_engine() -> Iterator[SparkEngine]:
    with SparkEngine.embedded() as engine:
        yield engine


@pytest.fixture(scope="session")
def spark(spark_engine: SparkEngine) -> SparkSession:
    return spark_engine.spark
