"""Event workloads: pre-generated kvscope event batches for benchmarks and tests.

- ``make_batches``: the synthetic cache (``engine.bench.synthetic``), big batches;
- ``ManagerWorkload`` / ``realistic_batches``: the real ``KVCacheManager`` driven the way
  the scheduler drives it (admission with prefix matching, decode, preemption, forks);
- ``bulk_batches``: long-context prefill bursts on a 1M-block tier;
- ``sink_call``: the sink call the manager makes for an event, to replay its cost.

Every stream here is valid: ``KVState.apply`` accepts each batch."""

from __future__ import annotations

import gc
import random
from typing import Any


def make_batches(num_steps: int, seed: int = 0) -> list[tuple[list[dict], dict]]:
    """Pre-generated (events, stats) per step from the synthetic workload, big batches."""
    from kvscope.engine.bench.synthetic import SyntheticCache
    from kvscope.engine.events.sink import ListSink

    gen = SyntheticCache(seed=seed, gpu_blocks=16384, cpu_blocks=4096, max_running=256,
                         arrival_rate=0.95)
    sink, out = ListSink(), []
    for _ in range(num_steps):
        stats = gen.step(sink)
        out.append((sink.drain(), stats))
    # Millions of pre-generated event objects would make every full GC pass crawl over
    # them, a cost a real engine (which holds no event history) does not pay.
    gc.freeze()
    return out


class ManagerWorkload:
    """Drives engine.cache.KVCacheManager the way the scheduler does (admit with prefix
    matching, decode one token per running sequence, preempt on memory pressure, fork,
    finish). Prompts share prefixes so that hits, stores and evictions all happen."""

    def __init__(self, manager: Any, seed: int = 0, max_running: int = 64,
                 vocab: int = 500) -> None:
        self.m = manager
        self.rng = random.Random(seed)
        self.max_running = max_running
        self.vocab = vocab
        self.prefixes = [[self.rng.randrange(vocab) for _ in range(self.rng.randint(16, 96))]
                         for _ in range(8)]
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.preempted: set[str] = set()
        self.next_id = 0

    def step(self) -> dict[str, Any]:
        m, rng = self.m, self.rng
        for _ in range(rng.choice((0, 1, 1, 2, 3))):  # arrivals
            sid = f"r{self.next_id}"
            self.next_id += 1
            prompt = rng.choice(self.prefixes) + [rng.randrange(self.vocab)
                                                  for _ in range(rng.randint(1, 64))]
            m.add_sequence(sid, prompt)
            self.waiting.append(sid)
        if self.running and rng.random() < 0.05:  # parallel sampling: fork a running one
            parent = rng.choice(self.running)
            child = f"r{self.next_id}"
            self.next_id += 1
            try:
                m.fork(parent, child)
                self.running.append(child)
            except Exception:  # a parent mid-lookahead cannot fork; that is fine
                pass
        for sid in list(self.waiting):  # admission
            if len(self.running) >= self.max_running:
                break
            k = m.match_prefix(sid)
            n = len(m.token_ids(sid)) - k
            slots = m.allocate_slots(sid, n) if m.can_allocate(sid, n, 0.05) else None
            if slots is None:
                m.free(sid)
                break
            if sid in self.preempted:
                m.resume(sid)
                self.preempted.discard(sid)
            else:
                m.start(sid)
            self.waiting.remove(sid)
            self.running.append(sid)
        decoded = 0
        for sid in list(self.running):  # decode one token each
            r = rng.random()
            if r < 0.03:
                m.finish(sid, "stop")
                self.running.remove(sid)
                continue
            if m.allocate_slots(sid, 1) is None:
                m.preempt(sid)
                self.running.remove(sid)
                self.waiting.insert(0, sid)
                self.preempted.add(sid)
                continue
            m.append_token_ids(sid, [rng.randrange(self.vocab)])
            decoded += 1
        m.take_copy_orders()
        m.flush_step_events()
        return {"running": len(self.running), "waiting": len(self.waiting),
                "scheduled_tokens": decoded}


TYPED_CALLS = ("block_op", "store", "evict", "seq_tokens", "seq_add", "seq_start",
               "seq_finish")


