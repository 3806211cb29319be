"""One end-to-end run of the event pipeline, for ``scripts/bench_events.py``: an EventStream
in one process publishing pre-generated batches as fast as it can, a ``Subscriber`` (its
own KVState mirror) in another, over loopback.

Run as a script by path, with PYTHONPATH at the code under test (this tree, or an
exported earlier release: the baseline row), so it uses only the API both share:

    python _events_pipeline.py pub BATCHES_FILE [columns|per-event]  # prints endpoints,
                                                                     # waits for "go"
    python _events_pipeline.py sub ENDPOINT SNAPSHOT_ENDPOINT LAST_SEQ

BATCHES_FILE is msgpack ``[[events, stats], ...]`` with protocol-1 id lists (what a cache
manager emits). Each process prints JSON lines on stdout.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time


def _say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def publish(batches_file: str, sink: str = "columns") -> None:
    """``sink``: "columns" (the engine's ColumnSink: block operations through
    ``block_op``) or "per-event" (the reference ListSink: a map per event)."""
    import msgpack

    try:
        from kvscope.engine.events.wire.stream import EventStream
    except ImportError:  # a revision from before engine.events.wire (scripts/bench_events_ab.py)
        from kvscope.engine.events.stream import EventStream

    with open(batches_file, "rb") as f:
        batches = msgpack.unpackb(f.read(), raw=False)
    # Millions of pre-generated event objects would make every GC pass crawl over them,
    # a cost an engine (which holds no event history) does not pay.
    gc.freeze()
    try:  # this tree: snapshots come from the cache (here: empty until the first batch)
        stream = EventStream("tcp://127.0.0.1:0", queue_size=1 << 20,
                             snapshot_fn=lambda: {"tiers": {}, "seqs": {}},
                             engine_lock=threading.Lock())
    except TypeError:  # the baseline release: its publisher keeps its own mirror
        stream = EventStream("tcp://127.0.0.1:0", queue_size=1 << 20)
    _say(endpoint=stream.endpoint, snapshot_endpoint=stream.snapshot_endpoint,
         steps=len(batches))
    sys.stdin.readline()  # "go": the subscriber holds its snapshot
    if sink == "per-event":  # the reference sink: a map per event on the engine thread
        from kvscope.engine.events.sink import ListSink
        stream.sink = ListSink()
    op = getattr(stream.sink, "block_op", None) if sink == "columns" else None
    hot = ("alloc", "free", "hit")
    emit, t0 = stream.sink.emit, time.perf_counter()
    for step, (events, stats) in enumerate(batches):
        for ev in events:
            if op is not None and ev["kind"] in hot and "group" not in ev:
                op(ev["kind"], ev["tier"], ev["seq"], ev["blocks"], ev.get("tokens", 0))
            else:
                emit(**ev)
        stream.end_step(step, stats)
    t_emit = time.perf_counter() - t0
    stream.wait_idle(600)
    t_all = time.perf_counter() - t0
    sys.stdin.readline()  # the subscriber is done
    stream.close()
    _say(emit_seconds=t_emit, publish_seconds=t_all, dropped=stream.dropped_batches)


def subscribe(endpoint: str, snapshot_endpoint: str, last: int) -> None:
    try:
        from kvscope.engine.events.wire.subscriber import Subscriber
    except ImportError:  # a revision from before engine.events.wire
        from kvscope.engine.events.subscriber import Subscriber

    sub = Subscriber(endpoint, snapshot_endpoint)
    deadline = time.monotonic() + 60
    while sub.status == "waiting" and time.monotonic() < deadline:
        sub.poll(0.05)
    _say(ready=sub.status != "waiting")
    t0 = t_first = None
    deadline = time.monotonic() + 600
    while sub.last_seq < last and time.monotonic() < deadline:
        t_poll = time.perf_counter()
        # the clock starts before the poll that brings the first batch: one poll may
        # apply thousands of waiting batches (timing from its return once measured a
        # whole run as microseconds)
        if sub.poll(0.05) and t_first is None:
            t_first = t_poll
        t0 = t0 or time.perf_counter()
    t_end = time.perf_counter()
    _say(events=sub.events_applied, batches=sub.batches_applied, gaps=sub.gaps,
         resyncs=sub.resyncs, errors=sub.errors, last_seq=sub.last_seq,
         seconds=t_end - (t_first or t_end))
    sub.close()


if __name__ == "__main__":
    if sys.argv[1] == "pub":
        publish(*sys.argv[2:4])
    else:
        subscribe(sys.argv[2], sys.argv[3], int(sys.argv[4]))
