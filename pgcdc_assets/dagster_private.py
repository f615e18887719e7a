"""Every private Dagster API pgcdc uses, in this one module, each with what it is for.

Dagster may move or rename anything under ``dagster._`` in any release. Keeping the imports here
means an upgrade breaks in one place, and ``tests/test_dagster_private.py`` says which name moved
(it reads the imports below and fails naming the module, the name and the Dagster version).
Everything else in pgcdc imports only ``dagster``'s public names.
"""

from __future__ import annotations

# The type define_asset_job returns; Dagster exports no public name for it (annotations only).
from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

# Dagster's own cron iteration, so a schedule's longest gap (the freshness policy of the tables)
# follows exactly the ticks Dagster's scheduler will make, time zones and all.
from dagster._utils.schedules import cron_string_iterator

__all__ = ["UnresolvedAssetJobDefinition", "cron_string_iterator"]
