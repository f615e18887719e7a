"""Where the lake lives: a local directory or an object store URL (``s3://bucket/prefix``).

pgcdc must not assume the engine shares its filesystem, so everything that touches the lake
outside the engine goes through this module: the table locations (``PgcdcConfig.table_path``),
the settings each party needs to reach the store (the engine's environment, delta-rs
``storage_options``), a storage client (``pyarrow.fs``) for clean-up, and the preflight that
turns a wrong bucket, missing credentials or an unreachable endpoint into one line naming the
key to fix before anything is written.

Credentials never live in the configuration file: ``delta.storage.access_key_id`` and friends
are references to environment variables (``${NAME}``), resolved when used, or absent (then the
usual ``AWS_*`` variables and AWS credential sources apply). Resolved secrets go only into the
engine child's environment and the storage clients, never into logs, metadata or errors.

Each party reads the store with its own client (Sail and delta-rs use Rust's ``object_store``,
pgcdc's clean-up uses Arrow's C++ S3 client); the settings below are the ones all of them honour.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from resources.errors import ConfigurationError
from resources.locations import ENV_REFERENCE, is_object_store, parse_object_location, StorageSettings

_CREDENTIAL_SOURCES_IN_ENVIRONMENT = (
    "AWS_PROFILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)
"""Other AWS credential sources than a key pair: with one of these set, the clients find
credentials themselves and the preflight does not ask for a key pair."""
CONNECT_TIMEOUT_S = 3.0
REQUEST_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Credentials:
    access_key_id: str
    secret_access_key: str
    session_token: str | None

    def __repr__(self) -> str:  # never the values
        return "Credentials(<hidden>)"


class LakeStorage:
    """The lake at ``root`` with its ``delta.storage`` settings: what each client needs to reach it."""

    def __init__(self, root: str, settings: StorageSettings | None = None) -> None:
        self.root = root
        self.settings = settings or StorageSettings()
        self.location = parse_object_location(root) if is_object_store(root) else None
        self._filesystem: object | None = None

    def __repr__(self) -> str:
        return f"LakeStorage(root={self.root!r})"

    @property
    def is_object_store(self) -> bool:
        return self.location is not None

    def region(self) -> str | None:
        return self.settings.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")

    def endpoint(self) -> str | None:
        return self.settings.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")

    def credentials(self) -> Credentials | None:
        """The configured key pair (from its environment variables), else AWS_* from the
        environment, else None (another credential source)."""
        references = {
            "access_key_id": (self.settings.access_key_id, "AWS_ACCESS_KEY_ID"),
            "secret_access_key": (self.settings.secret_access_key, "AWS_SECRET_ACCESS_KEY"),
            "session_token": (self.settings.session_token, "AWS_SESSION_TOKEN"),
        }
        values: dict[str, str | None] = {}
        for key, (reference, default_variable) in references.items():
            if reference is None:
                values[key] = os.environ.get(default_variable) or None
                continue
            variable = ENV_REFERENCE.match(reference).group(1)  # type: ignore[union-attr]  # validated
            value = os.environ.get(variable)
            if not value:
                raise ConfigurationError(
                    f"delta.storage.{key} names ${{{variable}}}, which is not set in pgcdc's environment",
                    f"export {variable}, or change delta.storage.{key}",
                )
            values[key] = value
        if values["access_key_id"] and values["secret_access_key"]:
            return Credentials(values["access_key_id"], values["secret_access_key"], values["session_token"])
        return None

    def _has_other_credential_source(self) -> bool:
        return (
            self.settings.instance_credentials
            or any(os.environ.get(name) for name in _CREDENTIAL_SOURCES_IN_ENVIRONMENT)
            or Path(os.environ.get("AWS_SHARED_CREDENTIALS_FILE", Path.home() / ".aws" / "credentials")).is_file()
        )

    def object_store_options(self) -> dict[str, str]:
        """The store settings as ``object_store`` names them: the environment of a Sail server and
        delta-rs ``storage_options``. Empty for a local lake. Holds secrets: pass on, never print."""
        if self.location is None:
            return {}
        options: dict[str, str] = {}
        endpoint, region = self.endpoint(), self.region()
        if endpoint:
            options["AWS_ENDPOINT_URL"] = (
                endpoint if self.settings.path_style else _bucket_host(endpoint, self.location.bucket)
            )
        if region:
            options["AWS_REGION"] = region
        if self.settings.allow_http:
            options["AWS_ALLOW_HTTP"] = "true"
        options["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] = "false" if self.settings.path_style else "true"
        credentials = self.credentials()
        if credentials is not None:
            options["AWS_ACCESS_KEY_ID"] = credentials.access_key_id
            options["AWS_SECRET_ACCESS_KEY"] = credentials.secret_access_key
            if credentials.session_token:
                options["AWS_SESSION_TOKEN"] = credentials.session_token
        return options

    def engine_environment(self) -> dict[str, str]:
        """What an embedded Sail server's environment needs: Sail reads its storage settings
        only from its own process environment, never from the Spark session's settings."""
        return self.object_store_options()

    def filesystem(self) -> object:
        """A ``pyarrow.fs.S3FileSystem`` on the store, with short time-outs so a wrong endpoint
        fails in seconds (the AWS SDK's defaults retry for minutes); made once per lake."""
        if self._filesystem is None:
            self._filesystem = self._new_filesystem()
        return self._filesystem

    def _new_filesystem(self) -> object:
        from pyarrow import fs

        if self.location is None:
            return fs.LocalFileSystem()
        arguments: dict[str, object] = {
            "region": self.region(),
            "connect_timeout": CONNECT_TIMEOUT_S,
            "request_timeout": REQUEST_TIMEOUT_S,
            "force_virtual_addressing": not self.settings.path_style,
            "retry_strategy": fs.AwsStandardS3RetryStrategy(max_attempts=2),
        }
        endpoint = self.endpoint()
        if endpoint:
            parts = urlsplit(endpoint)
            arguments["endpoint_override"] = parts.netloc
            arguments["scheme"] = parts.scheme
        credentials = self.credentials()
        if credentials is not None:
            arguments["access_key"] = credentials.access_key_id
            arguments["secret_key"] = credentials.secret_access_key
            arguments["session_token"] = credentials.session_token
        return fs.S3FileSystem(**arguments)

    def check(self) -> None:
        """Preflight, read-only: the store is reachable, the bucket exists and can be listed with
        the credentials pgcdc has. Raises a one-line ``ConfigurationError`` naming the key to fix.
        A local lake needs no check (the engine creates its directories)."""
        if self.location is None:
            return
        from pyarrow import fs

        if not self.region():
            raise ConfigurationError(
                f"no S3 region for delta.root {self.root}", "set delta.storage.region (or AWS_REGION)"
            )
        if self.credentials() is None and not self._has_other_credential_source():
            raise ConfigurationError(
                f"no S3 credentials for delta.root {self.root}",
                "set delta.storage.access_key_id and secret_access_key to ${ENV_VAR} references, export "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or set delta.storage.instance_credentials: true",
            )
        filesystem = self.filesystem()
        endpoint = self.endpoint() or "AWS S3"
        try:
            bucket = filesystem.get_file_info(self.location.bucket)  # type: ignore[attr-defined]
            if bucket.type == fs.FileType.NotFound:
                raise ConfigurationError(
                    f"bucket {self.location.bucket!r} of delta.root {self.root} does not exist at {endpoint}",
                    "fix delta.root (or delta.storage.endpoint), or create the bucket",
                )
            filesystem.get_file_info(fs.FileSelector(self.location.store_path, allow_not_found=True))  # type: ignore[attr-defined]
        except OSError as error:
            raise _explain_store_error(error, self.root, endpoint) from None

    def remove_tree(self, location: str, keep_parent: bool = False) -> None:
        """Delete everything at ``location`` (inside this lake) and, locally, its parent directory
        when it is left empty (unless ``keep_parent``). Missing is fine: this is clean-up of pgcdc's
        own data."""
        if self.location is None or not is_object_store(location):
            _remove_local_tree(location, keep_parent)
            return
        try:
            # Arrow's client then leaves an empty marker object for the emptied parent (the
            # ``_pgcdc_staging/`` "directory"), which Delta readers ignore like the directory itself.
            self.filesystem().delete_dir(parse_object_location(location).store_path)  # type: ignore[attr-defined]
        except FileNotFoundError:
            pass


