"""The engines users outgrow embedded Sail into, started for real by the tests and stopped after.

``engine`` is one session-scoped fixture, parametrized (indirectly, at session scope) by the
test modules over :data:`ENGINES`, so pytest runs every test of one engine before it starts
the next and at most one JVM engine runs at a time (the suite shares two cores):

* ``spark-local``: the managed engine pgcdc starts itself (``spark.engine: spark``): a Spark
  Connect server with Delta on ``local[N]`` (``resources.engines.spark_server``), with Hadoop's S3A
  client reaching the session's local S3 server (``tests/support/s3_fixtures.py``), so one JVM serves the
  tests on local paths and on ``s3://``;
* ``spark-cluster``: a Spark standalone master and one worker, and a Spark Connect server with
  Delta on that cluster, as ``spark.remote: sc://...`` would find it in production;
* ``sail-server``: Sail's standalone Spark Connect server (``sail spark server``).

Every process is started in a process group of its own; teardown kills the groups and fails
if any process of them is left.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from resources.delta.lake_storage import LakeStorage
from resources.engines.engine import SparkEngine
from resources.engines.s3a import s3a_settings
from resources.engines.spark_connect import connect_session, engine_address
from resources.engines.spark_server import (
    delta_jar_config,
    DELTA_PACKAGE,
    free_port,
    managed_server_config,
    new_group_dying_with_parent,
    spark_home,
    start_jvm,
    stop_group,
    wait_listening,
)
from tests.support.s3_fixtures import BUCKET

ENGINES = ["spark-local", "spark-cluster", "sail-server"]
#: Spark settings of the suite's JVMs: expressions interpreted, no whole-stage code generation. The
#: suite's tables are small, where compiling each statement's generated code is about half of a MERGE's CPU
#: (docs/engine-notes.md, "A small table's MERGE on Delta on Spark"); the Spark kill tests took 28% less CPU
#: with them. Spark computes the same results either way (its own tests run both); the kept JVM's test
#: (tests/test_spark_kept_jvm.py) and ``pgcdc spark-server``'s keep the engine's defaults, their drains
#: as a user's runs have them.
SUITE_SPARK_CONFIG = {"spark.sql.codegen.wholeStage": "false", "spark.sql.codegen.factoryMode": "NO_CODEGEN"}
START_TIMEOUT_S = 600.0
"""Generous: the first start on a fresh machine downloads Delta's jars."""


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group is left (zombies of our own children excepted)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


