"""The test oracle: a Delta table equals its PostgreSQL table, value for value.

The comparison lives in ``resources/verify.py`` so the demo can use it too; see there for
how values are compared.
"""

from resources.verify import assert_delta_equals_postgres, delta_rows

__all__ = ["assert_delta_equals_postgres", "delta_rows"]
