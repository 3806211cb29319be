"""`kvscope bench events [--json]`: the event stream's costs, measured.

1. throughput: batches from the seeded synthetic workload (~256 running sequences, ~125
   events per step), sent as fast as possible to a child process on loopback, three ways:
   pre-encoded frames on a bare PUB socket (socket + codec capacity), an EventStream
   (emit, batch, publisher-side KVState mirror, encode) to a decoding SUB, and an
   EventStream to a full Subscriber (its own KVState mirror). events/s at the receiver,
   and loss (events published minus events received; seq gaps).
2. latency: emit -> apply (batch wall time at end_step vs. the subscriber's apply), at a
   paced 50 steps/s (an engine's step rate), p50/p99.
3. recording: bytes per 1k steps, and seek time (state_at on random steps) in a
   recording as long as one hour of steps at 20 steps/s.
4. overhead: the real KVCacheManager driven by a random scheduler-like workload
   (``ManagerWorkload``), step time with the stream off vs. on (publishing and
   recording), same seed, same process, interleaved rounds; for the cache step alone
   and with a GIL-releasing stand-in for the model forward (``bench_overhead``).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("events", help="event stream throughput, latency, recording, overhead")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quick", action="store_true", help="smaller runs (a smoke test)")
    p.set_defaults(func=run)


# ------------------------------------------------------------------ workloads
def make_batches(num_steps: int, seed: int = 0) -> list[tuple[list[dict], dict]]:
    """Pre-generated (events, stats) per step from the synthetic workload, big batches."""
    from engine.events.sink import ListSink
    from engine.events.synthetic import SyntheticCache

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


# ------------------------------------------------------------------ measurements
def _subscriber_proc(endpoint: str, snap: str, apply: bool, expect: int, q: Any) -> None:
    """Child process: receive until seq ``expect``; report counts and latencies."""
    import zmq

    from engine.events.codec import Codec
    from engine.events.subscriber import Subscriber

    if not apply:  # transport alone: SUB + decode + validate, no KVState
        ctx = zmq.Context()
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.RCVHWM, 100_000)
        s.setsockopt(zmq.SUBSCRIBE, b"kv")
        s.connect(endpoint)
        codec, events, last, gaps, t0 = Codec(), 0, 0, 0, None
        q.put(("ready", None))
        while last < expect:
            if not s.poll(10_000):
                break
            seq, msg = codec.decode_frames(s.recv_multipart())
            if msg["type"] != "batch":
                continue
            t0 = t0 or time.perf_counter()
            gaps += seq != last + 1 and last != 0
            last = seq
            events += len(msg["events"])
        q.put(("done", {"events": events, "seconds": time.perf_counter() - t0, "gaps": gaps,
                        "last": last}))
        s.close()
        ctx.term()
        return
    lat: list[float] = []
    sub = Subscriber(endpoint, snap)
    while sub.status == "waiting":
        sub.poll(0.05)
    q.put(("ready", None))
    t0 = None
    deadline = time.monotonic() + 120
    while sub.last_seq < expect and time.monotonic() < deadline:
        for u in sub.poll(0.05):
            if u["type"] == "batch":
                t0 = t0 or time.perf_counter()
                lat.append(time.time() - u["time"])
    q.put(("done", {"events": sub.events_applied, "seconds": time.perf_counter() - (t0 or 0),
                    "gaps": sub.gaps, "resyncs": sub.resyncs, "last": sub.last_seq,
                    "latency": lat}))
    sub.close()


def _publish(batches: list, apply: bool, pace_s: float = 0.0,
             wire_only: bool = False) -> dict[str, Any]:
    """Publish ``batches`` to a subscriber process. ``wire_only``: pre-encoded frames
    straight from a PUB socket (the socket + codec capacity, no EventStream)."""
    import zmq

    from engine.events.codec import Codec, make_batch
    from engine.events.stream import EventStream

    if wire_only:
        codec, zctx = Codec(), zmq.Context()
        pub = zctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        pub.bind("tcp://127.0.0.1:*")
        endpoint, snap = pub.getsockopt_string(zmq.LAST_ENDPOINT), "tcp://127.0.0.1:1"
        frames = [codec.encode_frames(make_batch("w", i + 1, i, time.time(), ev, st))
                  for i, (ev, st) in enumerate(batches)]
    else:
        stream = EventStream("tcp://127.0.0.1:0", queue_size=100_000)
        endpoint, snap = stream.endpoint, stream.snapshot_endpoint
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_subscriber_proc, args=(endpoint, snap, apply, len(batches), q))
    proc.start()
    assert q.get(timeout=60)[0] == "ready"
    time.sleep(0.3)  # let the SUB's subscription reach the PUB (slow joiner)
    emitted = sum(len(ev) for ev, _ in batches)
    t0 = time.perf_counter()
    if wire_only:
        for f in frames:
            pub.send_multipart(f)
    else:
        for step, (events, stats) in enumerate(batches):
            for ev in events:
                stream.sink.emit(**ev)
            stream.end_step(step, stats)
            if pace_s:
                time.sleep(pace_s)
    t_pub = time.perf_counter() - t0
    _, res = q.get(timeout=300)
    proc.join(30)
    if wire_only:
        pub.close()
        zctx.term()
        dropped = 0
    else:
        stream.close()
        dropped = stream.dropped_batches
    res.update(emitted=emitted, publish_seconds=t_pub, dropped=dropped)
    return res


def bench_throughput(num_steps: int) -> dict[str, Any]:
    batches = make_batches(num_steps)
    out = {}
    modes = (("wire: PUB -> SUB decode+validate", False, True),
             ("EventStream -> SUB decode+validate", False, False),
             ("EventStream -> Subscriber (KVState mirror)", True, False))
    for name, apply, wire in modes:
        r = _publish(batches, apply, wire_only=wire)
        out[name] = {
            "events": r["emitted"], "steps": num_steps,
            "events_per_step": round(r["emitted"] / num_steps, 1),
            "events_per_s": round(r["events"] / r["seconds"]),
            "lost_events": r["emitted"] - r["events"] if r["last"] == num_steps else None,
            "seq_gaps": r["gaps"], "publisher_dropped": r["dropped"],
        }
    return out


def bench_latency(num_steps: int) -> dict[str, Any]:
    batches = make_batches(num_steps, seed=1)
    r = _publish(batches, True, pace_s=0.02)
    lat = sorted(r["latency"])
    q = statistics.quantiles(lat, n=100)
    return {"steps": len(lat), "pace_steps_per_s": 50,
            "events_per_step": round(r["emitted"] / num_steps, 1),
            "p50_ms": round(q[49] * 1e3, 3), "p99_ms": round(q[98] * 1e3, 3),
            "max_ms": round(lat[-1] * 1e3, 3)}


def bench_recording(num_steps: int, seeks: int) -> dict[str, Any]:
    from engine.events.recording import Recording
    from engine.events.stream import EventStream

    batches = make_batches(min(num_steps, 2000), seed=2)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "bench.kvtrace"
        # one hour at 20 steps/s; the synthetic batches repeat is not possible (state),
        # so the long recording uses a smaller workload generated on the fly
        from engine.events.synthetic import SyntheticCache
        t0 = time.perf_counter()
        with EventStream(record_path=str(path), keyframe_every_steps=200,
                         keyframe_every_s=1e9, queue_size=100_000) as s:
            gen = SyntheticCache(seed=3, gpu_blocks=4096, cpu_blocks=1024, max_running=64,
                                 arrival_rate=0.8)
            for step in range(num_steps):
                s.end_step(step, gen.step(s.sink))
        write_s = time.perf_counter() - t0
        size = path.stat().st_size
        rng = random.Random(0)
        with Recording(path) as rec:
            t0 = time.perf_counter()
            Recording(path).close()
            open_s = time.perf_counter() - t0
            times = []
            for step in rng.sample(rec.steps, seeks):
                t0 = time.perf_counter()
                rec.state_at(step)
                times.append(time.perf_counter() - t0)
        times.sort()
        big_path = Path(d) / "big.kvtrace"
        with EventStream(record_path=str(big_path), queue_size=100_000) as s:
            for step, (events, stats) in enumerate(batches):
                for ev in events:
                    s.sink.emit(**ev)
                s.end_step(step, stats)
        big_bytes = big_path.stat().st_size
    return {
        "steps": num_steps, "hour_at_steps_per_s": round(num_steps / 3600, 1),
        "workload": "synthetic, 64 running seqs, 4096+1024 blocks",
        "bytes": size, "bytes_per_1k_steps": round(size / num_steps * 1000),
        "write_seconds": round(write_s, 2), "open_seconds": round(open_s, 4),
        "seek_p50_ms": round(times[len(times) // 2] * 1e3, 1),
        "seek_max_ms": round(times[-1] * 1e3, 1), "seeks": seeks,
        "large_batches_bytes_per_1k_steps": round(big_bytes / len(batches) * 1000),
        "large_batches_events_per_step": round(
            sum(len(e) for e, _ in batches) / len(batches), 1),
    }


def bench_overhead(blocks: int, model_ms: float = 20.0) -> dict[str, Any]:
    """Stream off vs. on, same seeded manager workload, one process.

    Two identical workloads (same seed) run side by side, one per stream, in alternating
    blocks of 10 steps, so both see the same machine load (the dev box is shared). An "on"
    block ends only when the stream thread has handled its batches (``wait_idle``), so
    the background work is charged to it in full, overlap or not. Reported: the median
    over blocks of the per-step time. Two step shapes: the cache bookkeeping alone (all
    Python: the worst case) and the same plus a stand-in for the model forward, torch
    matmuls of ~``model_ms`` that release the GIL as a real CPU forward does.
    """
    from engine.cache import KVCacheManager
    from engine.events.state import KVState
    from engine.events.stream import EventStream

    forward = _model_stand_in(model_ms)
    out: dict[str, Any] = {"blocks_of_10_steps": blocks,
                           "workload": "KVCacheManager 4096x16 blocks, <=64 running"}
    with tempfile.TemporaryDirectory() as d:
        for name, with_model in (("cache_only", False), ("cache_plus_model", True)):
            streams = [EventStream(), EventStream("tcp://127.0.0.1:0", str(Path(d) / "o"))]
            runs = []
            for s in streams:
                m = KVCacheManager(4096, 16, sink=s.sink)
                s.snapshot_fn = lambda m=m: KVState.from_canonical(m.snapshot()).snapshot()
                runs.append((s, m, ManagerWorkload(m, seed=7)))
            times: list[list[float]] = [[], []]
            step = 0
            n_blocks = blocks if not with_model else max(10, blocks // 5)
            for b in range(n_blocks + 5):  # the first 5 blocks warm up
                for i, (s, _, w) in enumerate(runs):
                    t0 = time.perf_counter()
                    for k in range(10):
                        stats = w.step()
                        if with_model:
                            forward()
                        s.end_step(step + k, stats)
                    s.wait_idle()
                    if b >= 5:
                        times[i].append((time.perf_counter() - t0) / 10)
                step += 10
            for s, _m, _ in runs:
                s.close()
            on_stream, on_manager = runs[1][0], runs[1][1]
            assert on_stream.mirror.canonical() == on_manager.snapshot(), "mirror diverged"
            off, on = statistics.median(times[0]), statistics.median(times[1])
            out[name] = {"step_ms_off": round(off * 1e3, 3), "step_ms_on": round(on * 1e3, 3),
                         "overhead_ms_per_step": round((on - off) * 1e3, 3),
                         "overhead_pct": round((on - off) / off * 100, 1),
                         "events_per_step": round(
                             sum(on_stream.mirror.kind_counts.values()) / step, 1)}
    out["model_stand_in"] = f"torch matmuls, ~{model_ms:g} ms per step (GIL released)"
    return out


def _model_stand_in(target_ms: float) -> Any:
    """A callable that does ~target_ms of torch matmul work (calibrated here)."""
    import torch

    a = torch.randn(512, 512)
    b = torch.randn(512, 512)
    t0 = time.perf_counter()
    for _ in range(10):
        torch.mm(a, b)
    per = (time.perf_counter() - t0) / 10
    reps = max(1, round(target_ms / 1e3 / per))

    def forward() -> None:
        for _ in range(reps):
            torch.mm(a, b)

    return forward


def run(args: argparse.Namespace) -> int:
    quick = args.quick
    result = {
        "throughput": bench_throughput(300 if quick else 2000),
        "latency": bench_latency(100 if quick else 500),
        "recording": bench_recording(2000 if quick else 72_000, 20 if quick else 100),
        "overhead": bench_overhead(10 if quick else 100),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for section, values in result.items():
            print(f"[{section}]")
            for k, v in values.items():
                print(f"  {k}: {v}")
    return 0