def sink_call(ev: dict[str, Any]) -> tuple[str | None, Any]:
    """The sink call the cache manager makes for this event, as (``EventSink`` method
    name, its arguments), or (None, the map) for ``emit(**map)``: what a benchmark
    replays to charge a sink exactly what the manager's calls cost it."""
    kind = ev["kind"]
    if "group" in ev:
        return None, ev
    if kind in ("alloc", "free", "hit"):
        return "block_op", (kind, ev["tier"], ev["seq"], ev["blocks"], ev.get("tokens", 0))
    if kind == "store" and set(ev) == {"kind", "tier", "blocks", "hashes"}:
        return "store", (ev["tier"], ev["blocks"], ev["hashes"])
    if kind == "evict" and set(ev) <= {"kind", "tier", "blocks", "cause"}:
        return "evict", (ev["tier"], ev["blocks"], ev.get("cause"))
    if kind == "seq_tokens":
        return "seq_tokens", (ev["seqs"], ev["num_tokens"])
    if kind == "seq_add" and "parent" not in ev:
        return "seq_add", (ev["seq"], ev["prompt_tokens"], ev["priority"])
    if kind == "seq_start":
        return "seq_start", (ev["seq"],)
    if kind == "seq_finish":
        return "seq_finish", (ev["seq"], ev["reason"], ev["num_tokens"],
                              ev["output_tokens"])
    return None, ev


def realistic_batches(num_steps: int, seed: int = 0) -> list[tuple[list[dict], dict]]:
    """What an engine emits: the real KVCacheManager (16384 blocks of 16) driven by the
    scheduler-like ``ManagerWorkload`` (prefix hits, forks, preemption)."""
    from kvscope.engine.cache import KVCacheManager
    from kvscope.engine.events.sink import ListSink

    sink = ListSink()
    work = ManagerWorkload(KVCacheManager(16384, 16, sink=sink), seed=seed, max_running=256)
    out = [(sink.drain(), {})]  # the tier_init events
    for _ in range(num_steps - 1):
        stats = work.step()
        out.append((sink.drain(), stats))
    gc.freeze()  # as make_batches
    return out


def bulk_batches(num_steps: int, blocks_per_seq: int = 1024, live: int = 64,
                 num_blocks: int = 1 << 20) -> list[tuple[list[dict], dict]]:
    """Long-context prefill bursts on a 1M-block tier: each step two sequences arrive
    and allocate + store ``blocks_per_seq`` blocks each, the oldest beyond ``live`` are
    freed (their blocks stay cached), and cached blocks are evicted when the free pool
    runs short. A valid stream (the tests apply it)."""
    import collections

    free = collections.deque(range(num_blocks))
    cached: collections.deque[int] = collections.deque()
    seqs: collections.deque[tuple[str, list[int]]] = collections.deque()
    out = [([{"kind": "tier_init", "tier": "gpu", "num_blocks": num_blocks,
              "block_size": 16, "format": "auto"}], {})]
    n = 0
    for _ in range(num_steps - 1):
        events: list[dict] = []
        for _ in range(2):
            if len(free) < blocks_per_seq:
                victims = [cached.popleft() for _ in range(blocks_per_seq)]
                events.append({"kind": "evict", "tier": "gpu", "blocks": victims})
                free.extend(victims)
            sid, n = f"s{n}", n + 1
            blocks = [free.popleft() for _ in range(blocks_per_seq)]
            events += [
                {"kind": "seq_add", "seq": sid, "prompt_tokens": 16 * blocks_per_seq},
                {"kind": "seq_start", "seq": sid},
                {"kind": "alloc", "tier": "gpu", "seq": sid, "blocks": blocks},
                {"kind": "store", "tier": "gpu", "blocks": blocks,
                 "hashes": [hash((sid, b)) for b in blocks]},
            ]
            seqs.append((sid, blocks))
        while len(seqs) > live:
            sid, blocks = seqs.popleft()
            events += [{"kind": "free", "tier": "gpu", "seq": sid, "blocks": blocks},
                       {"kind": "seq_finish", "seq": sid, "reason": "stop"}]
            cached.extend(blocks)
        events.append({"kind": "seq_tokens", "seqs": [s for s, _ in seqs],
                       "num_tokens": [16 * len(b) for _, b in seqs]})
        out.append((events, {"running": len(seqs)}))
    return out
