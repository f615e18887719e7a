"""Helpers shared by the test modules: fixtures plugins, oracles, workloads, child processes.

Nothing here is a test; ``tests/conftest.py`` assigns tiers to the tests that use these fixtures.
"""
