"""The cache rebuilt from the engine's events equals the engine's own kv_state() after
every step: from a recording (also by seeking) and from a live subscriber, for a workload
with prefix sharing, n>1 forks (copy-on-write) and preemption."""

from __future__ import annotations

import random
import socket

from kvscope.engine.events import KVState
from kvscope.engine.events.wire.recording import Recording
from kvscope.engine.events.wire.subscriber import Subscriber
from kvscope.engine.sampling_params import SamplingParams
from tests.waiting import HANG_S, wait_until

SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(engine) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, q in enumerate(["Why is the sky blue?", "What is rain?", "Name a fruit."]):
        engine.add_request(f"chat{i}", SYSTEM + q, greedy)
    ids = engine.tokenizer.encode("Once upon a time, in a land")[:7]
    assert len(ids) % engine.config.block_size, "the fork must share a partial block"
    engine.add_request("pair", {"prompt_token_ids": ids},
                       SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=8,
                                      ignore_eos=True))


def test_recording_equals_kv_state_every_step(make_engine, tmp_path):
    path = tmp_path / "run.kvtrace"
    # 14 blocks of 4 tokens: the chats' shared prefix and the fork force preemptions.
    eng = make_engine(block_size=4, num_gpu_blocks=14, watermark=0.0, record_path=str(path))
    # Changes between steps (new requests) travel in the next step's batch.
    expected = {eng.step_count: eng.kv_state()}
    workload(eng)
    while eng.has_unfinished_requests():
        eng.step()
        expected[eng.step_count] = eng.kv_state()
    assert eng.scheduler.num_preemptions > 0
    assert eng.cache.metrics()["prefix_hit_tokens"] > 0
    assert eng.cache.metrics()["cow_copies"] > 0
    eng.close()  # publishes a final batch (nothing changed since the last step)
    expected[eng.step_count] = eng.kv_state()

    rec = Recording(path)
    state = None
    for batch in rec:  # replay every batch in order
        if state is None:
            state = KVState()
        state.apply(batch)
        if batch["step"] in expected:
            assert state.canonical() == expected[batch["step"]], f"step {batch['step']}"
    assert state is not None and state.step == max(expected)
    for step in random.Random(0).sample(sorted(expected), 6):  # seeking via keyframes
        assert rec.state_at(step).canonical() == expected[step]


def test_live_subscriber_converges(make_engine):
    port = free_port()
    eng = make_engine(block_size=4, num_gpu_blocks=14, watermark=0.0,
                      events_endpoint=f"tcp://127.0.0.1:{port}")
    sub = Subscriber(f"tcp://127.0.0.1:{port}")

    def polled(done):
        return lambda: (sub.poll(timeout=0.02), done())[1]

    try:
        # Joined (the snapshot, taken while the engine idles) and subscribed (a heartbeat
        # arrived live) before the first step: every batch then arrives live (no gap).
        wait_until(polled(lambda: sub.status != "waiting" and sub.live_messages > 0),
                   "the subscriber's snapshot and a live heartbeat")
        workload(eng)
        while eng.has_unfinished_requests():
            eng.step()
            sub.poll(timeout=0.05)
        assert eng.events.wait_idle(HANG_S)
        want = eng.kv_state()
        wait_until(polled(lambda: sub.state.step == eng.step_count
                          and sub.state.canonical() == want), "the subscriber to converge")
        assert sub.state.canonical() == want
        assert sub.gaps == 0
    finally:
        sub.close()
