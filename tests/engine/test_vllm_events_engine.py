"""A real engine run with ``kv_events_config``: a vLLM-format consumer's GPU hash set
equals the engine's own cached set after every step, and every BlockStored chains."""

from __future__ import annotations

import json

from engine.cache.hashing import NO_SALT_ROOT
from engine.events.vllm.prefix_cache import VllmPrefixCache
from engine.events.vllm.subscriber import VllmSubscriber
from tests.engine.test_events_fidelity import workload


def test_engine_publishes_vllm_events(make_engine, tmp_path):
    endpoint = f"ipc://{tmp_path}/kv"
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
           "replay_endpoint": f"ipc://{tmp_path}/replay", "topic": "kvscope"}
    sub = VllmSubscriber(endpoint, replay_endpoint=f"ipc://{tmp_path}/replay",
                         topic="kvscope")
    eng = make_engine(block_size=4, num_gpu_blocks=14, watermark=0.0,
                      kv_events_config=json.dumps(cfg))
    pub = eng.events.consumers[0]
    cache = VllmPrefixCache()
    stored = removed = 0

    def sync() -> None:
        nonlocal stored, removed
        assert eng.events.wait_idle() and pub.wait_idle()
        while sub.last_seq != pub.seq:
            b = sub.recv(10)
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

    with sub:
        sub.recv(0.3)  # slow joiner: the subscription reaches the publisher
        workload(eng)
        while eng.has_unfinished_requests():
            eng.step()
            sync()
    assert stored > 0 and removed > 0
    assert sub.errors == 0 and sub.missed == 0 and pub.translator.undescribed == 0
