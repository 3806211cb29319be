"""`kvscope bench blocks`: the cache manager's bookkeeping speed on one big pool.

Measures (block size 16 by default, 100k-block gpu pool, prefix caching on):
- alloc_free: match_prefix (a miss) + allocate_slots(2048) + free of distinct 2k-token
  prompts (added beforehand), in sequences/s: nano-vllm's allocate + deallocate. The pool
  fills with cached blocks after ~780 sequences, so most of the run also pays hashing,
  indexing and lazy eviction. ``alloc_free_with_add`` also counts add_sequence (the
  prompt copy and validation) and finish.
- decode: tokens/s of the per-token decode work, round-robin over running sequences:
  ``allocate_slots(s, 1)`` alone (the slot bump), and with ``append_token_ids(s, [t])``.
- prefix_match: ``match_prefix`` of a 4k-token prompt whose first 2k tokens are cached,
  in microseconds (the cached blocks free, i.e. revived from the eviction queue, and in use).
Times are this process's CPU time (time.process_time), so other work on a shared machine
is not counted, and each number is the best of ``--repeat`` runs (the least disturbed).
``--events`` also runs every case with a recording ListSink.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("blocks", help="KV cache manager bookkeeping speed (no GPU needed)")
    p.add_argument("--blocks", type=int, default=100_000, help="gpu pool size in blocks")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seqs", type=int, default=1500, help="sequences for alloc_free")
    p.add_argument("--decode-tokens", type=int, default=400_000)
    p.add_argument("--matches", type=int, default=300)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--policy", default="lru", help="eviction policy: lru, lfu, priority")
    p.add_argument("--events", action="store_true", help="also measure with a ListSink")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvscope.engine.events.sink import ListSink, NullSink

    sinks = [("null", NullSink)] + ([("list", ListSink)] if args.events else [])
    results: dict[str, Any] = {
        "blocks": args.blocks, "block_size": args.block_size, "policy": args.policy,
        "python": sys.version.split()[0],
    }
    for name, sink_cls in sinks:
        suffix = "" if name == "null" else "_events"

        def best(fn: Any, *a: Any, _cls: Any = sink_cls) -> Any:
            return max((fn(args, _cls, *a) for _ in range(args.repeat)), key=_score)

        results["alloc_free_seq_per_s" + suffix] = best(bench_alloc_free, False)
        results["alloc_free_with_add_seq_per_s" + suffix] = best(bench_alloc_free, True)
        dec = best(bench_decode)
        results["decode_slot_tok_per_s" + suffix] = dec[0]
        results["decode_slot_and_append_tok_per_s" + suffix] = dec[1]
        for shared in (False, True):
            key = "prefix_match_4k_us" + ("_in_use" if shared else "_revive") + suffix
            results[key] = -best(bench_prefix_match, shared)
    if args.json:
        print(json.dumps(results))
    else:
        for k, v in results.items():
            print(f"{k:42s} {v:,.1f}" if isinstance(v, float) else f"{k:42s} {v}")
    return 0


clock = time.process_time


def _score(x: Any) -> float:
    return x[0] + x[1] if isinstance(x, tuple) else x


def _manager(args: argparse.Namespace, sink_cls: Any) -> Any:
    from kvscope.engine.cache import KVCacheManager

    return KVCacheManager(args.blocks, args.block_size, eviction_policy=args.policy,
                          sink=sink_cls())


def _drain(m: Any) -> None:
    if m.sink.enabled:
        m.sink.drain()


def bench_alloc_free(args: argparse.Namespace, sink_cls: Any, with_add: bool) -> float:
    m = _manager(args, sink_cls)
    rng = random.Random(0)
    base = [rng.randrange(32000) for _ in range(2048)]
    prompts = [[i] + base[1:] for i in range(args.seqs)]  # distinct first block: all miss
    names = [f"s{i}" for i in range(args.seqs)]
    if not with_add:
        for sid, prompt in zip(names, prompts, strict=True):
            m.add_sequence(sid, prompt)
        _drain(m)
    t0 = clock()
    for sid, prompt in zip(names, prompts, strict=True):
        if with_add:
            m.add_sequence(sid, prompt)
        m.match_prefix(sid)
        m.allocate_slots(sid, 2048)
        if with_add:
            m.finish(sid, "stop")
        else:
            m.free(sid)
        _drain(m)
    return args.seqs / (clock() - t0)


def bench_decode(args: argparse.Namespace, sink_cls: Any) -> tuple[float, float]:
    m = _manager(args, sink_cls)
    num_seqs = 256
    names = [f"d{i}" for i in range(num_seqs)]
    for sid in names:
        m.add_sequence(sid, list(range(1, 40)))
        m.allocate_slots(sid, 39)
        m.start(sid)
    rounds = max(1, args.decode_tokens // num_seqs)
    alloc, append, flush = m.allocate_slots, m.append_token_ids, m.flush_step_events
    tok = [7]
    t0 = clock()
    for _ in range(rounds):
        for sid in names:
            alloc(sid, 1)
        flush()
        _drain(m)
    slot_rate = rounds * num_seqs / (clock() - t0)
    t0 = clock()
    for _ in range(rounds):
        for sid in names:
            append(sid, tok)
            alloc(sid, 1)
        flush()
        _drain(m)
    both_rate = rounds * num_seqs / (clock() - t0)
    return slot_rate, both_rate


def bench_prefix_match(args: argparse.Namespace, sink_cls: Any, shared: bool) -> float:
    """Negative mean microseconds per match (negative so that `best` takes the fastest)."""
    m = _manager(args, sink_cls)
    rng = random.Random(1)
    prefix = [rng.randrange(32000) for _ in range(2048)]
    m.add_sequence("base", prefix)
    m.allocate_slots("base", 2048)
    if not shared:
        m.finish("base", "stop")  # its 128 blocks are now cached free (evictable)
    total = 0.0
    for i in range(args.matches):
        sid = f"q{i}"
        m.add_sequence(sid, prefix + [rng.randrange(32000) for _ in range(2048)])
        t0 = clock()
        hit = m.match_prefix(sid)
        total += clock() - t0
        if hit != 2048:
            raise RuntimeError(f"expected a 2048-token hit, got {hit}")
        m.finish(sid, "stop")
        _drain(m)
    return -total / args.matches * 1e6
