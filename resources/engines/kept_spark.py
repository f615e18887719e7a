"""The managed Spark JVM kept between runs (``spark.keep_alive_s`` > 0), stopped by itself when idle.

A JVM that starts for every run makes every scheduled drain pay its start and a cold first MERGE
(class loading, code generation, the JIT: a fresh JVM's drain of 160k changes took 10x Sail's, a
kept JVM's later drains 3x; docs/benchmarks.md). So the first run starts a server that outlives
it, the runs after it reuse it, and the server stops itself ``keep_alive_s`` after the last run
left it.

* One server per user, host and configuration: its state lives in a private directory (0700)
  ``<servers_dir()>/<key>/``, ``key`` a keyed hash of everything the JVM is started with (master,
  settings and jars, the lake's environment, credentials included: they never appear in clear; the
  hash's key is a random secret of the user's, so the name tells nothing of them either).
  ``server.json`` there holds the port and the pids, nothing secret.
* ``start.lock`` (``flock``) serializes starting and attaching: two runs starting at once share
  one server, and a run finding a dead or silent server (its recorded pids gone, or no answer to
  an HTTP/2 connection preface: :meth:`ServerState.answers`) stops what is left of it and starts a
  new one.
* A run holds a lease while it uses the server: a shared ``flock`` on ``lease``, which the kernel
  releases when the run ends, even by SIGKILL. A run takes it under ``start.lock``, so the server
  cannot be stopping meanwhile.
* The supervisor, this module run as ``python -m resources.engines.kept_spark``, is detached from the
  run (its own session, reparented away from the run), starts the JVM in a process group of its own
  with SIGKILL on the supervisor's death (``PR_SET_PDEATHSIG``, as for a run's own JVM), and polls
  the lease: once nobody has held it for ``keep_alive_s`` it takes ``start.lock``, stops the JVM's
  whole group and removes the directory. SIGTERM stops it at once (``pgcdc spark-server --stop``).
  Whatever way the supervisor ends, the JVM ends with it.

The JVM listens on the loopback address only, as a run's own does: Spark Connect has no
authentication of its own.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyspark

from resources.engines.spark_server import (
    DEFAULT_START_TIMEOUT_S,
    free_port,
    start_jvm,
    START_TIMEOUT_ENV,
    stop_group,
    wait_listening,
)
from resources.errors import ConfigurationError

SERVERS_DIR_ENV = "PGCDC_SPARK_SERVERS"
ANSWER_TIMEOUT_ENV = "PGCDC_SPARK_ANSWER_TIMEOUT"
DEFAULT_ANSWER_TIMEOUT_S = 10.0
"""How long a kept server may take to answer before a run stops it and starts another: far above a
warm JVM's garbage-collection pauses (the parallel collector, a 1 GiB heap: well under a second). A
host whose load starves the JVM for longer (a JVM just started, under many busy processes on few
cores) raises it (``$PGCDC_SPARK_ANSWER_TIMEOUT``, seconds): a server taken for silent is stopped under
the runs that use it, which then fail; a longer wait costs only a run that finds its server stuck."""
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
"""An HTTP/2 client's connection preface, then its (empty) SETTINGS frame (RFC 9113, 3.4)."""
FRAME_HEAD_BYTES = 9
SETTINGS_FRAME = 4
"""The type of the frame an HTTP/2 server sends first (its connection preface), in byte 3 of its head."""
POLL_S = 0.5
"""How often the supervisor looks at the lease: a ``flock`` call, nothing the machine notices."""

JVM_ENVIRONMENT_PREFIXES = ("AWS_", "AZURE_", "GOOGLE_")
"""Environment variables the JVM's storage clients may read (credentials chains): a run whose values
differ gets a server of its own."""
JVM_ENVIRONMENT = (
    "JAVA_HOME", "JAVA_TOOL_OPTIONS", "JDK_JAVA_OPTIONS", "_JAVA_OPTIONS", "HADOOP_CONF_DIR", "HADOOP_HOME",
    "HADOOP_USER_NAME", "SPARK_CONF_DIR", "SPARK_LOCAL_DIRS", "TMPDIR",
)  # fmt: skip
"""The JVM's own environment, named one by one: PySpark's client sets variables of its own
(``SPARK_CONNECT_MODE_ENABLED``, ``SPARK_REMOTE``) in a run's process once it has a session."""

STATE_FILE = "server.json"
START_LOCK = "start.lock"
LEASE = "lease"
WORK = "work"