def _bucket_host(endpoint: str, bucket: str) -> str:
    """``endpoint`` with ``bucket`` in its host name: ``object_store`` (Sail, delta-rs) addresses
    virtual-hosted requests to the endpoint as given, so with ``path_style: false`` the endpoint must
    name the bucket's host (``http://lake.s3.example.com:9000``); Arrow's and S3A's clients add it themselves."""
    parts = urlsplit(endpoint)
    return parts._replace(netloc=f"{bucket}.{parts.netloc}").geturl()


def _remove_local_tree(location: str, keep_parent: bool = False) -> None:
    local = location.removeprefix("file://")
    if "://" in local:
        return  # a store pgcdc has no client for: left to the store's lifecycle rules
    shutil.rmtree(local, ignore_errors=True)
    if keep_parent:
        return
    try:
        Path(local).parent.rmdir()  # the staging directory, unless another write uses it
    except OSError:
        pass


def _explain_store_error(error: OSError, root: str, endpoint: str) -> ConfigurationError:
    """Arrow's S3 errors as one line naming the key to fix (the message holds no secrets:
    the AWS SDK does not echo credentials)."""
    text = " ".join(str(error).split())
    if "NETWORK_CONNECTION" in text or "curlCode" in text or "Could not connect" in text or "resolve" in text:
        return ConfigurationError(
            f"S3 endpoint {endpoint} of delta.root {root} is unreachable",
            "fix delta.storage.endpoint (or AWS_ENDPOINT_URL), or start the server",
        )
    if "ACCESS_DENIED" in text or "403" in text or "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text:
        return ConfigurationError(
            f"S3 refused access to delta.root {root}",
            "fix the credentials (delta.storage.access_key_id / secret_access_key, and session_token for"
            " temporary ones, or AWS_*)",
        )
    if "HTTP status 400" in text or "InvalidToken" in text or "ExpiredToken" in text:
        # S3 answers a HEAD signed with a wrong or expired session token (or for the wrong region) with a bare 400
        return ConfigurationError(
            f"S3 refused the signed request for delta.root {root} as invalid (HTTP 400): a wrong or expired"
            " session token, or a region the bucket is not in",
            "fix delta.storage.session_token (or AWS_SESSION_TOKEN) with its key pair, or delta.storage.region",
        )
    return ConfigurationError(f"cannot reach delta.root {root} ({text[:200]})", "check delta.root and delta.storage")


