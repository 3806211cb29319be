"""The real engine.cache.KVCacheManager emitting into an EventStream: a live subscriber
and the recording both equal the manager's own snapshot() after every step."""

from __future__ import annotations

import random
import threading

from kvscope.engine.bench.event_workloads import ManagerWorkload
from kvscope.engine.cache import KVCacheManager
from kvscope.engine.events.wire import EventStream, Recording, Subscriber
from tests.events.conftest import poll_until, synced_to
from tests.waiting import HANG_S


def test_manager_through_stream_and_recording(tmp_path):
    path = tmp_path / "manager.kvtrace"
    stream = EventStream("tcp://127.0.0.1:0", str(path), keyframe_every_steps=40,
                         heartbeat_s=0.2)
    manager = KVCacheManager(64, 16, sink=stream.sink)
    stream.snapshot_fn = manager.snapshot  # kv_state() form, as LLMEngine wires it
    stream.engine_lock = lock = threading.Lock()
    work = ManagerWorkload(manager, seed=3, max_running=16)
    truth = []
    # request_timeout_s: a replay a loaded box serves late is waited for (a hang guard),
    # not turned into a resync whose snapshot would hide the events of the steps it covers
    with stream, Subscriber(stream.endpoint, stream.snapshot_endpoint,
                            request_timeout_s=HANG_S) as sub:
        with lock:
            stream.end_step(0, {})  # the tier_init events
        truth.append(manager.snapshot())
        poll_until([sub], synced_to([sub], stream.seq))
        kinds: set[str] = set()
        sub.on_apply = lambda u, _st: kinds.update(e["kind"] for e in u.get("events", []))
        for step in range(1, 150):
            with lock:
                stream.end_step(step, work.step())
            truth.append(manager.snapshot())
            poll_until([sub], synced_to([sub], stream.seq))
            assert sub.state.canonical() == truth[-1], f"diverged at step {step}"
        assert sub.errors == 0
        assert {"alloc", "hit", "store", "evict", "free", "cow", "fork", "seq_tokens",
                "seq_preempt", "seq_resume", "seq_finish"} <= kinds
    with Recording(path) as rec:
        assert rec.steps == list(range(150))
        for step in random.Random(1).sample(range(150), 15) + [149]:
            assert rec.state_at(step).canonical() == truth[step], step
