"""Greedy outputs of the paged engine are token-identical to plain contiguous generation
(engine.reference_generate) under every cache configuration that must not change them."""

from __future__ import annotations

import pytest

from kvscope.engine.reference_generate import generate_reference
from kvscope.engine.sampling_params import SamplingParams
from tests.engine.conftest import GREEDY, PROMPTS, as_prompt, prompt_ids, run_all


def generate(engine, prompts, params=GREEDY):
    loaded = (engine.model, engine.tokenizer, engine.model_config)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), as_prompt(loaded, p), params)
    out = run_all(engine)
    return [out[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_block_sizes(make_engine, reference, block_size):
    eng = make_engine(block_size=block_size, num_gpu_blocks=2048 // block_size)
    for p, out in zip(PROMPTS, generate(eng, PROMPTS), strict=True):
        assert out.outputs[0].token_ids == reference[p]


def test_preemption_keeps_outputs(make_engine, reference):
    # 6 blocks of 4 tokens: four ~7-token prompts growing by 10 tokens cannot all fit.
    eng = make_engine(block_size=4, num_gpu_blocks=12, watermark=0.0)
    outs = generate(eng, PROMPTS)
    assert eng.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == eng.scheduler.num_preemptions
    for p, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == reference[p]


def test_chunked_prefill_budget_7(make_engine, reference):
    eng = make_engine(max_num_batched_tokens=7)
    for p, out in zip(PROMPTS, generate(eng, PROMPTS), strict=True):
        assert out.outputs[0].token_ids == reference[p]


def test_prefix_caching_shared_system_prompt(make_engine, loaded):
    model, tok, cfg = loaded
    system = ("You are a careful assistant. Answer briefly and precisely, and never invent "
              "facts. If a question is ambiguous, say so. ") * 3
    prompts = [system + q for q in ("Q: What is 2+2? A:", "Q: Name a planet. A:",
                                    "Q: What colour is the sky? A:")]
    ref = [generate_reference(model, tok, prompt_ids(tok, p, cfg.vocab_size), GREEDY).token_ids
           for p in prompts]
    eng = make_engine(block_size=8, enable_prefix_caching=True)
    # One at a time, so later prompts find the first one's blocks cached.
    outs = []
    for i, p in enumerate(prompts):
        eng.add_request(str(i), as_prompt(loaded, p), GREEDY)
        outs.append(run_all(eng)[str(i)])
    assert outs[1].metrics.num_cached_tokens > 0 and outs[2].metrics.num_cached_tokens > 0
    assert eng.cache.metrics()["prefix_hit_tokens"] > 0
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_parallel_sampling_n2_greedy(make_engine, reference):
    eng = make_engine(block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, n=2)
    outs = generate(eng, PROMPTS[:2], params)
    for p, out in zip(PROMPTS[:2], outs, strict=True):
        assert [c.index for c in out.outputs] == [0, 1]
        assert out.outputs[0].token_ids == out.outputs[1].token_ids == reference[p]
    assert eng.cache.metrics()["cow_copies"] > 0


def test_contiguous_layout(make_engine, reference):
    eng = make_engine(kv_layout="contiguous", max_model_len=64, num_gpu_blocks=64)
    for p, out in zip(PROMPTS, generate(eng, PROMPTS), strict=True):
        assert out.outputs[0].token_ids == reference[p]



def test_contiguous_fork_the_pool_cannot_hold_fails_that_request_alone(make_engine, reference):
    """Contiguous layout: each n > 1 child reserves a whole context. With room for two
    reservations, request 0 (n=3) cannot fork: it fails with the cache's reason, its
    blocks are freed, and request 1 beside it finishes with the reference's tokens."""
    eng = make_engine(kv_layout="contiguous", max_model_len=64, block_size=16,
                      num_gpu_blocks=8)
    loaded = (eng.model, eng.tokenizer, eng.model_config)
    eng.add_request("0", as_prompt(loaded, PROMPTS[0]),
                    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, n=3))
    eng.add_request("1", as_prompt(loaded, PROMPTS[1]), GREEDY)
    out = run_all(eng)
    assert out["0"].error is not None and "cannot fork" in out["0"].error
    assert out["1"].error is None and out["1"].outputs[0].token_ids == reference[PROMPTS[1]]
    assert eng.cache.gpu.num_free_blocks == 8

def test_seeded_sampling_reproducible_across_layouts(make_engine, loaded):
    model, tok, cfg = loaded
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10,
                            ignore_eos=True)
    ref = generate_reference(model, tok, prompt_ids(tok, PROMPTS[0], cfg.vocab_size),
                             params).token_ids
    runs = []
    for kwargs in ({}, {"block_size": 4, "max_num_batched_tokens": 5},
                   {"kv_layout": "contiguous", "max_model_len": 64}):
        eng = make_engine(**kwargs)
        runs.append(generate(eng, PROMPTS[:2], params)[0].outputs[0].token_ids)
    assert runs[0] == runs[1] == runs[2] == ref


def test_batched_draws_match_the_reference_row_by_row(make_engine, loaded):
    """Greedy and tempered rows, with and without top logprobs, sampled together in one
    batch per step: each request's tokens and top-logprob tokens are the reference's (which
    samples its one row alone); the values agree to the rounding by which a batched paged
    forward's logits differ from a lone contiguous one's."""
    model, tok, cfg = loaded
    kinds = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3),
             SamplingParams(temperature=0.8, seed=11, max_tokens=8, ignore_eos=True,
                            logprobs=2),
             SamplingParams(temperature=0.7, top_k=20, seed=12, max_tokens=8, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    eng = make_engine()
    for i, (p, params) in enumerate(zip(PROMPTS, kinds, strict=True)):
        eng.add_request(str(i), {"prompt_token_ids": prompt_ids(tok, p, cfg.vocab_size)}, params)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    for i, (p, params) in enumerate(zip(PROMPTS, kinds, strict=True)):
        ref = generate_reference(model, tok, prompt_ids(tok, p, cfg.vocab_size), params)
        got = done[str(i)]
        assert got.token_ids == ref.token_ids
        assert (got.logprobs is None) == (ref.logprobs is None)
        for step, want in zip(got.logprobs or [], ref.logprobs or [], strict=True):
            assert list(step) == list(want)  # the same tokens, in the same order
            assert list(step.values()) == pytest.approx(list(want.values()), abs=1e-4)
        assert got.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-3)