def open_lake(root: str, settings: StorageSettings | None = None) -> LakeStorage:
    """The lake at ``root``, checked (``LakeStorage.check``): what a run's wiring opens once and hands to
    whoever touches the store (the destination, the state table, maintenance)."""
    lake = LakeStorage(root, settings)
    lake.check()
    return lake


def storage_client(location: str, lake: LakeStorage | None) -> tuple[object, str]:
    """A ``pyarrow.fs`` filesystem reaching ``location`` and the path it takes there: ``lake``'s client
    for an object-store location inside it, the local filesystem for a local one. pgcdc reads Delta logs
    with it (``resources/delta/table_log.py``) without a round trip through the engine."""
    from pyarrow import fs

    if _object_store_of(location, lake) is not None:
        return lake.filesystem(), parse_object_location(location).store_path  # type: ignore[union-attr]
    return fs.LocalFileSystem(), location.removeprefix("file://")


def object_store_options(location: str, lake: LakeStorage | None) -> dict[str, str]:
    """The ``object_store`` settings (delta-rs ``storage_options``) of ``lake`` for ``location`` inside
    it; empty for a local path. Holds secrets: pass on, never print."""
    return {} if _object_store_of(location, lake) is None else lake.object_store_options()  # type: ignore[union-attr]


def _object_store_of(location: str, lake: LakeStorage | None) -> LakeStorage | None:
    """``lake`` when it is the object-store lake holding ``location``; None for a local path. An
    object-store location outside ``lake`` (or without one) is refused: its credentials are unknown."""
    if lake is not None and lake.is_object_store:
        root = lake.root.rstrip("/")
        if location == root or location.startswith(root + "/"):
            return lake
    if is_object_store(location):
        raise ConfigurationError(
            f"{location} is on an object store outside the lake pgcdc was given",
            "pass the lake holding it (open_lake(delta.root, delta.storage)) to the call",
        )
    return None


def remove_tree(location: str, lake: LakeStorage | None, keep_parent: bool = False) -> None:
    """Delete pgcdc's own data at ``location`` (staging data, or a table it created and could not
    fill), on whatever store holds it: a local directory directly, an object-store location through
    ``lake``'s client (one outside ``lake`` is left to the store's lifecycle rules). A local parent
    directory left empty goes too (a staging directory), unless ``keep_parent``."""
    if lake is not None and lake.is_object_store and location.startswith(lake.root.rstrip("/") + "/"):
        lake.remove_tree(location, keep_parent)
        return
    _remove_local_tree(location, keep_parent)
