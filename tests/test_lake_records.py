"""pgcdc's JSON records in the lake: written whole, read back by key, listed, deleted; locally and on S3."""

from __future__ import annotations

from pathlib import Path

from resources.delta.lake_records import delete_record, read_record, read_records, records_location, write_record
from tests.support.s3_fixtures import S3Server

pytest_plugins = ["tests.support.s3_fixtures"]

ODD_KEYS = ['public."Order Items"', "café.a$b", "a/b.c", "order-items", "order_items", ".hidden"]


def _round_trip(root: str, lake: object) -> None:
    location = records_location(root, "quarantine", "slot_a")
    assert read_records(location, lake) == {}  # type: ignore[arg-type]
    assert read_record(location, "missing", lake) is None  # type: ignore[arg-type]
    for number, key in enumerate(ODD_KEYS):
        write_record(location, key, {"n": number}, lake)  # type: ignore[arg-type]
    write_record(location, ODD_KEYS[0], {"n": 99}, lake)  # type: ignore[arg-type]
    assert read_records(location, lake) == {  # type: ignore[arg-type]
        key: {"n": 99 if key == ODD_KEYS[0] else number} for number, key in enumerate(ODD_KEYS)
    }
    assert read_record(location, "a/b.c", lake) == {"n": 2}  # type: ignore[arg-type]
    delete_record(location, "a/b.c", lake)  # type: ignore[arg-type]
    delete_record(location, "a/b.c", lake)  # type: ignore[arg-type]
    assert "a/b.c" not in read_records(location, lake)  # type: ignore[arg-type]
    assert read_records(records_location(root, "quarantine", "other_slot"), lake) == {}  # type: ignore[arg-type]


def test_records_round_trip_on_a_local_lake(tmp_path: Path) -> None:
    _round_trip(str(tmp_path / "lake"), None)
    records = tmp_path / "lake" / "_pgcdc" / "quarantine" / "slot_a"
    leftovers = [p.name for p in records.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_records_round_trip_on_object_storage(s3_server: S3Server, s3_root: str) -> None:
    _round_trip(s3_root, s3_server.lake(s3_root))
