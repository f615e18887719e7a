"""Apache Spark with Delta Lake as an engine pgcdc starts and stops itself, like embedded Sail.

``spark.engine: spark`` (with ``spark.remote`` null) runs a Spark Connect server with Delta's
jars on ``local[N]`` as a child of pgcdc, and pgcdc talks Spark Connect to it exactly as it does
to Sail or to a remote cluster: one client code path for every engine.

The server runs under a small watchdog, this module run as ``python -m resources.engines.spark_server``,
with the protocol of ``resources.engines.sail_server``: it prints ``PORT PID`` once the JVM listens and
stops the JVM when its stdin closes, which also happens when pgcdc dies, even by SIGKILL. The JVM
runs in a process group of its own (so its children go with it) and gets SIGKILL when the watchdog
dies (``PR_SET_PDEATHSIG``): no way of ending pgcdc leaves a JVM behind. That is a run's own JVM
(``spark.keep_alive_s: 0``); a JVM kept for later runs has a detached supervisor instead, with the same
process group and death signal against it (``resources.engines.kept_spark``).

Versions (docs/engine-notes.md): Delta 4.4.0's Spark 4.1 build. Delta 4.1.0's jars fail every
``ALTER TABLE`` on pyspark 4.1.4 (``NoClassDefFoundError: IgnoreCachedData``), 4.2/4.3 on PyPI
pin pyspark<=4.1.1, and 4.4.1 has no jars on Maven Central; so the coordinate is pinned here,
not derived from whatever delta-spark pip resolved.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import pyspark

DELTA_VERSION = "4.4.0"
SPARK_MINOR = ".".join(pyspark.__version__.split(".")[:2])
DELTA_PACKAGE = f"io.delta:delta-spark_{SPARK_MINOR}_2.13:{DELTA_VERSION}"
"""What ``delta.pip_utils.configure_spark_with_delta_pip`` asks for with delta-spark 4.4.0."""

JAR_CACHE_ENV = "PGCDC_JAR_CACHE"
START_TIMEOUT_ENV = "PGCDC_SPARK_START_TIMEOUT"
DEFAULT_START_TIMEOUT_S = 600.0
"""A first start downloads Delta's jars (28 files, 85 MiB) from Maven Central: minutes on a slow
link; a warm start takes 15-40 s on two busy cores."""

DELTA_SQL_CONFIG: dict[str, str] = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}

SMALL_TABLE_CONFIG: dict[str, str] = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.databricks.delta.snapshotPartitions": "2",
    "spark.sql.sources.parallelPartitionDiscovery.parallelism": "2",
    "spark.sql.adaptive.enabled": "false",
}
"""Spark's defaults are sized for clusters and cost seconds per statement on small tables:
200 shuffle partitions per MERGE, a 50-task log replay on every Delta snapshot, and a
10,000-task listing job in VACUUM (225 s for a 5-file table, 22.9 s with 2). Adaptive execution
re-plans a query at each shuffle and runs every stage as a job of its own: a small table's MERGE ran
15 jobs (24 stages) with it, 9 (16) without, and took about a quarter less of the JVM's CPU
(docs/engine-notes.md, "A small table's MERGE on Delta on Spark"); on ``local[N]`` with 2 shuffle
partitions it has nothing to coalesce, and big MERGEs took as long either way. Users override any
of them through ``spark.config``."""


DELTA_MERGE_CONFIG: dict[str, str] = {"spark.databricks.delta.merge.materializeSource": "none"}
"""Delta materializes a MERGE's source (a job caching it on the executors) unless the source reads
Delta tables only, in case its files change between the MERGE's two passes. pgcdc's source is a
staged Parquet file no one changes before the MERGE ends (``merge.py``): the job (0.2-1.0 s of each
MERGE on ``local[2]``, docs/engine-notes.md) buys nothing. Helps a cluster as much (set it there
through ``spark.config``); users override it the same way."""


ONE_RUN_JVM_CONFIG: dict[str, str] = {"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1"}
"""The managed engine of a run (``spark.engine: spark``) is a JVM that lives for one run, and most of
its first MERGE is the JVM's warm-up: code the JIT compiles, most of it only once. The optimizing
compiler (C2) costs more CPU than it saves in so short a life: with the quick compiler (C1) alone a
fresh JVM's drain of 160k changes took 24-28 s of its CPU instead of 45 s, and its start 6.2-6.7 s
instead of 10.6 s (docs/engine-notes.md, "The managed JVM's warm-up, setting by setting"). A
long-lived server (``pgcdc spark-server``) keeps both compilers: it pays the warm-up once and runs
C2's faster code from then on. The local JVM's only: a cluster's driver and executors get none of
pgcdc's settings. A user's ``spark.driver.extraJavaOptions`` replaces it."""


LONG_LIVED_JVM_CONFIG: dict[str, str] = {"spark.driver.extraJavaOptions": "-XX:+UseParallelGC"}
"""A JVM that serves many runs (``pgcdc spark-server``) collects garbage with the throughput collector.
With G1 a warm server's MERGE spent a fifth of its CPU on collection (young pauses plus G1's
concurrent marking, which runs almost all the time once Delta's cached table states fill half of the
1 GiB heap); a 2 GiB heap did not help. Two servers warmed alike, four ``bench.cdc`` runs each,
alternating (docs/benchmarks.md, "A drain on Delta on Spark"): the JVM's CPU over a run 5.6-6.4 s
with the parallel collector against 6.9-8.9 s with G1, the drains 4.3-6.8 s against 4.9-11.5 s.
Its pauses are longer, which a batch server does not feel. The JVM pgcdc starts only, like
:data:`ONE_RUN_JVM_CONFIG` (a run's own JVM lives too briefly to fill its heap): on a cluster that is
the driver; executors on other hosts keep their own collector, and a remote engine gets nothing but
``spark.config``. A user's ``spark.driver.extraJavaOptions`` replaces it."""


def jar_cache_dir() -> Path:
    """Ivy's home for Delta's jars: ``$PGCDC_JAR_CACHE``, else ``~/.cache/pgcdc/ivy``.

    The first start fills it from Maven Central; later starts resolve from it without network.
    """
    configured = os.environ.get(JAR_CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "pgcdc" / "ivy"


IVY_SETTINGS = """<ivysettings>
  <settings defaultResolver="central"/>
  <resolvers>
    <ibiblio name="central" m2compatible="true" root="https://repo1.maven.org/maven2/"/>
  </resolvers>
</ivysettings>
"""
"""Maven Central only. Spark's default Ivy chain also tries ``~/.m2/repository``, where an
interrupted ``mvn`` run leaves a dependency's .pom without its .jar: Ivy then "finds" the
dependency there, fails to download its jar and the engine does not start (seen here with
jsr305, commons-logging and javax.annotation-api). Another repository: set
``spark.jars.ivySettings`` in ``spark.config``."""


def delta_jar_config() -> dict[str, str]:
    """Settings that put Delta's jars on a JVM session's class path through the jar cache: the
    jars themselves once a start has recorded them (:func:`remember_resolved_jars`), else Ivy's
    resolution of :data:`DELTA_PACKAGE` (writing the cache's Ivy settings file the first time)."""
    cache = jar_cache_dir()
    resolved = resolved_delta_jars()
    if resolved:
        return {"spark.jars": ",".join(str(path) for path in resolved)}
    settings = cache / "ivysettings.xml"
    if not settings.is_file() or settings.read_text() != IVY_SETTINGS:
        cache.mkdir(parents=True, exist_ok=True)
        settings.write_text(IVY_SETTINGS)
    return {"spark.jars.packages": DELTA_PACKAGE, "spark.jars.ivy": str(cache), "spark.jars.ivySettings": str(settings)}


def _resolved_jars_file() -> Path:
    return jar_cache_dir() / f"{DELTA_PACKAGE.replace(':', '_')}.jars"


def resolved_delta_jars() -> list[Path] | None:
    """The jars an earlier start's Ivy resolution of :data:`DELTA_PACKAGE` retrieved into the
    cache, if it was recorded and every one of them is still there."""
    try:
        paths = [Path(line) for line in _resolved_jars_file().read_text().splitlines() if line]
    except OSError:
        return None
    return paths if paths and all(path.is_file() for path in paths) else None


def remember_resolved_jars(session_jars: str) -> None:
    """Record which of a session's ``spark.jars`` Ivy retrieved into the jar cache, so that later
    starts load them directly: Ivy re-resolves the whole dependency tree on every start, even
    with everything cached (15-17 s on two busy cores, more than the rest of the JVM's start)."""
    retrieved = (jar_cache_dir() / "jars").resolve()
    paths = [Path(entry.removeprefix("file://")) for entry in session_jars.split(",") if entry]
    ours = [path for path in paths if path.parent == retrieved and path.is_file()]
    if not ours:
        return
    target = _resolved_jars_file()
    partial = target.with_suffix(f".{os.getpid()}.part")
    partial.write_text("".join(f"{path}\n" for path in ours))
    partial.replace(target)  # atomic: another process may be starting an engine from the same cache


def managed_server_config(user_config: Mapping[str, str] | None = None, *, one_run: bool = False) -> dict[str, str]:
    """Everything a managed (or classic) Spark with Delta is started with (``one_run``: a run's own
    JVM, :data:`ONE_RUN_JVM_CONFIG`, else :data:`LONG_LIVED_JVM_CONFIG`); user settings win, except that a user's ``spark.jars`` is added
    to Delta's rather than replacing them."""
    config = {
        **SMALL_TABLE_CONFIG,
        **DELTA_MERGE_CONFIG,
        **(ONE_RUN_JVM_CONFIG if one_run else LONG_LIVED_JVM_CONFIG),
        "spark.driver.memory": "1g",
        "spark.log.level": "WARN",
        **DELTA_SQL_CONFIG,
        **delta_jar_config(),
    }
    user = dict(user_config or {})
    if "spark.jars" in config and user.get("spark.jars"):
        user["spark.jars"] = f"{config['spark.jars']},{user['spark.jars']}"
    return {**config, **user}


def spark_home() -> Path:
    """The pyspark wheel is a Spark distribution: ``bin/spark-submit`` and every Spark jar."""
    return Path(pyspark.__file__).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def new_group_dying_with_parent() -> None:
    """In the JVM's process, before exec: a process group of its own, and SIGKILL when the
    watchdog (whose main thread starts it and lives as long as the watchdog) dies."""
    os.setsid()
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def start_jvm(
    master: str, port: int, config: Mapping[str, str], log_path: Path, work_dir: Path
) -> subprocess.Popen[bytes]:
    """``spark-submit`` of the Spark Connect server; ``spark-class`` execs java, so the pid is the JVM's."""
    args = [
        str(spark_home() / "bin" / "spark-submit"),
        "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
        "--master", master,
        "--name", "pgcdc-spark-connect",
        "--conf", f"spark.connect.grpc.binding.port={port}",
        "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
    ]  # fmt: skip
    for key, value in config.items():
        args += ["--conf", f"{key}={value}"]
    env = {**os.environ, "SPARK_HOME": str(spark_home()), "SPARK_LOCAL_IP": "127.0.0.1"}
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [*args, "spark-internal"], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=env, cwd=work_dir, preexec_fn=new_group_dying_with_parent,
        )  # fmt: skip


def wait_listening(port: int, process: subprocess.Popen[bytes], timeout: float, log_path: Path) -> None:
    """Until 127.0.0.1:port accepts a connection; a JVM that exits or takes too long is a one-line error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the Spark Connect server exited with status {process.returncode}: {_tail(log_path)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(
        f"the Spark Connect server did not listen within {timeout:.0f} s (raise {START_TIMEOUT_ENV}): {_tail(log_path)}"
    )


def _tail(log_path: Path) -> str:
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Exception" in line or "Error" in line or "error" in line]
    return (errors or lines or ["no output"])[-1].strip()[:400] + f" (log: {log_path})"


def stop_group(process: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM the JVM's process group, SIGKILL what is left after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    process.wait()


def main() -> int:
    """The watchdog: argv[1] is JSON ``{"master": ..., "config": {...}}``."""
    request = json.loads(sys.argv[1])
    work_dir = Path(tempfile.mkdtemp(prefix="pgcdc-spark-"))
    log_path = work_dir / "server.log"
    port = free_port()
    jvm = start_jvm(request["master"], port, request["config"], log_path, work_dir)
    try:
        wait_listening(port, jvm, float(os.environ.get(START_TIMEOUT_ENV, DEFAULT_START_TIMEOUT_S)), log_path)
        print(port, jvm.pid, flush=True)
        sys.stdin.buffer.read()
    except RuntimeError as error:
        print(error, file=sys.stderr, flush=True)
        return 1
    finally:
        stop_group(jvm)
    shutil.rmtree(work_dir, ignore_errors=True)  # the log and Spark's scratch files; kept after a failure
    return 0


if __name__ == "__main__":
    sys.exit(main())
