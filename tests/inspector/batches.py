"""Valid event batches for the inspector tests, from engine.events' seeded SyntheticCache."""

from __future__ import annotations

from typing import Any

from kvscope.engine.bench.synthetic import SyntheticCache
from kvscope.engine.events import PROTOCOL_VERSION, ListSink


def synthetic_batches(n: int, seed: int = 0, **kw: Any) -> list[dict[str, Any]]:
    """``n`` consecutive step batches (steps 0..n-1, 50 ms apart) that KVState accepts."""
    cache, sink, out = SyntheticCache(seed=seed, **kw), ListSink(), []
    for step in range(n):
        stats = cache.step(sink)
        out.append({"v": PROTOCOL_VERSION, "step": step, "time": 1_700_000_000.0 + 0.05 * step,
                    "events": sink.drain(), "stats": stats})
    return out


def disk_batches(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` step batches of a real cache manager with gpu, host and disk tiers (the disk
    side faked, tests.disk.fake_disk): prompts over a few shared prefixes spill to disk and
    are prefetched back (every fifth request gives its wait up at once and recomputes);
    stats carry each tier's block counts as the engine's do."""
    import random

    from kvscope.engine.cache import KVCacheManager
    from tests.disk.fake_disk import FakeDisk

    rng, sink, disk = random.Random(seed), ListSink(), FakeDisk()
    m = KVCacheManager(24, 4, num_cpu_blocks=12, num_disk_blocks=96, sink=sink)
    prefixes = [[rng.randrange(10, 1000) for _ in range(16)] for _ in range(30)]
    waiting: list[tuple[str, list[int]]] = []
    out = []
    for step in range(n):
        if step == n // 2:  # some files go bad: their reads miss
            disk.bad_files.update(sorted(disk.files)[:6])
        disk.run(m)
        disk.report(m)
        if rng.random() < 0.7:
            sid = f"r{step}"
            tail = [rng.randrange(2000, 3000) for _ in range(3)]
            prompt = rng.choice(prefixes)[:rng.choice([8, 12, 16])] + tail
            m.add_sequence(sid, prompt)
            waiting.append((sid, prompt))
        still = []
        for sid, prompt in waiting:
            if m.prefetch(sid):
                if int(sid[1:]) % 5:
                    still.append((sid, prompt))
                    continue
                m.give_up_prefetch(sid)
            hit = m.match_prefix(sid)
            if m.allocate_slots(sid, len(prompt) - hit) is None:
                m.finish(sid, "abort")
                continue
            m.start(sid)
            m.finish(sid, "stop")
        waiting = still
        m.flush_step_events()
        met = m.metrics()
        stats = {"tiers": met["tiers"], "running": 0, "waiting": len(waiting),
                 "hit_tokens": met["prefix_hit_tokens"],
                 "query_tokens": met["prefix_query_tokens"]}
        out.append({"v": PROTOCOL_VERSION, "step": step, "time": 1_700_000_000.0 + 0.05 * step,
                    "events": sink.drain(), "stats": stats})
    return out
