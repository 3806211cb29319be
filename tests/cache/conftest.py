"""Helpers for the cache tests: a manager whose events feed a KVState mirror."""

from __future__ import annotations

from typing import Any

import pytest

from kvscope.engine.cache import KVCacheManager
from kvscope.engine.events.sink import ListSink
from kvscope.engine.events.state import KVState
from tests.events.conftest import assert_declared


class Mirrored:
    """A KVCacheManager plus the KVState rebuilt from its events, one batch per step."""

    def __init__(self, num_gpu_blocks: int, block_size: int, **kw: Any) -> None:
        self.sink = ListSink()
        self.m = KVCacheManager(num_gpu_blocks, block_size, sink=self.sink, **kw)
        self.state = KVState()
        self.step = 0
        self.events: list[dict[str, Any]] = []  # every event so far
        self.sync()

    def sync(self) -> list[dict[str, Any]]:
        """End a step: flush, apply the batch, and require mirror == manager (and every
        event to fit its declared type)."""
        self.m.flush_step_events()
        events = self.sink.drain()
        assert_declared(events)
        self.events += events
        self.state.apply({"v": 1, "step": self.step, "events": events})
        self.step += 1
        self.m.check_invariants()
        assert self.state.canonical() == self.m.snapshot()
        return events


@pytest.fixture
def mirrored():
    return Mirrored


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["kind"] for e in events]
