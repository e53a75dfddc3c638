"""Builders the tests share: image trees, tiny runs, child processes, servers and the callbacks children load.

Fixtures live in tests/conftest.py and use these; a test module imports from here, never from another test module.
"""
