"""What the bad-storage and bad-grant tests share: a small pipeline, real small volumes (tmpfs mounts the
test makes and removes), a child run as an unprivileged OS user, and the checks every case ends with: one
line naming cause and fix, nothing confirmed to the slot past what Delta holds, and exact after the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from resources.config import PgcdcConfig
from resources.delta.lake_storage import LakeStorage
from resources.lsn import LSN
from resources.runs.slot_guard import SlotGuard
from resources.testing.verify import assert_delta_equals_postgres
from tests.support.postgres import PgDatabase

REPO = Path(__file__).resolve().parents[2]
SLOT = "pgcdc_slot"

#: A keyed table, a keyless one and a REPLICA IDENTITY FULL one (the last two carry applied markers).
DDL = """
    CREATE TABLE orders (id int PRIMARY KEY, amount numeric(10,2));
    CREATE TABLE notes (body text);
    CREATE TABLE tally (k int, note text);
    ALTER TABLE tally REPLICA IDENTITY FULL;
    INSERT INTO orders SELECT g, g * 1.5 FROM generate_series(1, 50) g;
    INSERT INTO notes VALUES ('first');
    INSERT INTO tally VALUES (1, 'same'), (1, 'same');
"""
TABLES = {"orders": ("id",), "notes": (), "tally": ()}
PENDING = """
    INSERT INTO orders VALUES (51, 1); UPDATE orders SET amount = 0 WHERE id < 5; DELETE FROM orders WHERE id = 9;
    INSERT INTO notes VALUES ('x'), ('x');
    UPDATE tally SET note = 'changed' WHERE ctid = (SELECT min(ctid) FROM tally);
"""

#: Rows of about a kilobyte of random hex each (Parquet cannot shrink them much): ``BLOB_ROWS`` of them
#: do not fit a volume of ``SMALL_VOLUME``.
BLOB_DDL = "CREATE TABLE blob (id int PRIMARY KEY, body text)"
BLOB_ROWS = """
    INSERT INTO blob SELECT g, (SELECT string_agg(md5(random()::text || i), '') FROM generate_series(g, g + 29) i)
    FROM generate_series(%s::int, %s::int) g
"""
SMALL_VOLUME = "1m"


def settings(dsn: str, root: str | Path, **overrides: Any) -> dict[str, Any]:
    return {"postgres": {"dsn": dsn}, "publication": "pub", "slot": SLOT, "delta": {"root": str(root)}, **overrides}


def confirmed(pg: PgDatabase) -> LSN:
    ((value,),) = pg.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (SLOT,))
    return LSN.parse(value)


def one_line(error: BaseException | str, *fragments: str, secret: str | None = None) -> str:
    """The failure as a user sees it: one line, naming each of ``fragments``, no traceback, no secret."""
    text = str(error).strip()
    assert "\n" not in text and "Traceback" not in text, f"not one line:\n{text}"
    for fragment in fragments:
        assert fragment in text, text
    assert secret is None or secret not in text, text
    return text


def assert_nothing_confirmed_past_delta(pg: PgDatabase, config: PgcdcConfig, before: LSN) -> None:
    """The failed run confirmed nothing (the slot is where it was), and the slot is not beyond the
    position the lake records for it (the record is written before every confirm that moves it)."""
    now = confirmed(pg)
    assert now == before, f"the slot moved from {before} to {now} on a failed run"
    lake = LakeStorage(config.delta.root, config.delta.storage) if "://" in config.delta.root else None
    record = SlotGuard(config.delta.root, config.slot, lake).read()
    assert record is None or now <= record.allowed, (now, record)


def assert_exact(pg: PgDatabase, config: PgcdcConfig, tables: Sequence[str] = tuple(TABLES), **options: Any) -> None:
    """Delta equals PostgreSQL, value for value with multiplicity, for every table named."""
    for table in tables:
        key = TABLES.get(table, ("id",))
        assert_delta_equals_postgres(pg.dsn, f"public.{table}", config.table_path("public", table), key=key, **options)


@contextmanager
def small_volume(path: Path, size: str = SMALL_VOLUME) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` for the test, unmounted after (lazily: the engine's
    process may still hold a descriptor there)."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def grow(volume: Path, size: str = "64m") -> None:
    """The fix for a full volume: more room, the data on it kept."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(volume)], check=True)


def fill(volume: Path) -> Path:
    """Take every free byte of ``volume`` with one file; returns it (removing it is the fix)."""
    filler = volume / "filler"
    with open(filler, "wb") as out:
        try:
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        except OSError:
            pass
    return filler


NOBODY = 65534
"""The unprivileged user of every Debian system."""

_AS_USER = (
    # The interpreter lives below /root (mode 0700): in a mount namespace of the child's own, a
    # traversable tmpfs over /root carries only the interpreter's tree, bound back in place.
    'mount --bind /root/.pyenv "$STASH" && mount -t tmpfs -o mode=0755,size=1m tmpfs /root'
    ' && mkdir /root/.pyenv && mount --bind "$STASH" /root/.pyenv'
    ' && exec setpriv --reuid="$AS_UID" --regid="$AS_UID" --clear-groups "$@"'
)


def run_as_user(config: PgcdcConfig, workdir: Path, what: str, uid: int = NOBODY) -> subprocess.CompletedProcess[str]:
    """``tests.support.fault_child`` (``what``: ``snapshot`` or a chunk size, a drain) as the OS user ``uid``,
    with an embedded Sail engine of its own (so the engine writes as that user too). ``workdir`` (made
    readable here) holds the configuration and the user's home."""
    workdir.chmod(0o755)
    home, stash = workdir / "home", workdir / "stash"
    home.mkdir(exist_ok=True)
    stash.mkdir(exist_ok=True)
    os.chown(home, uid, uid)
    config_file = workdir / "pgcdc.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump()), encoding="utf-8")
    config_file.chmod(0o644)
    environment = {**os.environ, "HOME": str(home), "STASH": str(stash), "AS_UID": str(uid), "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "tests.support.fault_child", str(config_file), what]
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", _AS_USER, "sh", *command],
        env=environment, cwd=REPO, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip


def child_line(done: subprocess.CompletedProcess[str]) -> str:
    """The child's one line on stderr (Sail's own log lines left out); exit status 2 (a pgcdc error)."""
    lines = [line for line in done.stderr.splitlines() if line.strip() and " sail_" not in line]
    assert done.returncode == 2 and len(lines) == 1, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return lines[0]
