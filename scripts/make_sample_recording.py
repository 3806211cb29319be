"""Write assets/sample.kvtrace: the small recording `kvscope inspect` opens by default.

    .venv/bin/python scripts/make_sample_recording.py [--out PATH] [--steps N] [--seed S]

Drives the real KVCacheManager (engine.cache) with a seeded synthetic request stream
(no model: token ids are random) and records every step with engine.events'
RecordingWriter. The real engine can regenerate it later with a model in the loop.
Same seed, same file content (except the header's creation time).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvscope.engine.cache.manager import KVCacheManager  # noqa: E402
from kvscope.engine.events import PROTOCOL_VERSION, KVState, ListSink  # noqa: E402
from kvscope.engine.events.wire.recording import RecordingWriter  # noqa: E402

T0 = 1_763_800_000.0
GPU_BLOCKS = 288
MAX_RUNNING = 32  # fixed start time: the file does not depend on when it was made


def manager_steps(steps: int, seed: int) -> Any:
    """(batch, state) per step from the real KVCacheManager under a small scheduler loop:
    requests sharing three system prompts (prefix hits), parallel samples (fork +
    copy-on-write), a pool small enough to force lazy eviction and recompute preemption."""
    rng = random.Random(seed)
    sink, state = ListSink(), KVState()
    mgr = KVCacheManager(num_gpu_blocks=GPU_BLOCKS, block_size=16, sink=sink)
    systems = [[rng.randrange(1, 49152) for _ in range(rng.randint(48, 140))] for _ in range(3)]
    waiting: deque[str] = deque()
    running: list[str] = []
    budget: dict[str, int] = {}  # tokens still to generate
    started: set[str] = set()  # sequences that ran once (a re-admission is a resume)
    next_id = 0
    for step in range(steps):
        # Arrivals: a burst (the queue builds, the pool fills, preemption), then a lull
        # (the queue drains). A shared system prompt plus a user tail; some fork.
        for _ in range(rng.choices((0, 1, 2), (4, 5, 1) if step < 250 else (9, 1, 0))[0]):
            sid = f"req{next_id}"
            next_id += 1
            prompt = rng.choice(systems) + [rng.randrange(1, 49152)
                                            for _ in range(rng.randint(8, 90))]
            mgr.add_sequence(sid, prompt, priority=rng.randint(0, 2))
            budget[sid] = rng.randint(32, 360)
            waiting.append(sid)
        scheduled = 0
        # Admission (FIFO): share the cached prefix, prefill the rest, or wait.
        while waiting and len(running) < MAX_RUNNING:
            sid = waiting[0]
            k = mgr.match_prefix(sid)
            n = len(mgr.token_ids(sid)) - k
            if not mgr.can_allocate(sid, n, watermark=0.02):
                mgr.free(sid)  # undo the shared prefix; stays waiting
                break
            waiting.popleft()
            mgr.allocate_slots(sid, n)
            first = sid not in started
            (mgr.start if first else mgr.resume)(sid)
            started.add(sid)
            mgr.append_token_ids(sid, [rng.randrange(1, 49152)])
            running.append(sid)
            scheduled += n
            if first and rng.random() < 0.3 and len(running) < MAX_RUNNING:  # parallel sampling
                child = f"{sid}.b"
                mgr.fork(sid, child)
                started.add(child)
                budget[child] = rng.randint(16, 120)
                running.append(child)
        # Decode one token for every running sequence admitted before this step.
        for sid in list(running):
            if sid not in running:
                continue  # preempted below in this step
            while mgr.allocate_slots(sid, 1) is None:
                victim = running.pop()  # newest first, as vLLM does
                mgr.preempt(victim)
                waiting.appendleft(victim)
                if victim == sid:
                    break
            if sid not in running:
                continue
            mgr.append_token_ids(sid, [rng.randrange(1, 49152)])
            scheduled += 1
            budget[sid] -= 1
            if budget[sid] <= 0 or rng.random() < 0.004:
                running.remove(sid)
                mgr.finish(sid, "length" if budget[sid] <= 0 else "stop")
        mgr.take_copy_orders()
        mgr.flush_step_events()
        m = mgr.metrics()
        stats = {
            "running": len(running), "waiting": len(waiting), "swapped": 0,
            "scheduled_tokens": scheduled, "step_time_s": 0.05,
            # counters are cumulative, as the engine reports them (schema docstring)
            "hit_tokens": m["prefix_hit_tokens"], "query_tokens": m["prefix_query_tokens"],
            "preemptions": m["preemptions"], "evictions": m["evictions"], "tiers": m["tiers"],
        }
        batch = {"v": PROTOCOL_VERSION, "epoch": "sample", "seq": step + 1, "step": step,
                 "time": T0 + 0.05 * step, "events": sink.drain(), "stats": stats}
        state.apply(batch)
        yield batch, state
    if state.canonical() != mgr.snapshot():
        raise SystemExit("the events do not rebuild the manager's state: not writing a sample")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "assets" / "sample.kvtrace"))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    t = time.perf_counter()
    header = {"engine": {"workload": "KVCacheManager, synthetic requests", "seed": args.seed,
                         "gpu_blocks": GPU_BLOCKS, "block_size": 16}, "model": None,
              "source": "scripts/make_sample_recording.py"}
    with RecordingWriter(args.out, header, keyframe_every_steps=100,
                         keyframe_every_s=1e9) as w:
        for batch, state in manager_steps(args.steps, args.seed):
            w.add(batch, state)
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(state.kind_counts.items()))
    size = Path(args.out).stat().st_size
    print(f"wrote {args.out}: {args.steps} steps, {size / 1024:.0f} KiB "
          f"in {time.perf_counter() - t:.1f} s\nevents: {kinds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