@dataclass
class EngineUnderTest:
    """An engine as the tests see it: its URL, a session in this process, and its server to kill."""

    name: str
    work_dir: Path
    spark: SparkSession | None = None
    url: str = ""
    #: Process groups started for this engine (the JVM / Sail server and, for the cluster, master and worker).
    groups: list[int] = field(default_factory=list)
    _server: subprocess.Popen[bytes] | None = None
    _managed: SparkEngine | None = None
    _cluster: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _master_url: str = ""
    _port: int = 0
    #: Servers started again after :meth:`kill` (the walk's restart serves one re-run, then the session ends).
    _restarts: int = 0
    #: The lake the managed engine must reach besides local paths (its S3A settings and credentials).
    s3_lake: LakeStorage | None = None

    @property
    def server_pid(self) -> int:
        """The engine process a user would lose: the Spark Connect JVM or the Sail server."""
        if self._managed is not None:
            assert self._managed.server_pid is not None
            return self._managed.server_pid
        assert self._server is not None
        return self._server.pid

    def start(self) -> None:
        if self.name == "spark-local":
            lake = self.s3_lake
            # One JVM serves every test on it, as `pgcdc spark-server` serves many runs: both JIT compilers
            # (a run's own JVM gets the quick one only, spark_server.ONE_RUN_JVM_CONFIG; the walk's crash
            # child starts such a JVM). With the quick one alone these tests took 1.5-2x as long.
            settings = {
                **(s3a_settings(lake) if lake else {}),
                **SUITE_SPARK_CONFIG,
                "spark.driver.extraJavaOptions": "-XX:+TieredCompilation",
            }
            self._managed = SparkEngine.managed_spark(
                settings, master="local[2]", storage_environment=lake.engine_environment() if lake else None,
            )  # fmt: skip
            self.spark = self._managed.spark
            self.url = engine_address(self.spark)
            self.groups.append(self.server_pid)
            return
        if self.name == "spark-cluster" and not self._cluster:
            self._start_cluster()
        self._port = self._port or free_port()
        self.url = f"sc://127.0.0.1:{self._port}"
        if self.name == "spark-cluster":
            # The restarted Connect server serves the walk's one re-run, a run's worth of work: like a run's
            # own JVM it compiles with C1 alone (spark_server.ONE_RUN_JVM_CONFIG), which halves a fresh JVM's
            # CPU over its first drain (docs/engine-notes.md, "The managed JVM's warm-up, setting by setting").
            config = managed_server_config({
                "spark.executor.memory": "768m", "spark.executor.cores": "1", "spark.cores.max": "1",
                "spark.driver.memory": "768m", **SUITE_SPARK_CONFIG,
            }, one_run=self._restarts > 0)  # fmt: skip
            log = self.work_dir / f"connect-{time.monotonic_ns()}.log"
            self._server = start_jvm(self._master_url, self._port, config, log, self.work_dir)
            wait_listening(self._port, self._server, START_TIMEOUT_S, log)
        else:
            sail = str(Path(sys.executable).with_name("sail"))
            with open(self.work_dir / "sail.log", "ab") as log:
                self._server = subprocess.Popen(
                    [sail, "spark", "server", "--ip", "127.0.0.1", "--port", str(self._port)],
                    stdout=log, stderr=subprocess.STDOUT, preexec_fn=new_group_dying_with_parent,
                    env={**os.environ, "SAIL_EXECUTION__DEFAULT_PARALLELISM": "1"},
                )  # fmt: skip
            wait_listening(self._port, self._server, 60, self.work_dir / "sail.log")
        self.groups.append(self._server.pid)
        self.spark = connect_session(self.url)

    def _start_cluster(self) -> None:
        """Master and one worker (1 core, 1 GiB), from the pyspark wheel's ``spark-class``."""
        master_port, worker_port = free_port(), free_port()
        self._master_url = f"spark://127.0.0.1:{master_port}"
        env = {
            **os.environ,
            "SPARK_HOME": str(spark_home()),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_WORKER_DIR": str(self.work_dir / "worker"),
        }
        spark_class = str(spark_home() / "bin" / "spark-class")
        for role, args, port in (
            ("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(master_port),
                        "--webui-port", str(free_port())], master_port),
            ("worker", ["org.apache.spark.deploy.worker.Worker", self._master_url, "--host", "127.0.0.1",
                        "--port", str(worker_port), "--webui-port", str(free_port()), "--cores", "1",
                        "--memory", "1g"], worker_port),
        ):  # fmt: skip
            log_path = self.work_dir / f"{role}.log"
            with open(log_path, "wb") as log:
                process = subprocess.Popen(
                    [spark_class, *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.work_dir,
                    preexec_fn=new_group_dying_with_parent,
                )  # fmt: skip
            self._cluster.append(process)
            self.groups.append(process.pid)
            wait_listening(port, process, START_TIMEOUT_S, log_path)

    def kill(self) -> None:
        """SIGKILL the engine's server process (the cluster's master and worker live on)."""
        os.kill(self.server_pid, signal.SIGKILL)

    def restart(self) -> None:
        """After :meth:`kill`: a new server (on the same address, except the managed engine's)."""
        self.stop_server()
        self._restarts += 1
        self.start()

    def stop_server(self) -> None:
        if self.spark is not None:
            self.spark.stop()
            self.spark = None
        if self._managed is not None:
            self._managed.close()
            self._managed = None
        if self._server is not None:
            stop_group(self._server)
            self._server = None

    def stop(self) -> None:
        try:
            self.stop_server()
        finally:
            for process in reversed(self._cluster):
                stop_group(process)
            self._cluster.clear()


@pytest.fixture(scope="session")
def engine(request: pytest.FixtureRequest) -> Iterator[EngineUnderTest]:
    under_test = EngineUnderTest(request.param, Path(tempfile.mkdtemp(prefix=f"pgcdc-{request.param}-")))
    if request.param == "spark-local":
        under_test.s3_lake = request.getfixturevalue("s3_server").lake(f"s3://{BUCKET}/")
    try:
        under_test.start()
        yield under_test
    finally:
        under_test.stop()
        deadline = time.monotonic() + 20
        while any(group_alive(pgid) for pgid in under_test.groups) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [pgid for pgid in under_test.groups if group_alive(pgid)]
        assert not left, f"{request.param}: processes left behind in process groups {left}"
        shutil.rmtree(under_test.work_dir, ignore_errors=True)  # the engines' logs; kept after a failure


def assert_delta_jars(config: dict[str, str]) -> None:
    """Delta's jars are on the session: through Ivy (a fresh jar cache) or the jars an earlier start recorded."""
    assert delta_jar_config().items() <= config.items()
    _group, artifact, version = DELTA_PACKAGE.split(":")
    assert config.get("spark.jars.packages") == DELTA_PACKAGE or f"{artifact}-{version}.jar" in config.get(
        "spark.jars", ""
    )
