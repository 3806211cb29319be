"""Prompt logprobs (vLLM's ``prompt_logprobs``, the completions echo path) equal
transformers' teacher-forced logprobs on the same GGUF, within fp32 rounding: computed
in the prefill, across chunked-prefill chunks, and for a request whose prompt is
already in the prefix cache (such a request skips the lookup and computes them)."""

from __future__ import annotations

import torch

from kvscope.engine.config import EngineConfig
from kvscope.engine.engine import LLMEngine
from kvscope.engine.sampling_params import SamplingParams

GPL = open("/usr/share/common-licenses/GPL-3", encoding="utf-8").read()
TOLERANCE = 2e-3  # nats; the forward's logits agree within 1e-3 (test_parity_hf)


def _run(eng: LLMEngine) -> dict:
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_prompt_logprobs_match_transformers(smollm2, hf_model):
    model, tokenizer, config = smollm2
    ids = tokenizer.encode(GPL[:700])
    assert len(ids) > 100
    eng = LLMEngine(EngineConfig(model="smollm2", device="cpu", dtype="float32",
                                 num_gpu_blocks=64, max_num_batched_tokens=48),
                    loaded=(model, tokenizer, config))
    try:
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
        eng.add_request("first", ids, params)
        eng.add_request("plain", ids[:40], SamplingParams(temperature=0, max_tokens=2))
        first = _run(eng)["first"]
        eng.add_request("again", ids, params)  # its prompt blocks are cached now
        again = _run(eng)["again"]
    finally:
        eng.close()

    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    theirs = torch.log_softmax(logits, dim=-1)
    expected = theirs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    for out in (first, again):
        lps = out.prompt_logprobs
        assert len(lps) == len(ids) and lps[0] is None
        ours = torch.tensor([lps[j][ids[j]] for j in range(1, len(ids))])
        assert (ours - expected).abs().max().item() < TOLERANCE
        top3 = theirs[len(ids) // 2 - 1].topk(3).indices.tolist()
        assert set(top3) <= set(lps[len(ids) // 2])  # the top k ride along
    assert again.metrics.num_cached_tokens == 0  # no lookup: computed, not skipped
