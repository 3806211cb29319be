"""Disk-tier engine tests share the engine tests' loaded model and helpers."""

from __future__ import annotations

from tests.engine.conftest import loaded, make_engine  # noqa: F401  (fixtures)
