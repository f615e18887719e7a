"""The slot guard's record (resources/runs/slot_guard.py) in the lake, locally and on S3: written only
when the allowed position moves, a gap kept by later positions, a slot created anew."""

from __future__ import annotations

from pathlib import Path

from resources.delta.lake_storage import LakeStorage
from resources.lsn import LSN
from resources.runs.slot_guard import SlotGuard, SlotRecord
from tests.support.s3_fixtures import S3Server

pytest_plugins = ["tests.support.s3_fixtures"]


def _round_trip(root: str, lake: LakeStorage | None) -> None:
    guard = SlotGuard(root, "pgcdc_slot", lake)
    assert guard.read() is None
    guard.created(LSN.parse("0/100"))  # a first slot: nothing copied before it
    assert SlotGuard(root, "pgcdc_slot", lake).read() == SlotRecord(LSN.parse("0/100"))
    guard.allow(LSN.parse("0/200"))
    guard.allow(LSN.parse("0/180"))  # behind the record: nothing written
    assert SlotGuard(root, "pgcdc_slot", lake).read() == SlotRecord(LSN.parse("0/200"))

    gap = (LSN.parse("0/200"), LSN.parse("1/0"))
    guard.write(SlotRecord(LSN.parse("1/0"), gap))
    guard.allow(LSN.parse("1/10"))  # a later confirm keeps the gap
    assert SlotGuard(root, "pgcdc_slot", lake).read() == SlotRecord(LSN.parse("1/10"), gap)
    guard.created(LSN.parse("2/0"))  # a slot created anew where the lake recorded one: a gap from nothing
    assert SlotGuard(root, "pgcdc_slot", lake).read() == SlotRecord(LSN.parse("2/0"), (None, LSN.parse("2/0")))
    assert SlotGuard(root, "other_slot", lake).read() is None


def test_the_slot_record_on_a_local_lake(tmp_path: Path) -> None:
    _round_trip(str(tmp_path / "lake"), None)
    assert [p.name for p in (tmp_path / "lake" / "_pgcdc" / "slots" / "pgcdc_slot").iterdir()] == ["position.json"]


def test_the_slot_record_on_object_storage(s3_server: S3Server, s3_root: str) -> None:
    _round_trip(s3_root, s3_server.lake(s3_root))
