"""Fault isolation inside the engine step: an exception one request causes fails that
request alone (error on its output, blocks freed, seq_finish "abort" in the event
stream); every other request in the same batches finishes exactly as it would have."""

from __future__ import annotations

import pytest

import kvscope.engine.sampler as sampler_module
from kvscope.engine.events.schema import SEQ_FINISH
from kvscope.engine.events.wire.recording import Recording
from kvscope.engine.sampling_params import SamplingParams
from tests.engine.conftest import GREEDY, PROMPTS, run_all

POISON_SEED = 1337


def test_one_request_failing_in_the_step_fails_only_it(make_engine, reference, monkeypatch,
                                                       tmp_path):
    real_sample = sampler_module.sample

    def sample(logits, params, *rest, **kw):
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("injected per-request fault")
        return real_sample(logits, params, *rest, **kw)

    real_sample_batch = sampler_module.sample_batch

    def sample_batch(logits, params, *rest, **kw):
        # the batch fails with the poisoned row in it; the engine then samples row by row
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("injected per-request fault")
        return real_sample_batch(logits, params, *rest, **kw)

    monkeypatch.setattr(sampler_module, "sample", sample)
    monkeypatch.setattr(sampler_module, "sample_batch", sample_batch)
    eng = make_engine(model="smollm2", device="cpu", dtype="float32", num_gpu_blocks=64,
                      record_path=str(tmp_path / "faults.kvtrace"))
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"ok{i}", p, GREEDY)
    poison = SamplingParams(temperature=0.8, seed=POISON_SEED, max_tokens=10, n=2)
    eng.add_request("bad", PROMPTS[0] + " and", poison)
    # a seeded tempered request sampled beside the poisoned one (in its failed batch, then
    # row by row) draws what it draws alone
    tempered = SamplingParams(temperature=0.8, seed=7, max_tokens=10)
    eng.add_request("t", PROMPTS[1], tempered)
    done = run_all(eng)
    alone = make_engine(model="smollm2", device="cpu", dtype="float32", num_gpu_blocks=64)
    alone.add_request("t", PROMPTS[1], tempered)
    assert done["t"].error is None
    assert done["t"].outputs[0].token_ids == run_all(alone)["t"].outputs[0].token_ids

    assert done["bad"].error is not None and "injected" in done["bad"].error
    for i, p in enumerate(PROMPTS):
        out = done[f"ok{i}"]
        assert out.error is None
        assert out.outputs[0].token_ids == reference[p]
    assert eng.cache.metrics()["used_tokens"] == 0
    assert not eng.has_unfinished_requests()
    eng.close()
    with Recording(tmp_path / "faults.kvtrace") as rec:
        finishes = {e["seq"]: e["reason"] for b in rec for e in b["events"]
                    if e["kind"] == SEQ_FINISH}
    assert finishes["bad"] == finishes["bad#1"] == "abort"
    assert all(finishes[f"ok{i}"] == "length" for i in range(len(PROMPTS)))


def test_logprobs_past_the_vocabulary_are_refused_at_add(make_engine):
    eng = make_engine(model="smollm2", device="cpu", dtype="float32", num_gpu_blocks=16)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=name):
            eng.add_request("x", "hello", SamplingParams(max_tokens=2, **{name: 60000}))
    assert not eng.has_unfinished_requests()


def test_min_tokens_keeps_eos_out(make_engine):
    """min_tokens: EOS cannot be sampled before it (greedy would stop at once here)."""
    eng = make_engine(model="smollm2", device="cpu", dtype="float32", num_gpu_blocks=32)
    eos = sorted(eng._eos_ids)[0]
    eng.add_request("free", [1, 2, 3], SamplingParams(temperature=0, max_tokens=6,
                                                      stop_token_ids=[eos]))
    eng.add_request("min", [1, 2, 3], SamplingParams(temperature=0, max_tokens=6, min_tokens=6,
                                                     stop_token_ids=[eos]))
    done = run_all(eng)
    assert len(done["min"].outputs[0].token_ids) == 6
    assert eos not in done["min"].outputs[0].token_ids
    assert done["min"].outputs[0].finish_reason == "length"


def test_prompt_logprobs_survive_chunking_and_preemption(make_engine):
    """Prompt logprobs computed in 16-token chunks, by requests that get preempted
    (recompute) and resumed, equal those of each request run alone in one chunk."""
    prompts = [PROMPTS[i % len(PROMPTS)] * 4 for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=2)
    alone = {}
    eng = make_engine(model="smollm2", device="cpu", dtype="float32", num_gpu_blocks=64)
    for i, p in enumerate(prompts):  # one at a time, whole prompt in one chunk
        eng.add_request(f"r{i}", p, params)
        alone.update(run_all(eng, check=False))
    # 3 x (~25 + 16) tokens into 6 blocks of 16: someone must be preempted
    eng = make_engine(model="smollm2", device="cpu", dtype="float32", num_gpu_blocks=6,
                      max_num_batched_tokens=16)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    squeezed = run_all(eng)
    assert sum(o.metrics.num_preemptions for o in squeezed.values()) > 0
    for rid, out in squeezed.items():
        want = alone[rid].prompt_logprobs
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids) == len(want)
        for got, ref in zip(out.prompt_logprobs[1:], want[1:], strict=True):
            assert got.keys() == ref.keys()
            assert max(abs(got[t] - ref[t]) for t in got) < 1e-4
