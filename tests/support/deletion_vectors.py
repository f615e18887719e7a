"""Which tables of a lake carry deletion vectors, for the tests that run the same workload on a lake
mixing tables with them (pgcdc's default) and copy-on-write tables (``delta.deletion_vectors_tables``
set to false): the check that the mix is what the test says it covers."""

from __future__ import annotations

import deltalake

from resources.config import PgcdcConfig
from resources.delta.lake_storage import LakeStorage


def has_deletion_vectors(path: str, storage_options: dict[str, str] | None = None) -> bool:
    """Whether the table's protocol names the deletionVectors reader feature (what readers refuse)."""
    protocol = deltalake.DeltaTable(path, storage_options=storage_options or None).protocol()
    return "deletionVectors" in (protocol.reader_features or [])


def assert_deletion_vectors(config: PgcdcConfig, expected: dict[str, bool]) -> None:
    """Each ``schema.table`` of ``expected`` has deletion vectors exactly when it says so."""
    options = LakeStorage(config.delta.root, config.delta.storage).object_store_options()
    found = {name: has_deletion_vectors(config.table_path(*name.split(".", 1)), options) for name in expected}
    assert found == expected, f"deletion vectors per table: {found}, expected {expected}"
