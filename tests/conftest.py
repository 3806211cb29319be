"""Shared test configuration. Area-specific fixtures live in tests/<area>/conftest.py."""
