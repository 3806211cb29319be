"""ZeroMQ's slow joiner, for a test of a vLLM-format publisher: a SUB receives only what is
published after its subscription has reached the PUB, and nothing tells either side when
that is. So the test publishes probe steps until its subscriber has received one; from
then on every batch reaches it (one connection, in order, far below the high-water mark).
No sleep decides it: a slow box only takes more probes.

A probe is a real cache-manager step that leaves nothing behind: a one-block request is
stored, finished, and its cached block evicted (a prefix-cache reset), which vLLM's
format says as BlockStored then BlockRemoved of one hash, in one batch. A consumer's cache
is the same after a probe whether it received the probe or not. Probes run before the
workload, while no other block is cached.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable

from kvscope.engine.cache import KVCacheManager
from kvscope.engine.events.wire import EventStream
from tests.waiting import HANG_S

_ids = itertools.count()


def probe_step(manager: KVCacheManager) -> None:
    """One step's worth of cache changes that cancel out (see the module docstring)."""
    sid = f"probe-{next(_ids)}"
    tokens = list(range(manager.block_size + 1))  # one full block and one token more
    manager.add_sequence(sid, tokens)
    assert manager.allocate_slots(sid, len(tokens)) is not None
    manager.start(sid)
    manager.finish(sid, "stop")
    assert manager.evict_cached() >= 1


def publish_until_received(stream: EventStream, manager: KVCacheManager,
                           received: Callable[[], bool], step: int,
                           probe_every_s: float = 0.05) -> int:
    """Publish probe steps, from step number ``step`` on, until ``received()`` (a quick
    look at the subscriber) is true; returns the next free step number. A new probe goes
    out every ``probe_every_s`` (pacing only: a late subscription just takes more). With an
    engine's own stream and cache manager, call it before the engine's first step."""
    end = time.monotonic() + HANG_S
    while True:
        with stream.engine_lock or contextlib.nullcontext():  # as an engine steps
            probe_step(manager)
            stream.end_step(step, {})
        step += 1
        next_probe = time.monotonic() + probe_every_s
        while time.monotonic() < next_probe:
            if received():
                return step
            time.sleep(0.002)
        if time.monotonic() > end:
            raise AssertionError(f"no probe reached the subscriber in {HANG_S:.0f} s")
