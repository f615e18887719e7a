"""Support for tests, the demo and benchmarks: local PostgreSQL servers, the Delta-vs-PostgreSQL oracle,
the in-memory destination and Dagster instances for tests.

Not part of the runtime: no module outside this package, the demo (``pgcdc_assets/demo``) and the tests
imports it (``tests/test_layout.py`` checks), and its own dependencies come with the ``testing`` extra
(``pip install 'pgcdc[testing]'``). The runtime's crash points live in ``resources/crash_points.py``.
"""
