"""Real PUB/SUB on 127.0.0.1 (ephemeral ports): the subscriber's KVState equals the
publisher's after every step, for live, late-joining, cut-and-restored and restarted
connections, and when the publisher drops batches."""

from __future__ import annotations

import contextlib
import threading

from kvscope.engine.bench.synthetic import SyntheticCache
from kvscope.engine.events import KVState
from kvscope.engine.events.wire import EventStream, Subscriber
from tests.events.conftest import cache_stream, poll_until, port_of, synced_to
from tests.waiting import HANG_S, wait_until

EP = "tcp://127.0.0.1:0"


def run_steps(stream: EventStream, gen: SyntheticCache, n: int, subs=(), check=True) -> None:
    """n engine steps; after each, every subscriber catches up and matches exactly."""
    for _ in range(n):
        with stream.engine_lock or contextlib.nullcontext():
            stats = gen.step(stream.sink)
            stream.end_step(gen.step_no, stats)
        if subs:
            poll_until(list(subs), synced_to(list(subs), stream.seq))
            if check:
                truth = gen.canonical()
                for s in subs:
                    assert s.state.canonical() == truth, f"diverged at step {gen.step_no}"


def test_mirror_equals_publisher_after_every_step():
    gen = SyntheticCache(seed=11)
    # request_timeout_s: a snapshot a loaded box serves late is waited for (a hang guard),
    # not asked for again after 2 s (a second request, past the stream's 1 s snapshot
    # interval, would take a second cache snapshot)
    with cache_stream(gen, EP, heartbeat_s=0.2) as stream, \
            Subscriber(stream.endpoint, stream.snapshot_endpoint,
                       request_timeout_s=HANG_S) as sub:
        poll_until([sub], synced_to([sub], 0))
        run_steps(stream, gen, 200, [sub])
        assert sub.errors == 0 and sub.status == "connected" and sub.epoch == stream.epoch
        assert sub.batches_applied + (sub.state.step < 0) >= 1
        # no second mirror: the one snapshot came from the cache, at once (engine idle)
        assert stream.stats.snapshots_taken == 1


def test_late_joiner_converges_from_a_snapshot():
    gen = SyntheticCache(seed=12)
    with cache_stream(gen, EP, heartbeat_s=0.2) as stream, \
            Subscriber(stream.endpoint, stream.snapshot_endpoint) as early:
        poll_until([early], synced_to([early], 0))
        run_steps(stream, gen, 80, [early], check=False)
        with Subscriber(stream.endpoint, stream.snapshot_endpoint) as late:
            poll_until([late], synced_to([late], stream.seq))
            assert late.state.canonical() == gen.canonical()
            assert late.batches_applied == 0  # everything so far came in the snapshot
            run_steps(stream, gen, 60, [early, late])
            assert late.errors == 0
        assert stream.stats.snapshots_served >= 2


def test_connection_cut_and_restored_mid_run(tcp_proxy):
    gen = SyntheticCache(seed=13)
    with cache_stream(gen, EP, heartbeat_s=0.2) as stream:
        proxy = tcp_proxy(port_of(stream.endpoint))
        with Subscriber(f"tcp://127.0.0.1:{proxy.port}", stream.snapshot_endpoint) as sub:
            poll_until([sub], synced_to([sub], 0))
            run_steps(stream, gen, 40, [sub])
            proxy.cut()
            run_steps(stream, gen, 40)  # published while the subscriber is cut off
            for _ in range(5):
                sub.poll(0.02)
            assert sub.last_seq < stream.seq
            proxy.restore()
            run_steps(stream, gen, 20)
            poll_until([sub], synced_to([sub], stream.seq))
            assert sub.state.canonical() == gen.canonical()
            assert sub.gaps >= 1 and sub.replays + sub.resyncs >= 1
            assert proxy.connections >= 2  # it really reconnected
            run_steps(stream, gen, 20, [sub])


