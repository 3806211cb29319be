"""Mistral's sliding window: a context is bounded by the window (where windowed attention and
the full attention kvscope computes agree exactly), never run silently past it."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.config import config_from_hf
from engine.model.loader import load_model
from tests.model.tiny_models import hf_logits, our_logits, save_hf, tiny_hf_model

WINDOW = 48


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    hf = tiny_hf_model("mistral", seed=5, sliding_window=WINDOW)
    return hf, save_hf(hf, tmp_path_factory.mktemp("mistral-w48"))


def test_config_bounds_the_context_by_the_window(windowed):
    _, path = windowed
    _, _, config = load_model(path)
    assert config.sliding_window == WINDOW and config.max_position_embeddings == 256
    assert config.max_context == WINDOW
    base = {"model_type": "mistral", "num_hidden_layers": 1, "hidden_size": 8,
            "num_attention_heads": 2, "intermediate_size": 8, "vocab_size": 8}
    assert config_from_hf(base | {"sliding_window": None}, "x").max_context == 2048
    assert config_from_hf(base | {"sliding_window": 4096}, "x").max_context == 2048


def test_within_the_window_logits_and_greedy_match_transformers(windowed):
    hf, path = windowed
    model, _, _ = load_model(path)
    ids = [(7 * i + 3) % 272 for i in range(WINDOW)]
    torch.testing.assert_close(our_logits(model, ids), hf_logits(hf, ids), atol=2e-5, rtol=0)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4)
    prompt = ids[:16]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=64),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == WINDOW - len(prompt) and out.finish_reason == "length"
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                             max_new_tokens=len(out.token_ids), do_sample=False,
                             pad_token_id=0)[0, len(prompt):].tolist()
    assert out.token_ids == theirs


def test_past_the_window_is_refused_with_the_reason(windowed):
    _, path = windowed
    with pytest.raises(ValueError, match="sliding window of 48 tokens"):
        LLM(str(path), device="cpu", dtype="float32", max_model_len=97)
    llm = LLM(str(path), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="max_model_len is 48"):
        llm.generate({"prompt_token_ids": list(range(97))}, SamplingParams(max_tokens=4),
                     use_tqdm=False)


def test_qwen2_windowed_layers_are_refused():
    from engine.model.errors import ModelLoadError

    cfg = {"model_type": "qwen2", "num_hidden_layers": 1, "hidden_size": 8,
           "num_attention_heads": 2, "intermediate_size": 8, "vocab_size": 8,
           "use_sliding_window": True, "sliding_window": 16}
    with pytest.raises(ModelLoadError, match="qwen2 with use_sliding_window"):
        config_from_hf(cfg, "x")
