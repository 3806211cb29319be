"""The event stream's costs, measured:
``python scripts/bench_events.py [--json] [--quick] [--only SECTION]``.
(`scripts/bench_events_ab.py REV` runs the end-to-end rows against another revision of
the repository, side by side in one run.)

1. throughput, end to end: an EventStream in one process publishing pre-generated
   batches as fast as it can -> loopback -> a ``Subscriber`` with its own KVState mirror
   in another process (``_events_pipeline.py``). Two mixes: the realistic one (the real
   ``KVCacheManager`` driven by ``ManagerWorkload``: what an engine emits) and a
   bulk-heavy one (long-context prefill bursts: 1024-block allocs, stores, frees and
   evictions on a 1M-block tier). events/s at the subscriber, lost events, seq gaps;
   each mix with the per-event sink (the baseline row) and the engine's columns.
   Then the subscriber's side alone, in process (CPU time): decode and apply per event,
   and the columnar apply (``engine.events.state_columns``) of the same batches beside
   the reference, alternating.
2. latency: emit -> apply at a paced 50 steps/s, p50/p99.
3. recording: bytes per 1k steps, and seek time (``state_at``) in a one-hour recording.
4. overhead: the real KVCacheManager plus a 10 ms GIL-releasing stand-in for a GPU step
   (a sleep: a GPU step leaves the CPU idle), step time with the stream off and on
   (publishing and recording), in alternating blocks of 10 steps.
5. flood: the same engine stand-in publishing, quiet vs. flooded by a hostile client in
   another process (snapshot and replay requests as fast as it can send, never reading
   a reply), and flooded with snapshot coalescing off (``snapshot_interval_s=0``: one
   cache snapshot per step, what a flood cost before), alternating blocks of 10 steps.
   ``--only flood`` runs this one alone.
6. emit: the engine thread's CPU time per block event, the per-event sink (a map per
   event) vs. the engine's columns (``ColumnSink.block_op``), alternating.
7. publish_overhead: a 10 ms GIL-releasing stand-in step emitting 100 and 1,000 events,
   stream off / on per-event / on with columns, alternating blocks of 10 steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from checkout import importable

from kvscope.engine.bench.event_workloads import (
    TYPED_CALLS,
    ManagerWorkload,
    bulk_batches,
    make_batches,
    realistic_batches,
    sink_call,
)

PIPELINE = Path(__file__).with_name("_events_pipeline.py")
REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ measurements
def _subscriber_proc(endpoint: str, snap: str, apply: bool, expect: int, q: Any) -> None:
    """Child process: receive until seq ``expect``; report counts and latencies."""
    import zmq

    from kvscope.engine.events.wire.codec import Codec
    from kvscope.engine.events.wire.subscriber import Subscriber

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

    from kvscope.engine.events.wire.codec import Codec, make_batch
    from kvscope.engine.events.wire.stream import EventStream

    if wire_only:
        codec, zctx = Codec(), zmq.Context()
        pub = zctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        pub.bind("tcp://127.0.0.1:*")
        endpoint, snap = pub.getsockopt_string(zmq.LAST_ENDPOINT), "tcp://127.0.0.1:1"
        frames = [codec.encode_frames(make_batch("w", i + 1, i, time.time(), ev, st))
                  for i, (ev, st) in enumerate(batches)]
    else:
        # joins before the first batch: the cache is empty (engine idle, lock free)
        stream = EventStream("tcp://127.0.0.1:0", queue_size=100_000,
                             snapshot_fn=lambda: {"tiers": {}, "seqs": {}},
                             engine_lock=threading.Lock())
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


def pipeline(root: Path, batches_file: Path, steps: int,
             sink: str = "columns") -> dict[str, Any]:
    """One end-to-end run (see ``_events_pipeline.py``) with the code at ``root``;
    ``sink``: "columns" or "per-event" (the baseline row)."""
    env = {**os.environ, "PYTHONPATH": importable(root)}
    cmd = [sys.executable, str(PIPELINE)]
    pub = subprocess.Popen([*cmd, "pub", str(batches_file), sink], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, env=env, cwd=root)
    sub = None
    try:
        info = json.loads(pub.stdout.readline())
        sub = subprocess.Popen([*cmd, "sub", info["endpoint"], info["snapshot_endpoint"],
                                str(steps)], stdout=subprocess.PIPE, text=True, env=env,
                               cwd=root)
        if not json.loads(sub.stdout.readline())["ready"]:
            raise RuntimeError("the subscriber got no snapshot")
        time.sleep(0.3)  # let the SUB's subscription reach the PUB (slow joiner)
        pub.stdin.write("go\n")
        pub.stdin.flush()
        res = json.loads(sub.stdout.readline())
        pub.stdin.write("done\n")
        pub.stdin.flush()
        res.update(json.loads(pub.stdout.readline()))
        return res
    finally:
        for proc in (sub, pub):
            if proc is not None:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()


def bench_throughput(num_steps: int, rounds: int = 2,
                     roots: dict[str, Path] | None = None) -> dict[str, Any]:
    """Both mixes, best of ``rounds``; with several ``roots`` (name -> a tree holding
    ``engine/``), each tree in turn, alternating."""
    import msgpack

    # this tree twice: the engine's columns, and the per-event sink (the baseline row)
    roots = roots or {"this tree, per-event sink": REPO, "this tree, columns": REPO}
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        mixes = {"realistic (KVCacheManager workload)": realistic_batches(num_steps),
                 "bulk-heavy (1024-block prefill bursts, 1M blocks)":
                     bulk_batches(max(50, num_steps // 20))}
        for mix, batches in mixes.items():
            path = tmp / "batches.msgpack"
            path.write_bytes(msgpack.packb(batches))
            emitted = sum(len(ev) for ev, _ in batches)
            ids = sum(len(e.get(f, ())) for ev, _ in batches for e in ev
                      for f in ("blocks", "src", "dst"))
            runs: dict[str, list[dict]] = {name: [] for name in roots}
            for _ in range(rounds):
                for name, root in roots.items():
                    sink = "per-event" if name.endswith("per-event sink") else "columns"
                    runs[name].append(pipeline(root, path, len(batches), sink))
            for name, rs in runs.items():
                best = max(rs, key=lambda r: r["events"] / max(r["seconds"], 1e-9))
                out[f"{mix} | {name}"] = {
                    "events": emitted, "steps": len(batches),
                    "events_per_step": round(emitted / len(batches), 1),
                    "events_per_s": round(best["events"] / best["seconds"]),
                    "block_ids_per_s": round(ids / best["seconds"]),
                    "all_runs_events_per_s": [round(r["events"] / r["seconds"]) for r in rs],
                    "lost_events": emitted - best["events"], "seq_gaps": best["gaps"],
                    "resyncs": best["resyncs"], "publisher_dropped": best["dropped"],
                    "publisher_seconds": round(best["publish_seconds"], 3),
                }
    return out


def bench_subscriber_side(num_steps: int, rounds: int = 3) -> dict[str, Any]:
    """Where the end-to-end time goes on the subscriber: decode (msgpack + validation)
    and ``KVState.apply`` per event, in process, CPU time (``time.process_time``: other
    processes on a shared box are not counted), best of ``rounds`` passes, on both
    mixes; the per-event frames (the baseline) and protocol 3's (bulk steps as columns,
    applied with arrays) alternating, each pass checked equal."""
    from kvscope.engine.events.state import KVState
    from kvscope.engine.events.wire import codec as C

    out: dict[str, Any] = {}
    mixes = {"realistic": realistic_batches(num_steps),
             "bulk-heavy": bulk_batches(max(50, num_steps // 20))}
    codec = C.Codec()
    for mix, batches in mixes.items():
        n = sum(len(ev) for ev, _ in batches)
        msgs = [C.make_batch("bench", i + 1, i, 0.0, C.pack_events([dict(e) for e in ev]), st)
                for i, (ev, st) in enumerate(batches)]
        forms = {"per-event": [codec.encode(m, columns=False) for m in msgs],
                 "protocol 3": [codec.encode(m) for m in msgs]}
        del msgs
        gc.freeze()  # the generated workload: no full GC pass should crawl over it
        best = {name: [1e9, 1e9] for name in forms}
        for r in range(rounds):
            states = {}
            for name in sorted(forms, reverse=bool(r % 2)):  # alternate which goes first
                frames = forms[name]
                t0 = time.process_time()
                decoded = [codec.decode(f) for f in frames]
                t1 = time.process_time()
                state = states[name] = KVState()
                for m in decoded:
                    state.apply(m)
                t2 = time.process_time()
                best[name] = [min(best[name][0], t1 - t0), min(best[name][1], t2 - t1)]
                del decoded
            a, b = states["per-event"], states["protocol 3"]
            if a.snapshot() != b.snapshot() or b.columns_refused:
                raise RuntimeError("protocol 3's columnar apply disagrees with the reference")
        out[mix] = {"events": n, "column_frames": sum(b"cols" in f for f in forms["protocol 3"])}
        for name, (dec, app) in best.items():
            out[mix][name] = {"decode_us_per_event": round(dec / n * 1e6, 2),
                              "apply_us_per_event": round(app / n * 1e6, 2),
                              "decode_plus_apply_events_per_s": round(n / (dec + app))}
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
    from kvscope.engine.events.wire.recording import Recording
    from kvscope.engine.events.wire.stream import EventStream

    batches = make_batches(min(num_steps, 2000), seed=2)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "bench.kvtrace"
        # one hour at 20 steps/s; the synthetic batches repeat is not possible (state),
        # so the long recording uses a smaller workload generated on the fly
        from kvscope.engine.bench.synthetic import SyntheticCache
        t0 = time.perf_counter()
        gen = SyntheticCache(seed=3, gpu_blocks=4096, cpu_blocks=1024, max_running=64,
                             arrival_rate=0.8)
        with EventStream(record_path=str(path), keyframe_every_steps=200,
                         keyframe_every_s=1e9, queue_size=100_000,
                         snapshot_fn=gen.canonical) as s:
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


def bench_overhead(blocks: int, step_s: float = 0.010) -> dict[str, Any]:
    """Stream off vs. on, one process, same seed.

    Two identical seeded ``ManagerWorkload``s on the real KVCacheManager (4096 blocks
    of 16, up to 64 running), one per mode, run in alternating blocks of 10 steps so all
    see the same machine load. A step is the cache's bookkeeping plus ``step_s`` of
    sleep: the stand-in for a GPU forward, which holds neither the GIL nor a core. An
    "on" block ends only when the stream thread has handled its batches
    (``wait_idle``), so the background work is charged to it in full. Reported: the
    median over blocks of the per-step time.
    """
    from kvscope.engine.cache import KVCacheManager
    from kvscope.engine.events.wire.stream import EventStream

    out: dict[str, Any] = {"blocks_of_10_steps": blocks,
                           "workload": "KVCacheManager 4096x16 blocks, <=64 running",
                           "step_stand_in": f"time.sleep({step_s:g}) (GIL released)"}
    modes = ("off", "on")
    with tempfile.TemporaryDirectory() as d:
        runs = []
        for i, mode in enumerate(modes):
            lock = threading.Lock()
            s = EventStream() if mode == "off" else EventStream(
                "tcp://127.0.0.1:0", str(Path(d) / f"o{i}.kvtrace"), engine_lock=lock)
            m = KVCacheManager(4096, 16, sink=s.sink)
            s.snapshot_fn = m.snapshot
            runs.append((s, lock, ManagerWorkload(m, seed=7)))
        times: list[list[float]] = [[] for _ in modes]
        events = 0
        step = 0
        for b in range(blocks + 3):  # the first 3 blocks warm up
            for i, (s, lock, w) in enumerate(runs):
                t0 = time.perf_counter()
                for k in range(10):
                    with lock:
                        stats = w.step()
                        if i == 1:
                            events += len(s.sink.events)
                        s.end_step(step + k, stats)
                    time.sleep(step_s)
                s.wait_idle()
                if b >= 3:
                    times[i].append((time.perf_counter() - t0) / 10)
            step += 10
        for s, _, _ in runs:
            s.close()
        off = statistics.median(times[0])
        for i, mode in enumerate(modes):
            t = statistics.median(times[i])
            out[mode] = {"step_ms": round(t * 1e3, 3),
                         "overhead_ms_per_step": round((t - off) * 1e3, 3),
                         "overhead_pct": round((t - off) / off * 100, 2)}
        out["events_per_step"] = round(events / step, 1)
    return out


def _flood_proc(endpoint: str, stop: Any) -> None:
    """Child process: a hostile client. Asks for snapshots and full replays as fast as
    the publisher takes requests, and never reads a reply."""
    import zmq

    from kvscope.engine.events.wire import codec as C

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 1)
    s.connect(endpoint)
    codec = C.Codec()
    reqs = [codec.encode(C.make_request(C.MSG_GET_SNAPSHOT, id=1)),
            codec.encode(C.make_request(C.MSG_REPLAY, id=2, **{"from": 1}))]
    i = 0
    while not stop.is_set():
        for _ in range(100):
            try:
                s.send(reqs[i & 1], zmq.NOBLOCK)
            except zmq.Again:
                pass
            i += 1
    s.close()
    ctx.term()


def bench_flood(blocks: int, step_s: float = 0.010, num_blocks: int = 65536) -> dict[str, Any]:
    """Engine step time with a quiet snapshot endpoint vs. one flooded by a hostile
    client (``_flood_proc``), one process, same seed, alternating blocks of 10 steps
    (the flooder runs throughout, so its CPU load falls on every mode alike; only the
    flooded streams get its requests). Each stream publishes, with snapshots from the
    real KVCacheManager (``num_blocks`` x 16) under the engine lock, as LLMEngine wires
    it. Reported: the median per-step time, and the publisher's counters."""
    from kvscope.engine.cache import KVCacheManager
    from kvscope.engine.events.wire.stream import EventStream

    modes = ("quiet", "flooded", "flooded_no_coalescing")
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    runs, procs = [], []
    for i, mode in enumerate(modes):
        lock = threading.Lock()
        coalescing = {"snapshot_interval_s": 0.0} if i == 2 else {}  # else the default
        s = EventStream("tcp://127.0.0.1:0", engine_lock=lock, **coalescing)
        m = KVCacheManager(num_blocks, 16, sink=s.sink)
        s.snapshot_fn = m.snapshot
        runs.append((s, lock, ManagerWorkload(m, seed=7, max_running=256)))
        if mode != "quiet":
            procs.append(ctx.Process(target=_flood_proc, args=(s.snapshot_endpoint, stop)))
    for p in procs:
        p.start()
    times: list[list[float]] = [[] for _ in modes]
    started = time.perf_counter()
    try:
        step = 0
        for b in range(blocks + 3):  # the first 3 blocks warm up
            for i, (s, lock, w) in enumerate(runs):
                t0 = time.perf_counter()
                for k in range(10):
                    with lock:
                        stats = w.step()
                        s.end_step(step + k, stats)
                    time.sleep(step_s)
                if b >= 3:
                    times[i].append((time.perf_counter() - t0) / 10)
            step += 10
    finally:
        stop.set()
        for p in procs:
            p.join(10)
    out: dict[str, Any] = {
        "blocks_of_10_steps": blocks,
        "workload": f"KVCacheManager {num_blocks}x16 blocks, <=256 running, publishing",
        "step_stand_in": f"time.sleep({step_s:g}) (GIL released)",
        "flooder": "another process: get_snapshot and replay(from=1) in a loop, never reads",
        "wall_s": round(time.perf_counter() - started, 1)}
    quiet = statistics.median(times[0])
    for i, (mode, (s, _, _)) in enumerate(zip(modes, runs, strict=True)):
        t = statistics.median(times[i])
        st = s.stats
        out[mode] = {"step_ms": round(t * 1e3, 3),
                     "vs_quiet_pct": round((t - quiet) / quiet * 100, 2),
                     "steps": step,
                     **{k: getattr(st, k) for k in ("snapshots_taken", "requests_received",
                                           "snapshots_served", "replays_served",
                                           "replays_refused", "replies_dropped",
                                           "dropped_batches")}}
        s.close()
    return out


