"""A real engine run with ``kv_events_config``: a vLLM-format consumer's GPU hash set
equals the engine's own cached set after every step, and every BlockStored chains."""

from __future__ import annotations

import json

from kvscope.engine.cache.hashing import NO_SALT_ROOT
from kvscope.engine.events.vllm.kv_events_subscriber import VllmSubscriber
from kvscope.engine.events.vllm.prefix_cache import VllmPrefixCache
from tests.engine.test_events_fidelity import workload
from tests.events.slow_joiner import publish_until_received
from tests.waiting import HANG_S


def test_engine_publishes_vllm_events(make_engine, tmp_path):
    endpoint = f"ipc://{tmp_path}/kv"
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
           "replay_endpoint": f"ipc://{tmp_path}/replay", "topic": "kvscope"}
    # replay_timeout_s: a gap's replay that a loaded box serves late is waited for (a hang
    # guard), not counted as missed after 2 s
    sub = VllmSubscriber(endpoint, replay_endpoint=f"ipc://{tmp_path}/replay",
                         topic="kvscope", replay_timeout_s=HANG_S)
    eng = make_engine(block_size=4, num_gpu_blocks=14, watermark=0.0,
                      kv_events_config=json.dumps(cfg))
    pub = eng.events.consumers[0]
    cache = VllmPrefixCache()
    stored = removed = 0

    def sync() -> None:
        nonlocal stored, removed
        assert eng.events.wait_idle(HANG_S) and pub.wait_idle(HANG_S)
        while sub.last_seq != pub.seq:
            b = sub.recv(HANG_S)
            assert b is not None, (sub.last_seq, pub.seq)
            for ev in b.events:
                if ev["type"] == "BlockStored":
                    stored += 1
                    parent = ev["parent_block_hash"]
                    parent = NO_SALT_ROOT if parent is None else parent
                    for i, h in enumerate(ev["block_hashes"]):
                        assert h == hash((parent, tuple(ev["token_ids"][4 * i:4 * i + 4])))
                        parent = h
                elif ev["type"] == "BlockRemoved":
                    removed += 1
            cache.apply(b.ts, b.events, b.seq)
        truth = {h for h in eng.kv_state()["tiers"]["gpu"]["hash"] if h is not None}
        assert cache.hashes("GPU") == truth, eng.step_count

    def received() -> bool:
        b = sub.recv(0.005)
        if b is not None:
            cache.apply(b.ts, b.events, b.seq)
        return b is not None

    with sub:
        # slow joiner: probes until the subscriber hears one (tests/events/slow_joiner.py)
        publish_until_received(eng.events, eng.cache, received, step=0)
        workload(eng)
        while eng.has_unfinished_requests():
            eng.step()
            sync()
    assert stored > 0 and removed > 0
    assert sub.errors == 0 and sub.missed == 0 and pub.translator.undescribed == 0
