"""Acceptance: our forward and greedy generation match transformers on the SAME GGUF file
(SmolLM2-135M-Instruct Q4_1), float32 on CPU. Both sides see the same prompt token ids."""

from __future__ import annotations

import pytest
import torch

from kvscope.engine.reference_generate import generate_reference
from kvscope.engine.sampling_params import SamplingParams
from tests.model.tiny_models import our_logits

pytestmark = pytest.mark.slow

GPL = open("/usr/share/common-licenses/GPL-3", encoding="utf-8").read()

CHATS = {
    "chat_short": [{"role": "user", "content": "What is the capital of France?"}],
    "chat_system_multi_turn": [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "7 is a prime number."},
        {"role": "user", "content": "And an even one?"}],
    "chat_long": [{"role": "user",
                   "content": "Summarize this license text:\n\n" + GPL[2000:3800]}],
}
RAW = {
    "raw_short": "The quick brown fox",
    "raw_code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "raw_long": GPL[:1800],
}


def _prompt_ids(tokenizer, name: str) -> list[int]:
    if name in CHATS:
        return tokenizer.apply_chat_template(CHATS[name], tokenize=True)
    return tokenizer.encode(RAW[name])


def _greedy(model, tokenizer, ids: list[int]):
    return generate_reference(model, tokenizer, ids, SamplingParams(temperature=0, max_tokens=32))


@pytest.mark.parametrize("name", [*CHATS, *RAW])
def test_greedy_tokens_and_logits_match_transformers(smollm2, hf_model, name):
    """One transformers forward over prompt + our 32 greedy tokens: its last-prompt-position
    logits must match ours, and its argmax at every step must be the token we chose (which is
    exactly "transformers' greedy decoding produces the same ids")."""
    model, tokenizer, _ = smollm2
    ids = _prompt_ids(tokenizer, name)
    if name.endswith("long"):
        assert len(ids) > 300
    out = _greedy(model, tokenizer, ids)
    assert len(out.token_ids) == 32 or out.token_ids[-1] == 2

    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids + out.token_ids])).logits[0].float()
    ours_last = our_logits(model, ids)[-1]
    assert (ours_last - theirs[len(ids) - 1]).abs().max().item() < 1e-3
    hf_greedy = theirs[len(ids) - 1:len(ids) + len(out.token_ids) - 1].argmax(-1).tolist()
    assert hf_greedy == out.token_ids


def test_transformers_generate_gives_the_same_answer(smollm2, hf_model):
    """The plain end-to-end form of the check above, once: transformers' own generate()."""
    model, tokenizer, _ = smollm2
    ids = _prompt_ids(tokenizer, "chat_short")
    out = _greedy(model, tokenizer, ids)
    with torch.no_grad():
        hf_ids = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                   max_new_tokens=32, do_sample=False,
                                   pad_token_id=2)[0, len(ids):].tolist()
    assert out.token_ids == hf_ids
    assert out.finish_reason == "stop" and hf_ids[-1] == 2  # the answer ends with <|im_end|>
    assert "Paris" in out.text


def test_repetition_penalty_matches_transformers(smollm2, hf_model):
    """vLLM's repetition_penalty is transformers' (prompt and output tokens alike): the same
    greedy answer as generate(repetition_penalty=...)."""
    model, tokenizer, _ = smollm2
    ids = _prompt_ids(tokenizer, "raw_long")
    params = SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3)
    out = generate_reference(model, tokenizer, ids, params)
    with torch.no_grad():
        hf_ids = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                   max_new_tokens=24, do_sample=False, repetition_penalty=1.3,
                                   pad_token_id=2)[0, len(ids):].tolist()
    assert out.token_ids == hf_ids and len(hf_ids) == 24
    assert out.token_ids != _greedy(model, tokenizer, ids).token_ids[:24]  # it did change
