"""Keys of every shape and replica identity changes, against PostgreSQL's own subscriber.

One table per key type pgcdc maps (docs/type-mapping.md), multi-column keys mixing them, a primary
key with INCLUDE columns and a unique NOT NULL index as the replica identity. Each goes through
a snapshot, then drains of inserts, updates that move keys, payload updates (with unchanged TOAST),
deletes and a TRUNCATE; between drains the replica identity of several tables changes the way
routine DDL changes it (FULL, USING INDEX, NOTHING and back, a new primary key, a dropped one, a
key column widened). The subscriber gets the same DDL, so it stays a valid oracle. After every drain
each Delta table equals the subscriber's, every row sits in its bucket, and the run says which
tables lost their bucket pruning. Run in both snapshot modes: one snapshot, and key ranges (integer
keys only; the other keys fall back to one snapshot, as documented).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from resources.config import PgcdcConfig
from resources.lsn import LSN
from tests.support.key_shapes import IDENTITY_CHANGES, key_shapes_config, key_shapes_ddl, run_key_shapes, SHAPES
from tests.support.postgres import PgDatabase
from tests.support.subscriber_oracle import Subscriber

pytest_plugins = ["tests.support.spark_fixtures", "tests.support.subscriber_oracle"]
pytestmark = pytest.mark.slow  # PostgreSQL subscribers beside each key shape; tiers: docs/testing.md


@dataclass
class SubscriberOracle:
    subscriber: Subscriber

    def mirror(self, sql: str) -> None:
        with self.subscriber.connect() as replica:
            replica.execute(sql)

    def caught_up(self, lsn: LSN) -> None:
        self.subscriber.wait_for(lsn)

    def assert_matches_delta(self, config: PgcdcConfig) -> dict[str, int]:
        return self.subscriber.assert_matches_delta(config)


@pytest.mark.parametrize("chunked", [False, True], ids=["one_snapshot", "key_ranges"])
def test_every_key_shape_and_replica_identity_change_matches_the_subscriber(
    pg: PgDatabase, tmp_path: Path, spark: SparkSession, subscribe: Callable[[str], Subscriber], chunked: bool
) -> None:
    pg.execute(key_shapes_ddl(SHAPES))
    oracle = SubscriberOracle(subscribe("pub"))
    config = key_shapes_config(pg, tmp_path / "lake", chunked)
    run_key_shapes(pg, config, spark, oracle, SHAPES, IDENTITY_CHANGES, 150, ("k_text", "k_array", "k_include"))