def test_publisher_restart_is_detected():
    gen = SyntheticCache(seed=14)
    first = cache_stream(gen, EP, heartbeat_s=0.2)
    sub = Subscriber(first.endpoint, first.snapshot_endpoint)
    try:
        poll_until([sub], synced_to([sub], 0))
        run_steps(first, gen, 30, [sub])
        old_epoch = first.epoch
        first.close()
        gen2 = SyntheticCache(seed=15)
        second = cache_stream(gen2, first.endpoint,
                              snapshot_endpoint=first.snapshot_endpoint, heartbeat_s=0.2)
        with second:
            assert second.epoch != old_epoch
            run_steps(second, gen2, 10)
            poll_until([sub], lambda: sub.epoch == second.epoch and sub.last_seq >= second.seq)
            assert sub.restarts >= 1 and sub.resyncs >= 1
            assert sub.state.canonical() == gen2.canonical()
            run_steps(second, gen2, 20, [sub])
    finally:
        first.close()
        sub.close()


def test_dropped_batches_are_counted_and_the_stream_resyncs(tmp_path):
    gen = SyntheticCache(seed=16)
    path = tmp_path / "drops.kvtrace"
    # snapshot_fn may also hand over KVState.snapshot() form
    with EventStream(EP, str(path), queue_size=4, heartbeat_s=0.2,
                     snapshot_fn=lambda: KVState.from_canonical(gen.canonical()).snapshot(),
                     engine_lock=threading.Lock()
                     ) as stream, Subscriber(stream.endpoint, stream.snapshot_endpoint) as sub:
        poll_until([sub], synced_to([sub], 0))
        run_steps(stream, gen, 20, [sub])
        # Stall the stream thread (a slow disk, a starved thread) while the engine runs on:
        # it holds at most one batch, the queue 4, the rest are dropped.
        gate, handle = threading.Event(), stream._handle
        stream._handle = lambda *a: (gate.wait(HANG_S), handle(*a))
        run_steps(stream, gen, 30)
        assert stream.dropped_batches >= 20  # the engine never blocked: it dropped
        stream._handle = handle
        gate.set()
        poll_until([sub], lambda: stream.stats.queue_depth == 0)  # the thread caught up
        # The next step attaches a cache snapshot (the recording resumes from a keyframe);
        # the subscriber's replay fails (the batches are gone) and it takes a snapshot.
        run_steps(stream, gen, 10, [sub])
        assert sub.publisher_dropped == stream.dropped_batches and sub.resyncs >= 1
        # every batch is accounted for: applied, or covered by the resync's snapshot
        assert sub.batches_applied + sub.skipped_batches == stream.seq
        assert sub.skipped_batches >= stream.dropped_batches
        assert stream.stats.recording_ok
    from kvscope.engine.events.wire import Recording
    with Recording(path) as rec:
        assert rec.state_at(gen.step_no).canonical() == gen.canonical()


