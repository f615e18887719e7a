"""The code location: ``dagster dev`` (via ``[tool.dagster]``/workspace.yaml) and
``dagster job execute -m pgcdc_assets.definitions -j pgcdc_snapshot`` load ``defs`` from here.

Built from the file named by ``PGCDC_CONFIG``; without it, or with PostgreSQL unreachable
when tables come from the publication, loading fails with pgcdc's one-line error.
"""

from pgcdc_assets.builder import build_definitions

defs = build_definitions()
