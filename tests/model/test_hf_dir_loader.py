"""The HF-directory loader and the forward against transformers on tiny random models."""

from __future__ import annotations

import json

import pytest
import torch

from kvscope.engine.model.loader import load_model
from tests.model.tiny_models import hf_logits, our_logits, save_hf, tiny_hf_model

IDS = [3, 17, 250, 9, 100, 42, 42, 7, 199, 0, 55, 13]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_logits_match_transformers(tmp_path, kind):
    hf = tiny_hf_model(kind)
    model, tokenizer, config = load_model(save_hf(hf, tmp_path / kind))
    assert tokenizer is None  # no tokenizer.json in a bare saved model
    assert config.architecture == kind
    assert config.attention_bias == (kind == "qwen2")
    torch.testing.assert_close(our_logits(model, IDS), hf_logits(hf, IDS), atol=2e-5, rtol=0)


def test_sharded_checkpoint_and_untied_head(tmp_path):
    hf = tiny_hf_model("llama", seed=1, tie_word_embeddings=False)
    save_hf(hf, tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, _, config = load_model(tmp_path)
    assert not config.tie_word_embeddings
    torch.testing.assert_close(our_logits(model, IDS), hf_logits(hf, IDS), atol=2e-5, rtol=0)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    hf = tiny_hf_model("llama", seed=2, rope_parameters={"rope_theta": 500000.0, **scaling})
    model, _, config = load_model(save_hf(hf, tmp_path))
    assert config.rope_scaling["rope_type"] == "llama3"
    ids = (IDS * 4)[:40]  # past original_max_position_embeddings
    torch.testing.assert_close(our_logits(model, ids), hf_logits(hf, ids), atol=2e-5, rtol=0)


def test_chunked_prefill_equals_one_shot(tmp_path):
    """Feeding the prompt in pieces through the contiguous cache gives the same logits."""
    from kvscope.engine.model.contiguous_cache import ContiguousKVCache

    model, _, config = load_model(save_hf(tiny_hf_model("qwen2", seed=3), tmp_path))
    full = our_logits(model, IDS)
    cache = ContiguousKVCache(config, len(IDS), "cpu", torch.float32)
    pieces = []
    for start, end in [(0, 5), (5, 6), (6, 12)]:
        hidden = model.forward(torch.tensor(IDS[start:end]), torch.arange(start, end), cache)
        pieces.append(model.compute_logits(hidden))
    torch.testing.assert_close(torch.cat(pieces), full, atol=1e-5, rtol=0)