def test_a_throttled_subscriber_loses_batches_resyncs_and_converges():
    """A subscriber that reads slowly (its thread stalls while the engine runs a burst)
    overflows its queues: PUB drops for it alone. It sees the gap, cannot replay it (an
    8-batch ring), resyncs from a snapshot and equals the cache again; every seq is
    accounted for; a subscriber that keeps up loses nothing.

    The publisher's per-subscriber queue is 64 messages, not 4: ZeroMQ refreshes a pipe's
    flow-control credit lazily, so at 4 even a subscriber one batch behind lost batches
    whenever its thread was scheduled late (a busy box). The slow one's bound is its own
    4-message queue and small socket buffer, and the burst grows until it overflows."""
    # big steps (~5 KB a batch): the OS's socket buffers fill in fewer of them
    gen = SyntheticCache(seed=17, gpu_blocks=4096, cpu_blocks=512, block_size=1,
                         max_running=64)
    gate, unthrottled = threading.Semaphore(0), threading.Event()

    def slow_reader(update, state) -> None:  # runs on the slow subscriber's thread
        if update["type"] == "batch" and not unthrottled.is_set():
            gate.acquire(timeout=HANG_S)  # one batch per token

    with cache_stream(gen, EP, heartbeat_s=0.2, sndhwm=64, replay_size=8) as stream, \
            Subscriber(stream.endpoint, stream.snapshot_endpoint) as fast, \
            Subscriber(stream.endpoint, stream.snapshot_endpoint, rcvhwm=4, rcvbuf=4096,
                       on_apply=slow_reader) as slow:
        slow.start()
        poll_until([fast], synced_to([fast, slow], 0))
        first = slow.last_seq
        burst = 512
        # The queues between the two hold a bounded number of batches (64 + 4 messages,
        # the kernel's socket buffers): a burst past that must lose some. Their size
        # is the OS's, so double the burst until one did (a healthy box: the first).
        while slow.skipped_batches == 0:
            unthrottled.clear()
            for i in range(burst):
                run_steps(stream, gen, 1, [fast], check=False)
                if i % 32 == 0:
                    gate.release()  # the slow reader takes one batch now and then
            unthrottled.set()
            gate.release()
            wait_until(lambda: slow.status == "connected" and slow.last_seq >= stream.seq,
                       "the slow subscriber to catch up")
            burst *= 2
        assert slow.gaps >= 1 and slow.resyncs >= 1
        assert fast.gaps == 0 and fast.resyncs == 0 and fast.errors == 0
        with slow.lock:
            assert slow.state.canonical() == gen.canonical()
            assert first + slow.batches_applied + slow.skipped_batches == slow.last_seq
        assert slow.errors == 0 and stream.dropped_batches == 0  # lost at the socket only
        run_steps(stream, gen, 10, [fast])  # and it keeps following the live stream
        wait_until(lambda: slow.last_seq >= stream.seq, "the slow subscriber to follow")
        with slow.lock:
            assert slow.state.canonical() == gen.canonical()
        assert fast.state.canonical() == gen.canonical()


def test_off_stream_costs_nothing():
    stream = EventStream()
    assert not stream.enabled and not stream.sink.enabled
    stream.end_step(0, {"x": 1})
    assert stream.seq == 0 and stream._thread is None
    stream.close()


def test_an_idle_streams_recording_is_on_disk_before_it_closes(tmp_path):
    """The writer buffers deltas into frames; an engine gone idle must not leave its last
    steps only in memory (a process killed later, as vLLM kills its engine core 5 s after
    asking it to stop, would lose them)."""
    from kvscope.engine.events.wire import Recording
    from tests.waiting import wait_until

    gen = SyntheticCache(seed=17)
    path = tmp_path / "idle.kvtrace"
    # no keyframe by time before the hang guard: only the idle flush can write the tail
    stream = cache_stream(gen, None, str(path), keyframe_every_s=10 * HANG_S)
    try:
        run_steps(stream, gen, 12)  # fewer than a frame's steps: nothing forces a flush

        def on_disk() -> bool:
            with Recording(path) as rec:
                return bool(rec.steps) and rec.steps[-1] == gen.step_no

        wait_until(on_disk, "the idle stream's last steps on disk")
        with Recording(path) as rec:
            assert rec.state_at(gen.step_no).canonical() == gen.canonical()
    finally:
        stream.close()


def test_the_event_rate_is_read_safely_from_another_thread():
    """The inspector's GUI thread reads ``events_per_s`` while the subscriber's thread
    appends to the rate window: reading it never fails ("deque mutated during iteration"
    made a live screenshot test fail on a loaded box)."""
    import time

    sub = Subscriber("tcp://127.0.0.1:1")  # never answered: only its rate window is used
    stop = threading.Event()

    def feed() -> None:  # what _apply does on the subscriber's thread, per batch
        while not stop.is_set():
            now = time.monotonic()
            sub._rate.append((now, 1))
            sub._trim_rate(now)
            time.sleep(0.0001)

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    try:
        wait_until(lambda: len(sub._rate) > 1000, "a full rate window")
        # the proof is that no read raises (a value's size would depend on the box's speed)
        rates = [sub.events_per_s for _ in range(3000)]
        assert len(rates) == 3000 and all(r >= 0.0 for r in rates)
    finally:
        stop.set()
        t.join(HANG_S)
        sub.close()
