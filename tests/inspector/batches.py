"""Valid event batches for the inspector tests, from engine.events' seeded SyntheticCache."""

from __future__ import annotations

from typing import Any

from engine.bench.synthetic import SyntheticCache
from engine.events import PROTOCOL_VERSION, ListSink


def synthetic_batches(n: int, seed: int = 0, **kw: Any) -> list[dict[str, Any]]:
    """``n`` consecutive step batches (steps 0..n-1, 50 ms apart) that KVState accepts."""
    cache, sink, out = SyntheticCache(seed=seed, **kw), ListSink(), []
    for step in range(n):
        stats = cache.step(sink)
        out.append({"v": PROTOCOL_VERSION, "step": step, "time": 1_700_000_000.0 + 0.05 * step,
                    "events": sink.drain(), "stats": stats})
    return out
