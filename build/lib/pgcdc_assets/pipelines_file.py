"""The pipelines of a pgcdc Component's ``defs.yaml``, read the same way at load time and at run time.

Dagster renders a component's templates (``{{ env('SHOP_DSN') }}``) when the code location
loads. The resources must not carry the rendered values, since Dagster shows resource
config in its UI and run records and a DSN may hold a password: they hold only the file
and the pipeline name, and read the pipeline again here when a run needs it. One reader
and one validator (``resources.config.parse_config``) serve both moments and the
``PGCDC_CONFIG`` file, so a key means the same everywhere and every error names the file,
the pipeline, the key and the fix on one line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from dagster.components.resolved.context import ResolutionContext
from dagster.components.resolved.errors import ResolutionException
from pydantic import BaseModel, ConfigDict, create_model, Field

from resources.config import parse_config, PgcdcConfig
from resources.errors import ConfigurationError

#: A pipeline name becomes part of asset keys, job, op, resource and group names.
PIPELINE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,39}$")

#: ``{{ env.X }}``: Dagster renders an unset variable as None without a word; ``env('X')`` fails instead.
_ENV_ATTRIBUTE = re.compile(r"\{\{[^}]*\benv\.([A-Za-z_][A-Za-z0-9_]*)")
#: Sections passed to the Spark resource as Dagster config: a rendered secret there would show in the UI.
_UNRENDERED_SECTIONS = (("delta", "storage"), ("spark", "config"))


def _leaves(value: object, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], object]]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _leaves(item, (*path, str(key)))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaves(item, (*path, str(index)))
    else:
        yield path, value


def check_templates(raw: Mapping[str, Any], source: str) -> None:
    """Refuse the two template uses that would go wrong quietly: ``env.X`` and secrets rendered into resource config."""
    for path, value in _leaves(raw):
        if not isinstance(value, str) or "{{" not in value:
            continue
        key = ".".join(path)
        attribute = _ENV_ATTRIBUTE.search(value)
        if attribute:
            name = attribute.group(1)
            raise ConfigurationError(
                f"{source}: '{key}' uses {{{{ env.{name} }}}}, which gives None when {name} is unset",
                f"write {{{{ env('{name}') }}}} so a missing variable fails the load",
            )
        if path[:2] in _UNRENDERED_SECTIONS:
            raise ConfigurationError(
                f"{source}: '{key}' is a template, and its rendered value would show in Dagster's resource config",
                "write secrets there as ${VAR} references (pgcdc reads them when the engine starts)",
            )


def read_raw_pipelines(defs_file: str | os.PathLike[str]) -> dict[str, Any]:
    """Every pipeline of every pgcdc document in ``defs_file``, templates not rendered."""
    try:
        documents = list(yaml.safe_load_all(Path(defs_file).read_text(encoding="utf-8")))
    except OSError as error:
        raise ConfigurationError(
            f"cannot read {defs_file} ({error.strerror})", "restore the component's defs.yaml"
        ) from None
    except yaml.YAMLError as error:
        raise ConfigurationError(f"{defs_file} is not valid YAML ({error})", "fix the YAML syntax") from None
    pipelines: dict[str, Any] = {}
    for document in documents:
        attributes = document.get("attributes") if isinstance(document, dict) else None
        found = attributes.get("pipelines") if isinstance(attributes, dict) else None
        if isinstance(found, dict):
            pipelines.update(found)
    return pipelines


def validate_pipeline(name: str, rendered: object, raw: object, defs_file: str | os.PathLike[str]) -> PgcdcConfig:
    """One pipeline's settings as a ``PgcdcConfig``; the error names file, pipeline, key and fix."""
    source = f"{defs_file} pipeline '{name}'"
    if not PIPELINE_NAME.match(name):
        raise ConfigurationError(
            f"{defs_file}: pipeline name '{name}' is not usable in Dagster names",
            "use lower-case letters, digits and underscores, starting with a letter (at most 40)",
        )
    if isinstance(raw, Mapping):
        check_templates(raw, source)
    return parse_config(rendered, source)


def _keys_model(model: type[BaseModel]) -> type[BaseModel]:
    """A model with ``model``'s keys, nesting and descriptions, and no types or validators of its own.

    It is the schema of a pipeline in ``defs.yaml`` (``dg`` publishes it, editors complete keys
    from it, ``dg check defs`` refuses a misspelled one, naming the file and the key); values stay
    unchecked there, since a value may be an ``{{ env('X') }}`` template until the load renders
    it, and are checked afterwards by ``parse_config``, as for a ``PGCDC_CONFIG`` file.
    """
    fields: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        annotation: Any = info.annotation
        section = _keys_model(annotation) if isinstance(annotation, type) and issubclass(annotation, BaseModel) else Any
        default = ... if info.is_required() else None
        optional = section if default is ... or section is Any else section | None
        fields[name] = (optional, Field(default=default, description=info.description))
    return create_model(f"{model.__name__}Keys", __config__=ConfigDict(extra="forbid"), **fields)


#: One pipeline of ``defs.yaml``: the keys of a ``PGCDC_CONFIG`` file (``PgcdcConfig``).
PipelineKeys = _keys_model(PgcdcConfig)


def load_pipeline_config(defs_file: str | os.PathLike[str], pipeline: str) -> PgcdcConfig:
    """Read ``pipeline`` from ``defs_file`` and render its templates as the code location's load did."""
    raw = read_raw_pipelines(defs_file).get(pipeline)
    if raw is None:
        raise ConfigurationError(
            f"{defs_file} has no pipeline '{pipeline}'",
            "reload the code location after renaming or removing a pipeline",
        )
    try:
        rendered = ResolutionContext.default().resolve_value(raw)
    except ResolutionException as error:
        message = str(error).strip().splitlines()[-1]
        raise ConfigurationError(
            f"{defs_file} pipeline '{pipeline}': {message}", "set the variable or fix the template"
        ) from None
    return validate_pipeline(pipeline, rendered, raw, defs_file)
