"""Helpers shared by the test modules: fixture plugins, oracles, workloads, child processes, tier rules.

Nothing here is a test; ``tests/conftest.py`` assigns tiers to the tests that use these fixtures.
"""
