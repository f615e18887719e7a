"""pgcdc's own small records in the lake: JSON objects below ``<delta.root>/_pgcdc/<kind>/<slot>/``.

Unlike the state table (a cache, rebuilt from each table's log), a record is the truth of a
fact no Delta log holds: the slot position pgcdc allowed (``resources/runs/slot_guard.py``) and
the tables a drain quarantined (``resources/runs/quarantine.py``). So each is one object,
written whole and atomically (a local file by rename, an object by one PUT), read in one GET,
and listed in one LIST: a drain that meets no fault reads a kind once and writes nothing.

Names inside a kind are encoded (``record_name``) so any PostgreSQL table name, quotes, dots,
slashes and non-ASCII letters included, is one flat, reversible object name.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any
from urllib.parse import quote, unquote

from resources.delta.lake_storage import LakeStorage, storage_client
from resources.delta.state_table import PGCDC_TABLES_DIRECTORY
from resources.locations import join_location

RECORD_SUFFIX = ".json"


def records_location(root: str, kind: str, slot: str) -> str:
    """``<delta.root>/_pgcdc/<kind>/<slot>``: the records of one kind of one slot's pipeline."""
    return join_location(root, PGCDC_TABLES_DIRECTORY, kind, slot)


def record_name(key: str) -> str:
    """``key`` as one flat object name: percent-encoded, dots included, so ``/``, quotes and spaces
    cannot split it and no name starts with a dot (a temporary file's), and ``record_key`` gives the
    key back."""
    return quote(key, safe="").replace(".", "%2E") + RECORD_SUFFIX


def record_key(name: str) -> str:
    return unquote(name.removesuffix(RECORD_SUFFIX))


def write_record(location: str, key: str, value: dict[str, Any], lake: LakeStorage | None) -> None:
    """Replace the record ``key`` below ``location`` with ``value``, atomically: a reader sees the
    old record or the new one, never part of one (locally a temporary file renamed over it,
    fsynced first so a crash after the rename leaves the whole record)."""
    filesystem, directory = storage_client(location, lake)
    data = json.dumps(value, sort_keys=True).encode()
    target = f"{directory}/{record_name(key)}"
    if lake is not None and lake.is_object_store and location.startswith(lake.root.rstrip("/") + "/"):
        with filesystem.open_output_stream(target) as stream:  # type: ignore[attr-defined]
            stream.write(data)
        return
    os.makedirs(directory, exist_ok=True)
    temporary = f"{directory}/.{uuid.uuid4().hex}.tmp"
    with open(temporary, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, target)
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def read_records(location: str, lake: LakeStorage | None) -> dict[str, dict[str, Any]]:
    """Every record below ``location`` by key; empty when there is none (or no directory yet)."""
    from pyarrow import fs

    filesystem, directory = storage_client(location, lake)
    try:
        infos = filesystem.get_file_info(fs.FileSelector(directory, allow_not_found=True))  # type: ignore[attr-defined]
    except FileNotFoundError:
        return {}
    records = {}
    for info in infos:
        name = info.path.rsplit("/", 1)[-1]
        if info.type != fs.FileType.File or not name.endswith(RECORD_SUFFIX) or name.startswith("."):
            continue
        with filesystem.open_input_stream(info.path) as stream:  # type: ignore[attr-defined]
            records[record_key(name)] = json.loads(stream.read())
    return records


def read_record(location: str, key: str, lake: LakeStorage | None) -> dict[str, Any] | None:
    """The record ``key`` below ``location``, or None when there is none."""
    filesystem, directory = storage_client(location, lake)
    try:
        with filesystem.open_input_stream(f"{directory}/{record_name(key)}") as stream:  # type: ignore[attr-defined]
            return json.loads(stream.read())
    except FileNotFoundError:
        return None


def delete_record(location: str, key: str, lake: LakeStorage | None) -> None:
    """Remove the record ``key`` below ``location``; nothing when it is already gone."""
    filesystem, directory = storage_client(location, lake)
    try:
        filesystem.delete_file(f"{directory}/{record_name(key)}")  # type: ignore[attr-defined]
    except FileNotFoundError:
        pass
