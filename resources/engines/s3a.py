"""How a JVM Spark reaches an ``s3://`` lake: Hadoop's S3A client, its jars fetched once from Maven Central
into the jar cache, and the settings that point ``s3://`` at it. An engine's concern (what the JVM is started
with), not the lake's: the lake's store and credentials are in ``resources/delta/lake_storage.py``."""

from __future__ import annotations

import shutil
from pathlib import Path

from resources.delta.lake_storage import CONNECT_TIMEOUT_S, LakeStorage
from resources.engines.spark_server import jar_cache_dir

S3A_JARS = (
    "org/apache/hadoop/hadoop-aws/3.4.2/hadoop-aws-3.4.2.jar",
    "software/amazon/awssdk/bundle/2.29.52/bundle-2.29.52.jar",
    "software/amazon/s3/analyticsaccelerator/analyticsaccelerator-s3/1.2.1/analyticsaccelerator-s3-1.2.1.jar",
)
"""Hadoop's S3A client for the Hadoop 3.4.2 inside pyspark 4.1, the AWS SDK v2 bundle that Hadoop
release is built against (612 MiB) and S3A's one further compile dependency. Passed as plain
jars: resolving hadoop-aws through Ivy or Maven fails on a ``provided`` dependency that is not
on Maven Central (docs/engine-notes.md)."""
MAVEN_CENTRAL = "https://repo1.maven.org/maven2/"


def s3a_jars() -> list[Path]:
    """The S3A jars in the jar cache (``$PGCDC_JAR_CACHE/s3a``), downloaded from Maven Central the
    first time: a fresh machine pays the bundle's download once."""
    from urllib.request import urlopen

    directory = jar_cache_dir() / "s3a"
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for relative in S3A_JARS:
        path = directory / relative.rsplit("/", 1)[1]
        if not path.is_file():
            partial = path.with_suffix(".part")
            with urlopen(MAVEN_CENTRAL + relative, timeout=60) as response, open(partial, "wb") as out:
                shutil.copyfileobj(response, out, 1024 * 1024)
            partial.rename(path)
        paths.append(path)
    return paths


def s3a_settings(lake: LakeStorage) -> dict[str, str]:
    """Settings for a JVM Spark (Hadoop's S3A client) to reach the store under the same
    ``s3://`` URL as the other clients: S3A's jars (:func:`s3a_jars`, fetched once into the jar
    cache) and ``fs.s3.impl`` pointing at S3A. Credentials are not among them: S3A takes them
    from the server's environment (``LakeStorage.engine_environment``), never from its command line."""
    if lake.location is None:
        return {}
    settings = {
        "spark.jars": ",".join(str(path) for path in s3a_jars()),
        "spark.hadoop.fs.s3.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem",
        "spark.hadoop.fs.s3a.path.style.access": str(lake.settings.path_style).lower(),
        "spark.hadoop.fs.s3a.connection.establish.timeout": f"{CONNECT_TIMEOUT_S:.0f}s",
        "spark.hadoop.fs.s3a.attempts.maximum": "2",
        "spark.hadoop.fs.s3a.retry.limit": "2",
    }
    endpoint, region = lake.endpoint(), lake.region()
    if endpoint:
        settings["spark.hadoop.fs.s3a.endpoint"] = endpoint
        settings["spark.hadoop.fs.s3a.connection.ssl.enabled"] = str(endpoint.startswith("https://")).lower()
    if region:
        settings["spark.hadoop.fs.s3a.endpoint.region"] = region
    if lake.credentials() is not None:
        settings["spark.hadoop.fs.s3a.aws.credentials.provider"] = (
            "software.amazon.awssdk.auth.credentials.EnvironmentVariableCredentialsProvider"
        )
    return settings