def servers_dir() -> Path:
    """Where kept servers' state lives: ``$PGCDC_SPARK_SERVERS``, else ``~/.cache/pgcdc/spark-servers``."""
    configured = os.environ.get(SERVERS_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "pgcdc" / "spark-servers"


def answer_timeout_s() -> float:
    """:data:`DEFAULT_ANSWER_TIMEOUT_S`, or ``$PGCDC_SPARK_ANSWER_TIMEOUT`` when set (before any server is
    touched: a bad value stops no server)."""
    value = os.environ.get(ANSWER_TIMEOUT_ENV)
    if value is None:
        return DEFAULT_ANSWER_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise ConfigurationError(
            f"${ANSWER_TIMEOUT_ENV} is {value!r}, not a number of seconds above 0",
            f"set it to the seconds a kept Spark JVM may take to answer (say 60) or unset it ({DEFAULT_ANSWER_TIMEOUT_S:.0f} s)",
        )
    return seconds


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _hash_key() -> bytes:
    """The user's random key for :func:`server_key`, made once (0600, beside the servers' directories)."""
    path = _private_dir(servers_dir()) / "key"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        for _ in range(50):  # another process may be writing it this instant
            key = path.read_bytes()
            if len(key) == 32:
                return key
            time.sleep(0.01)
        raise
    key = secrets.token_bytes(32)
    with os.fdopen(fd, "wb") as file:
        file.write(key)
    return key


def server_key(master: str, config: Mapping[str, str], environment: Mapping[str, str]) -> str:
    """The name of the server for this JVM: a keyed hash of all it is started with."""
    jvm_environment = {
        name: value
        for name, value in os.environ.items()
        if name.startswith(JVM_ENVIRONMENT_PREFIXES) or name in JVM_ENVIRONMENT
    }
    payload = json.dumps(
        {
            "master": master,
            "config": dict(config),
            "environment": {**jvm_environment, **environment},
            "python": sys.executable,
            "pyspark": pyspark.__version__,
        },
        sort_keys=True,
    )
    return hashlib.blake2b(payload.encode(), key=_hash_key(), digest_size=16).hexdigest()


def _process_start(pid: int) -> int | None:
    """The start time of a live process (clock ticks since boot), None when gone or a zombie:
    with the pid it tells a process from a later one that reused its pid."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


@dataclass(frozen=True)
class ServerState:
    """``server.json``: where the server listens and which processes are its own."""

    port: int
    jvm_pid: int
    jvm_start: int
    supervisor_pid: int
    supervisor_start: int
    started_at: float
    keep_alive_s: int

    @classmethod
    def read(cls, directory: Path) -> ServerState | None:
        try:
            return cls(**json.loads((directory / STATE_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def write(self, directory: Path) -> None:
        partial = directory / f"{STATE_FILE}.part"
        with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as file:
            file.write(json.dumps(self.__dict__))
        partial.replace(directory / STATE_FILE)

    def supervisor_alive(self) -> bool:
        return _process_start(self.supervisor_pid) == self.supervisor_start

    def jvm_alive(self) -> bool:
        return _process_start(self.jvm_pid) == self.jvm_start

    def answers(self, timeout_s: float) -> bool:
        """Both processes are the recorded ones and the server speaks HTTP/2, as gRPC does: it answers a
        client's connection preface with its SETTINGS frame within ``timeout_s`` (:func:`answer_timeout_s`).

        A port that takes connections is not enough: the kernel accepts them for a JVM that is stopped
        or stuck (collecting garbage it cannot free), and a run attached to it waits and fails, as does
        every run after it, whose leases keep it from ever idling out."""
        if not (self.supervisor_alive() and self.jvm_alive()):
            return False
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s) as connection:
                connection.sendall(HTTP2_PREFACE)
                head = b""
                while len(head) < FRAME_HEAD_BYTES:
                    received = connection.recv(FRAME_HEAD_BYTES - len(head))
                    if not received:
                        return False
                    head += received
                return head[3] == SETTINGS_FRAME
        except OSError:
            return False


def _open_start_lock(directory: Path, blocking: bool) -> int | None:
    """``start.lock`` held exclusively (None: busy, when not ``blocking``). A supervisor removes the
    directory while holding it, so a lock taken on a file since unlinked is retried on the new one."""
    while True:
        _private_dir(directory)
        path = directory / START_LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:  # the directory went between mkdir and open
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


@contextmanager
def _start_lock(directory: Path) -> Iterator[None]:
    fd = _open_start_lock(directory, blocking=True)
    assert fd is not None
    try:
        yield
    finally:
        os.close(fd)


def _take_lease(directory: Path) -> int:
    """A shared ``flock`` on ``lease``, held until the fd closes (or the process ends)."""
    fd = os.open(directory / LEASE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


@dataclass
class KeptServer:
    """A run's use of a kept server: its address and processes, and the run's lease on it."""

    state: ServerState
    started_now: bool
    start_seconds: float
    _lease: int | None

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.state.port}"

    def describe(self) -> str:
        """One line for the run's log: a JVM started now (and its start) or reused (and its age)."""
        if self.started_now:
            return (
                f"started a Spark JVM (pid {self.state.jvm_pid}) in {self.start_seconds:.1f} s; it serves the runs "
                f"after this one and stops {self.state.keep_alive_s} s after the last (spark.keep_alive_s)"
            )
        age = time.time() - self.state.started_at
        return (
            f"reused the Spark JVM pid {self.state.jvm_pid}, started {age:.0f} s ago "
            f"(attached in {self.start_seconds:.2f} s)"
        )

    def release(self) -> None:
        """Give the lease back: the server idles out ``keep_alive_s`` after the last one goes."""
        if self._lease is not None:
            os.close(self._lease)
            self._lease = None


def attach(master: str, config: Mapping[str, str], environment: Mapping[str, str], keep_alive_s: int) -> KeptServer:
    """A lease on the kept server for this configuration, started now when there is none that answers.

    ``environment`` (the lake's credentials) reaches the JVM through its environment, never its
    command line. Raises ``RuntimeError`` with the server's one-line reason when it cannot start."""
    began = time.monotonic()
    timeout_s = answer_timeout_s()  # a bad setting is one line before any server is probed
    directory = servers_dir() / server_key(master, config, environment)
    with _start_lock(directory):
        state = ServerState.read(directory)
        if state is not None and state.answers(timeout_s):
            return KeptServer(state, False, time.monotonic() - began, _take_lease(directory))
        if state is not None or (directory / WORK).exists():
            _clean_stale(directory, state)
        state = _start_supervisor(directory, master, config, environment, keep_alive_s)
        return KeptServer(state, True, time.monotonic() - began, _take_lease(directory))


def _clean_stale(directory: Path, state: ServerState | None) -> None:
    """Stop what is left of a server that died or stopped answering, and remove its files."""
    if state is not None and state.supervisor_alive():
        os.kill(state.supervisor_pid, signal.SIGTERM)  # it stops the JVM's group
        deadline = time.monotonic() + 30
        while state.supervisor_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if state.supervisor_alive():
            os.kill(state.supervisor_pid, signal.SIGKILL)  # the JVM gets SIGKILL with it (PR_SET_PDEATHSIG)
    if state is not None and state.jvm_alive():
        os.killpg(state.jvm_pid, signal.SIGKILL)
    for name in (STATE_FILE, LEASE):
        (directory / name).unlink(missing_ok=True)
    shutil.rmtree(directory / WORK, ignore_errors=True)


def _start_supervisor(
    directory: Path, master: str, config: Mapping[str, str], environment: Mapping[str, str], keep_alive_s: int
) -> ServerState:
    request = {"directory": str(directory), "master": master, "config": dict(config), "keep_alive_s": keep_alive_s}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "resources.engines.kept_spark", json.dumps(request)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **environment},
        start_new_session=True,
    )
    assert launcher.stdout is not None and launcher.stderr is not None
    with launcher.stdout, launcher.stderr:
        ready = launcher.stdout.readline().strip()  # the supervisor (the launcher's child) says when the JVM listens
        launcher.wait()  # the launcher exits at once, so the supervisor belongs to no run
        if ready != b"ready":
            reason = launcher.stderr.read().decode(errors="replace").strip().splitlines()
            raise RuntimeError(reason[-1] if reason else "the supervisor exited")
    state = ServerState.read(directory)
    if state is None:
        raise RuntimeError(f"the supervisor wrote no {directory / STATE_FILE}")
    return state


