"""vLLM-format KV events: what they cost. Prints measured numbers (docs/BENCHMARKS.md).

1. The cache manager's step with the sink's ``store_detail`` off vs on (the parents and
   tokens a vLLM publisher needs), same seeded workload, alternating A/B passes.
2. The vLLM publisher's own thread: translate + encode of those batches (kvscope events
   in, vLLM payload bytes out), per batch and per vLLM event.

    .venv/bin/python scripts/bench_vllm_events.py [--steps 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

from kvscope.engine.bench.event_workloads import ManagerWorkload
from kvscope.engine.cache import KVCacheManager
from kvscope.engine.events.sink import ListSink
from kvscope.engine.events.vllm import kv_events_wire as W
from kvscope.engine.events.vllm.translate import VllmTranslator
from kvscope.engine.events.wire.codec import make_batch


def run(detail: bool, steps: int) -> tuple[float, list[dict]]:
    sink = ListSink()
    sink.store_detail = detail
    manager = KVCacheManager(2048, 16, sink=sink)
    work = ManagerWorkload(manager, seed=11, max_running=64)
    batches = [make_batch("e", 0, 0, 0.0, sink.drain(), {})]
    t = 0.0
    for step in range(1, steps):
        t0 = time.perf_counter()
        stats = work.step()
        t += time.perf_counter() - t0
        batches.append(make_batch("e", step, step, float(step), sink.drain(), stats))
    return t, batches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    best = {False: float("inf"), True: float("inf")}
    for _ in range(args.repeats):
        for detail in (False, True):  # alternate A/B
            t, batches = run(detail, args.steps)
            best[detail] = min(best[detail], t)
    off, on = best[False] / args.steps * 1e6, best[True] / args.steps * 1e6
    print(f"manager step (2048 blocks, up to 64 running), best of {args.repeats}: "
          f"store_detail off {off:.1f} us, on {on:.1f} us ({(on / off - 1) * 100:+.1f}%)")
    tr, enc = VllmTranslator(), W.Encoder()
    t0 = time.perf_counter()
    n_events = n_bytes = n_pub = 0
    for b in batches:
        events = tr.translate(b)
        if events:
            n_bytes += len(enc.encode(b["time"], events, 0))
            n_events += len(events)
            n_pub += 1
    dt = time.perf_counter() - t0
    kv_events = sum(len(b["events"]) for b in batches)
    print(f"translate + encode: {len(batches)} kvscope batches ({kv_events} events) -> "
          f"{n_pub} vLLM batches, {n_events} vLLM events, {n_bytes / 1e6:.2f} MB in "
          f"{dt * 1e3:.0f} ms: {dt / len(batches) * 1e6:.1f} us per kvscope batch, "
          f"{n_events / dt:,.0f} vLLM events/s")


if __name__ == "__main__":
    main()
