"""Schema changes the applier cannot follow on its own: the error and the one fix it names."""

from __future__ import annotations

from resources.errors import PgcdcError
from resources.names import RESNAPSHOT_JOB


RESNAPSHOT_FIX = f"re-snapshot the table (materialize its snapshot asset or run the {RESNAPSHOT_JOB} job)"


class SchemaChangeError(PgcdcError):
    """A column changed in a way Delta cannot follow in place."""
