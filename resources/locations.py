"""Where the lake lives, as configuration: a local directory or an object-store URL
(``s3://bucket/prefix``), the settings that reach a store, and table locations joined under a root.

Vocabulary: no client, no engine. ``resources.delta.lake_storage`` opens the store these describe.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from resources.errors import ConfigurationError

OBJECT_STORE_SCHEMES = ("s3", "s3a")
"""Both name the same S3 store: Sail and delta-rs accept either, classic Spark's S3A client
takes ``s3a://`` (and ``s3://`` once ``fs.s3.impl`` points to it)."""

ENV_REFERENCE = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")


class StorageSettings(BaseModel):
    """``delta.storage``: how to reach an object-store lake; ignored for a local ``delta.root``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint: str | None = Field(
        default=None, description="http(s)://host:port of an S3-compatible server; null = AWS S3 (or AWS_ENDPOINT_URL)"
    )
    region: str | None = Field(default=None, description="S3 region; null = AWS_REGION / AWS_DEFAULT_REGION")
    path_style: bool = Field(
        default=True, description="bucket in the URL path (S3-compatible servers) vs in the host name"
    )
    allow_http: bool = Field(default=False, description="must be true for an http:// endpoint")
    access_key_id: str | None = Field(default=None, description="${ENV_VAR} holding the access key id")
    secret_access_key: str | None = Field(default=None, description="${ENV_VAR} holding the secret access key")
    session_token: str | None = Field(default=None, description="${ENV_VAR} holding a session token")
    instance_credentials: bool = Field(
        default=False, description="credentials come from the machine (EC2 instance role); no key pair needed"
    )

    @field_validator("access_key_id", "secret_access_key", "session_token")
    @classmethod
    def _environment_reference(cls, value: str | None) -> str | None:
        if value is not None and not ENV_REFERENCE.match(value):
            # The value itself is not echoed: it may be the secret.
            raise ValueError("must name an environment variable as ${NAME}; secrets do not belong in the file")
        return value

    @field_validator("endpoint")
    @classmethod
    def _endpoint_url(cls, value: str | None) -> str | None:
        if value is not None and (urlsplit(value).scheme not in ("http", "https") or not urlsplit(value).hostname):
            raise ValueError("must be a URL like https://s3.example.com or http://127.0.0.1:9000")
        return value

    @model_validator(mode="after")
    def _http_allowed(self) -> StorageSettings:
        if self.endpoint is not None and self.endpoint.startswith("http://") and not self.allow_http:
            raise ValueError("endpoint uses http://: set delta.storage.allow_http: true (or use https://)")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("set both access_key_id and secret_access_key, or neither")
        return self


@dataclass(frozen=True, slots=True)
class ObjectLocation:
    """An object-store URL split into its parts; ``prefix`` has no leading or trailing '/'."""

    scheme: str
    bucket: str
    prefix: str

    @property
    def store_path(self) -> str:
        """``bucket/prefix``: the path Arrow's filesystem takes."""
        return f"{self.bucket}/{self.prefix}".rstrip("/")


def is_object_store(location: str) -> bool:
    return urlsplit(location).scheme in OBJECT_STORE_SCHEMES


def parse_object_location(location: str) -> ObjectLocation:
    parts = urlsplit(location)
    if parts.scheme not in OBJECT_STORE_SCHEMES or not parts.netloc:
        raise ConfigurationError(
            f"delta.root {location} is not a supported lake location",
            "use a local directory or s3://bucket/prefix (s3a:// also works)",
        )
    return ObjectLocation(parts.scheme, parts.netloc, parts.path.strip("/"))


def join_location(root: str, *components: str) -> str:
    """``root`` with path components appended: a URL stays a URL (joined with '/'), a local
    root is resolved against pgcdc's working directory, as it always was."""
    if "://" in root and not root.startswith("file://"):
        if not is_object_store(root):
            parse_object_location(root)  # raises, naming the schemes that work
        return "/".join([root.rstrip("/"), *components])
    return os.path.join(_resolved_root(root.removeprefix("file://"), os.getcwd()), *components)


@functools.lru_cache(maxsize=64)
def _resolved_root(root: str, working_directory: str) -> str:
    """``root`` resolved against ``working_directory``: once per root, not once per table of a
    run (resolving walks the path with a system call per component)."""
    return str((Path(working_directory) / root).resolve())