def bench_publish_overhead(blocks: int, sizes: tuple[int, ...] = (100, 1000),
                           step_s: float = 0.010) -> dict[str, Any]:
    """Publishing overhead at a fixed number of events per step: a 10 ms GIL-releasing
    stand-in step (a sleep) that emits ``size`` events, with the stream off, on with the
    per-event sink (a map per event: the baseline) and on with the engine's columns
    (the typed calls the manager makes: ``sink_call``), publishing and recording;
    alternating blocks of 10 steps, each "on" block charged until the stream thread handled it
    (``wait_idle``). Every arm replays the same events into its sink (off: the NullSink
    the manager calls when nobody listens), so the replay loop is not charged to
    publishing. The events are the realistic workload's, in order, cycled (the
    stream's cost does not depend on whether they are a valid history: nothing on the
    publisher applies them). No subscriber is attached (it would run in this process
    and share its GIL; a remote one costs the publisher the same bytes)."""
    from kvscope.engine.events.sink import ListSink
    from kvscope.engine.events.wire.stream import EventStream

    pool = [e for ev, _ in realistic_batches(600) for e in ev]
    calls = [sink_call(e) for e in pool]
    out: dict[str, Any] = {"blocks_of_10_steps": blocks,
                           "step_stand_in": f"time.sleep({step_s:g}) (GIL released)",
                           "events": "the realistic workload's, cycled"}
    for size in sizes:
        modes = ("off", "on, per-event sink", "on, columns")
        with tempfile.TemporaryDirectory() as d:
            streams = []
            for i, mode in enumerate(modes):
                st = EventStream() if mode == "off" else EventStream(
                    "tcp://127.0.0.1:0", str(Path(d) / f"p{i}.kvtrace"))
                if mode == "on, per-event sink":
                    st.sink = ListSink()
                streams.append(st)
            times: list[list[float]] = [[] for _ in modes]
            pos, step = 0, 0
            for b in range(blocks + 2):  # the first 2 blocks warm up
                for i, st in enumerate(streams):
                    sink = st.sink
                    # off replays the events into its NullSink exactly as the columns arm
                    # does into its ColumnSink (the manager calls a disabled sink too), so
                    # this loop's own cost is in every arm, not charged to publishing;
                    # the per-event arm makes the call the manager made before: a map
                    # per event
                    per_event = modes[i] == "on, per-event sink"
                    ops = {name: getattr(sink, name) for name in TYPED_CALLS}
                    emit = sink.emit
                    idx = [(pos + j) % len(pool) for j in range(size)]
                    chunk = [pool[j] for j in idx] if per_event else [calls[j] for j in idx]
                    t0 = time.perf_counter()
                    for k in range(10):
                        if per_event:
                            for ev in chunk:
                                emit(**ev)
                        else:
                            for name, args in chunk:
                                if name is None:
                                    emit(**args)
                                else:
                                    ops[name](*args)
                        st.end_step(step + k, {})
                        time.sleep(step_s)
                    st.wait_idle()
                    if b >= 2:
                        times[i].append((time.perf_counter() - t0) / 10)
                pos += 10 * size
                step += 10
            for st in streams:
                st.close()
            off = statistics.median(times[0])
            row = {}
            for i, mode in enumerate(modes):
                t = statistics.median(times[i])
                row[mode] = {"step_ms": round(t * 1e3, 3),
                             "overhead_pct": round((t - off) / off * 100, 2)}
            out[f"{size} events per step"] = row
    out["load_average"] = os.getloadavg()
    return out


