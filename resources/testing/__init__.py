"""Helpers for tests, the demo and benchmarks (local PostgreSQL, the Delta-vs-PostgreSQL oracle, fault points).

The runtime imports only ``resources.testing.faults``.
"""
