"""The cpu swap tier in the engine: greedy outputs stay token-identical to plain
contiguous generation when (a) a tiny device pool forces swap preemption, (b) the host
pool is so small that some victims fall back to recompute, (c) a prefix evicted from the
device is served from the host tier. After every step the cache manager's invariants
hold on both tiers and the KVState rebuilt from the recorded events equals kv_state()."""

from __future__ import annotations

import pytest

from kvscope.engine.events import KVState
from kvscope.engine.events.wire.recording import Recording
from kvscope.engine.reference_generate import generate_reference
from tests.engine.conftest import GREEDY, PROMPTS, TEST_DTYPE, as_prompt


def swap_gib(engine_blocks: int, block_size: int, loaded) -> float:
    """swap_space in GiB holding exactly ``engine_blocks`` blocks of the model's pages."""
    cfg = loaded[2]
    per_block = 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * \
        TEST_DTYPE.itemsize
    return (engine_blocks + 0.5) * per_block / (1 << 30)


def run_checked(engine, tmp_path, requests) -> dict:
    """Add ``requests`` ({id: (prompt, params)}), step until idle; after every step check
    the invariants, and at the end replay the recording against every step's kv_state()."""
    expected = {engine.step_count: engine.kv_state()}
    loaded = (engine.model, engine.tokenizer, engine.model_config)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, as_prompt(loaded, prompt), params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.cache.check_invariants()
        expected[engine.step_count] = engine.kv_state()
    path = engine.config.record_path
    engine.close()
    state = KVState()
    for batch in Recording(path):
        state.apply(batch)
        if batch["step"] in expected:
            assert state.canonical() == expected[batch["step"]], f"step {batch['step']}"
    assert state.step >= max(expected)  # (an idle stream may close with an empty batch)
    return done


def test_swap_preemption_keeps_outputs(make_engine, reference, loaded, tmp_path):
    # 12 blocks of 4 tokens: four ~7-token prompts growing by 10 tokens cannot all fit.
    eng = make_engine(block_size=4, num_gpu_blocks=12, watermark=0.0, preemption_mode="swap",
                      swap_space=swap_gib(64, 4, loaded), record_path=str(tmp_path / "a"))
    done = run_checked(eng, tmp_path, {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)})
    m = eng.cache.metrics()
    assert m["swap_outs"] > 0 and m["swap_ins"] == m["swap_outs"]
    assert m["swap_fallbacks"] == 0
    assert eng.stats.copied_out_blocks > 0 and eng.stats.copied_in_blocks > 0
    assert eng.stats.swap_out_bytes == eng.stats.copied_out_blocks * \
        eng.swapper.bytes_per_block
    assert sum(o.metrics.num_preemptions for o in done.values()) == m["preemptions"]
    for i, p in enumerate(PROMPTS):
        assert done[str(i)].outputs[0].token_ids == reference[p]


def test_host_pool_too_small_falls_back_to_recompute(make_engine, reference, loaded,
                                                     tmp_path):
    # 10 device blocks, 3 host blocks: a victim of 3 blocks fits on the host, a second
    # one does not while the first is still there.
    eng = make_engine(block_size=4, num_gpu_blocks=10, watermark=0.0, preemption_mode="swap",
                      swap_space=swap_gib(3, 4, loaded), enable_prefix_caching=False,
                      record_path=str(tmp_path / "b"))
    done = run_checked(eng, tmp_path, {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)})
    m = eng.cache.metrics()
    assert m["swap_outs"] > 0 and m["swap_fallbacks"] > 0  # both paths ran
    for i, p in enumerate(PROMPTS):
        assert done[str(i)].outputs[0].token_ids == reference[p]


SYSTEM = ("You are a careful assistant. Answer briefly and precisely, and never invent "
          "facts. If a question is ambiguous, say so. ") * 3


def test_prefix_evicted_from_device_is_served_from_host(make_engine, loaded, tmp_path):
    model, tok, _ = loaded
    first, second = (as_prompt(loaded, SYSTEM + q) for q in ("Q: What is 2+2? A:",
                                                             "Q: Name a planet. A:"))
    ref = generate_reference(model, tok, second["prompt_token_ids"], GREEDY).token_ids
    computed = {}
    for host in (True, False):
        kw = dict(swap_space=swap_gib(32, 8, loaded)) if host else {}
        eng = make_engine(block_size=8, num_gpu_blocks=64,
                          record_path=str(tmp_path / f"c{host}"), **kw)
        eng.add_request("first", first, GREEDY)
        while eng.has_unfinished_requests():
            eng.step()
        evicted = eng.cache.evict_cached()  # the device forgets the prefix
        assert evicted > 0
        before = eng.cache.metrics()["prefix_hit_tokens"]
        tokens = 0
        eng.add_request("second", second, GREEDY)
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    assert out.outputs[0].token_ids == ref
            tokens += eng.stats.scheduled_tokens
            eng.cache.check_invariants()
        m = eng.cache.metrics()
        computed[host] = tokens
        if host:
            assert m["offloaded_blocks"] >= evicted
            assert m["host_hit_tokens"] > 0 and m["prefix_hit_tokens"] - before > 0
        else:
            assert m["prefix_hit_tokens"] == before
        state = KVState()
        expected = eng.kv_state()
        eng.close()
        for batch in Recording(tmp_path / f"c{host}"):
            state.apply(batch)
        assert state.canonical() == expected
    assert computed[True] < computed[False]


def test_swap_needs_swap_space(make_engine):
    with pytest.raises(ValueError, match="swap_space"):
        make_engine(preemption_mode="swap")