def bench_emit(passes: int, steps: int = 300) -> dict[str, Any]:
    """The engine thread's cost per block event, per-event (ListSink: a map per event,
    the old path) vs. columns (ColumnSink), side by side, alternating passes. CPU time
    of this thread (``time.thread_time``: what the engine thread spends, also on a
    shared box where wall time counts other processes' turns).

    1. the sink call alone: the realistic workload's alloc/free/hit events (recorded
       once from the real KVCacheManager), replayed as the manager calls them
       (``block_op``; the per-event path as it called ``emit`` before) plus one
       ``drain`` per step; ns per block event, median over passes.
    2. the real KVCacheManager: three identical seeded ``ManagerWorkload``s (no sink,
       per-event, columns) in alternating passes of ``steps`` steps; the sink's share of
       the engine thread = (time with it - time without) / events emitted.
    """
    from kvscope.engine.cache import KVCacheManager
    from kvscope.engine.events import schema as S
    from kvscope.engine.events.column_sink import ColumnSink
    from kvscope.engine.events.sink import ListSink, NullSink

    hot = (S.ALLOC, S.FREE, S.HIT)
    calls = [[(e["kind"], e["tier"], e["seq"], e["blocks"], e.get("tokens", 0))
              for e in ev if e["kind"] in hot and "group" not in e]
             for ev, _ in realistic_batches(steps)]
    n_calls = sum(len(c) for c in calls)
    sinks = {"per-event (ListSink)": ListSink, "columns (ColumnSink)": ColumnSink}
    call_ns: dict[str, list[float]] = {name: [] for name in sinks}
    gc.disable()
    try:
        for _ in range(passes):
            for name, cls in sinks.items():
                sink = cls()
                t0 = time.thread_time()
                if cls is ListSink:  # the call the manager made before: a map per event
                    emit = sink.emit
                    for step_calls in calls:
                        for kind, tier, seq, blocks, tokens in step_calls:
                            if kind == S.HIT:
                                emit(kind, tier=tier, seq=seq, blocks=blocks, tokens=tokens)
                            else:
                                emit(kind, tier=tier, seq=seq, blocks=blocks)
                        sink.drain()
                else:
                    op = sink.block_op
                    for step_calls in calls:
                        for kind, tier, seq, blocks, tokens in step_calls:
                            op(kind, tier, seq, blocks, tokens)
                        sink.drain()
                call_ns[name].append((time.thread_time() - t0) / n_calls * 1e9)
    finally:
        gc.enable()
    out: dict[str, Any] = {
        "passes": passes, "block_events": n_calls,
        "sink_call_ns_per_block_event": {k: round(statistics.median(v), 1)
                                         for k, v in call_ns.items()}}
    modes = {"no sink": NullSink, **sinks}
    runs = {}
    for name, cls in modes.items():
        sink = cls()
        runs[name] = (sink, ManagerWorkload(KVCacheManager(16384, 16, sink=sink), seed=5,
                                            max_running=256))
    times: dict[str, list[float]] = {name: [] for name in modes}
    counts: dict[str, int] = {name: 0 for name in modes}
    for p in range(passes + 1):  # the first pass warms up (and fills the cache)
        for name, (sink, work) in runs.items():
            t0 = time.thread_time()
            n = 0
            for _ in range(steps):
                work.step()
                if sink.enabled:
                    n += len(sink.drain())
            dt = time.thread_time() - t0
            if p:
                times[name].append(dt)
                counts[name] += n
    base = statistics.median(times["no sink"])
    manager: dict[str, Any] = {}
    for name in sinks:
        t = statistics.median(times[name])
        per_pass = counts[name] / passes
        manager[name] = {"ns_per_event": round((t - base) / per_pass * 1e9, 1),
                         "events_per_pass": round(per_pass)}
    out["manager_sink_share_ns_per_event"] = manager
    out["manager_step_us_without_sink"] = round(base / steps * 1e6, 1)
    out["load_average"] = os.getloadavg()
    return out


SECTIONS = ("throughput", "subscriber_side", "latency", "recording", "overhead", "flood",
            "emit", "publish_overhead")


def run(args: argparse.Namespace) -> int:
    quick = args.quick
    benches = {
        "throughput": lambda: bench_throughput(2000 if quick else 20_000, 1 if quick else 2),
        "subscriber_side": lambda: bench_subscriber_side(1000 if quick else 5000),
        "latency": lambda: bench_latency(100 if quick else 500),
        "recording": lambda: bench_recording(2000 if quick else 72_000, 20 if quick else 100),
        "overhead": lambda: bench_overhead(5 if quick else 60),
        "flood": lambda: bench_flood(5 if quick else 60),
        "emit": lambda: bench_emit(3 if quick else 15),
        "publish_overhead": lambda: bench_publish_overhead(3 if quick else 20),
    }
    result = {name: bench() for name, bench in benches.items()
              if args.only in (None, name)}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for section, values in result.items():
            print(f"[{section}]")
            for k, v in values.items():
                print(f"  {k}: {v}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="event stream throughput, latency, recording, "
                                            "overhead")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quick", action="store_true", help="smaller runs (a smoke test)")
    p.add_argument("--only", choices=SECTIONS, help="run one section")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
