"""OpenAI's logit_bias and vLLM's sampling penalties (repetition, frequency, presence): the
formula against a plain loop written from vLLM's definition, the paged engine against plain
generation with the same adjustments (greedy and seeded, next to a neighbour without any
that stays untouched), and logprobs that stay the raw ones. (transformers'
repetition_penalty agrees too: tests/model/test_parity_hf.py.)"""

from __future__ import annotations

import pytest
import torch

from kvscope.engine.reference_generate import generate_reference
from kvscope.engine.sampling_ops import adjust_logits
from kvscope.engine.sampling_params import SamplingParams
from tests.engine.conftest import GREEDY, PROMPTS, as_prompt, prompt_ids, run_all


def _by_hand(logits: list[float], prompt: list[int], output: list[int],
             p: SamplingParams) -> list[float]:
    out = []
    for t, x in enumerate(logits):
        x += (p.logit_bias or {}).get(t, 0.0)
        if t in prompt or t in output:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        n = output.count(t)
        x -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
        out.append(x)
    return out


@pytest.mark.parametrize("kw", [{"repetition_penalty": 1.3}, {"frequency_penalty": 0.7},
                                {"presence_penalty": -1.5},
                                {"repetition_penalty": 0.8, "frequency_penalty": 2.0,
                                 "presence_penalty": 1.0},
                                {"logit_bias": {5: 3.0, 11: -100}, "repetition_penalty": 1.5}])
def test_the_formula_is_vllms(kw):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, generator=g) * 3
    prompt, output = [1, 5, 5, 9], [5, 7, 7, 7, 30]
    p = SamplingParams(**kw)
    seen = torch.tensor(sorted(set(prompt) | set(output)))
    counted = (torch.tensor([5, 7, 30]), torch.tensor([1.0, 3.0, 1.0]))
    got = adjust_logits(logits[None], [p], [seen], [counted])[0]
    assert torch.allclose(got, torch.tensor(_by_hand(logits.tolist(), prompt, output, p)))
    # in a batch, each row with its own parameters; a row without penalties is untouched
    other = SamplingParams(frequency_penalty=-1.0)
    both = adjust_logits(torch.stack([logits] * 3), [p, other, SamplingParams()],
                           [seen] * 3, [counted] * 3)
    assert torch.allclose(both[0], got) and torch.equal(both[2], logits)
    assert torch.allclose(both[1], torch.tensor(_by_hand(logits.tolist(), prompt, output,
                                                          other)))


@pytest.mark.parametrize("bad", [{"presence_penalty": 2.5}, {"frequency_penalty": -2.01},
                                 {"repetition_penalty": 0}, {"repetition_penalty": True},
                                 {"logit_bias": {1: 101}}, {"logit_bias": {-1: 1}},
                                 {"logit_bias": {"1": 1}}])
def test_out_of_range_is_a_value_error_naming_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_paged_engine_equals_plain_generation_with_penalties(make_engine, loaded, reference):
    """Batched (``_draw_batched``) and preempted: the same tokens as plain generation; the
    neighbour without adjustments is the plain greedy reference; each adjustment changed
    the tokens."""
    model, tok, cfg = loaded
    text = PROMPTS[1]
    ids = prompt_ids(tok, text, cfg.vocab_size)
    plain = generate_reference(model, tok, ids, SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True)).token_ids
    adjusted = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.4),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0,
                       presence_penalty=2.0),
        SamplingParams(temperature=0.9, seed=3, max_tokens=24, ignore_eos=True,
                       repetition_penalty=1.2, presence_penalty=1.0),
        # the plain answer's 4th token banned, another one favoured
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                       logit_bias={plain[3]: -100.0, plain[0]: 2.0}),
    ]
    eng = make_engine(num_gpu_blocks=12, block_size=4)  # small: preemption happens
    for i, p in enumerate(adjusted):
        eng.add_request(f"p{i}", as_prompt(loaded, text), p)
    eng.add_request("plain", as_prompt(loaded, PROMPTS[0]), GREEDY)
    out = run_all(eng)
    for i, p in enumerate(adjusted):
        want = generate_reference(model, tok, ids, p).token_ids
        assert out[f"p{i}"].outputs[0].token_ids == want, i
    assert out["plain"].outputs[0].token_ids == reference[PROMPTS[0]]
    assert out["p0"].outputs[0].token_ids != plain
    assert out["p1"].outputs[0].token_ids != plain
    assert plain[3] not in out["p3"].outputs[0].token_ids


def test_a_logit_bias_past_the_vocabulary_is_refused_at_add(make_engine, loaded):
    eng = make_engine()
    with pytest.raises(ValueError, match="logit_bias"):
        eng.add_request("x", as_prompt(loaded, "hi"), SamplingParams(
            logit_bias={loaded[2].vocab_size: 1.0}))
    assert not eng.has_unfinished_requests()


def test_logprobs_stay_raw(make_engine, loaded):
    """vLLM's default: the reported logprob is the model's own, before any penalty: the
    same as the teacher-forced prompt logprob of that token."""
    model, tok, cfg = loaded
    ids = prompt_ids(tok, PROMPTS[1], cfg.vocab_size)
    out = generate_reference(model, tok, ids, SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0, repetition_penalty=1.5))
    eng = make_engine()
    eng.add_request("forced", {"prompt_token_ids": ids + out.token_ids},
                    SamplingParams(max_tokens=1, prompt_logprobs=0))
    forced = run_all(eng)["forced"].prompt_logprobs[len(ids):]
    for entry, t, raw in zip(out.logprobs, out.token_ids, forced, strict=True):
        assert entry[t] == pytest.approx(raw[t], abs=1e-4)