def stop_all() -> list[int]:
    """SIGTERM every kept server's supervisor (each stops its JVM and removes its state) and wait
    for them; returns the JVM pids stopped."""
    root = servers_dir()
    states = (
        [state for path in root.iterdir() if (state := ServerState.read(path)) is not None] if root.is_dir() else []
    )
    stopped = []
    for state in states:
        if state.supervisor_alive():
            os.kill(state.supervisor_pid, signal.SIGTERM)
            stopped.append(state)
    deadline = time.monotonic() + 60
    while any(state.supervisor_alive() for state in stopped) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [state.jvm_pid for state in stopped]


class _Supervisor:
    """The detached process that owns the JVM: it starts it, reports, and stops it when idle or told to."""

    def __init__(self, directory: Path, keep_alive_s: int) -> None:
        self.directory = directory
        self.keep_alive_s = keep_alive_s
        self.stop = threading.Event()

    def start(self, master: str, config: Mapping[str, str]) -> tuple[subprocess.Popen[bytes], ServerState]:
        work = self.directory / WORK
        shutil.rmtree(work, ignore_errors=True)
        _private_dir(work)
        log_path = work / "server.log"
        port = free_port()
        jvm = start_jvm(master, port, config, log_path, work)
        try:
            wait_listening(port, jvm, float(os.environ.get(START_TIMEOUT_ENV, DEFAULT_START_TIMEOUT_S)), log_path)
        except BaseException:
            stop_group(jvm)
            raise
        jvm_start, own_start = _process_start(jvm.pid), _process_start(os.getpid())
        assert jvm_start is not None and own_start is not None
        state = ServerState(port, jvm.pid, jvm_start, os.getpid(), own_start, time.time(), self.keep_alive_s)
        (self.directory / LEASE).touch(mode=0o600)
        state.write(self.directory)
        return jvm, state

    def leased(self, lease_fd: int) -> bool:
        """Whether a run holds a lease: no exclusive lock while any shared one is held."""
        try:
            fcntl.flock(lease_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lease_fd, fcntl.LOCK_UN)
        return False

    def serve(self, jvm: subprocess.Popen[bytes]) -> None:
        """Until the JVM ends, SIGTERM, or ``keep_alive_s`` without a lease; then the JVM's group stops."""
        lease_fd = os.open(self.directory / LEASE, os.O_RDWR | os.O_CLOEXEC)
        last_used = time.monotonic()
        while not self.stop.wait(POLL_S) and jvm.poll() is None:
            if self.leased(lease_fd):
                last_used = time.monotonic()
                continue
            if time.monotonic() - last_used < self.keep_alive_s:
                continue
            lock = _open_start_lock(self.directory, blocking=False)
            if lock is None:  # a run is attaching: it will take a lease
                continue
            if self.leased(lease_fd):
                os.close(lock)
                last_used = time.monotonic()
                continue
            (self.directory / STATE_FILE).unlink(missing_ok=True)  # no run finds it from here on
            stop_group(jvm)
            self._remove(lock)
            return
        stop_group(jvm)
        lock = _open_start_lock(self.directory, blocking=False)
        if lock is not None:  # else a run holds it, finds this server dead and cleans up
            state = ServerState.read(self.directory)
            if state is None or state.supervisor_pid == os.getpid():
                self._remove(lock)
            else:
                os.close(lock)

    def _remove(self, lock: int) -> None:
        """Remove the server's directory, ``start.lock`` last, while holding it."""
        shutil.rmtree(self.directory / WORK, ignore_errors=True)
        for name in (STATE_FILE, LEASE, START_LOCK):
            (self.directory / name).unlink(missing_ok=True)
        try:
            self.directory.rmdir()
        except OSError:
            pass
        os.close(lock)


def main() -> int:
    """The launcher, then (its child) the supervisor: argv[1] is JSON ``{"directory", "master",
    "config", "keep_alive_s"}``. Prints ``ready`` once the JVM listens and ``server.json`` is written,
    or the reason it did not start on stderr."""
    request: dict[str, Any] = json.loads(sys.argv[1])
    if os.fork() > 0:
        os._exit(0)  # the launcher: the supervisor is now nobody's child but init's (or a subreaper's)
    supervisor = _Supervisor(Path(request["directory"]), int(request["keep_alive_s"]))
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda signum, frame: supervisor.stop.set())
    os.chdir("/")
    try:
        jvm, _state = supervisor.start(request["master"], request["config"])
    except RuntimeError as error:
        print(error, file=sys.stderr, flush=True)
        return 1
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the run that started it stops reading; nothing more is written there
        os.dup2(devnull, fd)
    supervisor.serve(jvm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
