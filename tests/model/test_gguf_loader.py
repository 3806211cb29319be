"""The GGUF loader on tiny files written like llama.cpp's converter writes them."""

from __future__ import annotations

import torch

from kvscope.engine.model.loader import load_model
from tests.model.tiny_models import hf_logits, our_logits, tiny_hf_model, write_tiny_gguf

IDS = [3, 17, 250, 9, 100, 42, 42, 7, 199, 0, 55, 13]


def test_f32_gguf_unpermutes_qk_and_matches_transformers(tmp_path):
    hf = tiny_hf_model("llama", tie_word_embeddings=True)
    model, tokenizer, config = load_model(write_tiny_gguf(hf, tmp_path / "tiny.gguf"))
    assert config.tie_word_embeddings and config.num_kv_heads == 2
    assert model.lm_head is model.embed
    assert tokenizer is not None and tokenizer.eos_token_ids == (257,)
    torch.testing.assert_close(our_logits(model, IDS), hf_logits(hf, IDS), atol=2e-5, rtol=0)


def test_f16_gguf_with_output_head(tmp_path):
    hf = tiny_hf_model("llama", seed=4, tie_word_embeddings=False)
    model, _, config = load_model(write_tiny_gguf(hf, tmp_path / "t.gguf", qtype="F16",
                                                  tie=False))
    assert not config.tie_word_embeddings
    # The reference sees the same fp16 rounding of the matrices the file stores.
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.copy_(p.half().float())
    torch.testing.assert_close(our_logits(model, IDS), hf_logits(hf, IDS), atol=2e-5, rtol=0)


def test_gguf_tokenizer_metadata(tmp_path):
    _, tokenizer, _ = load_model(write_tiny_gguf(tiny_hf_model("llama"), tmp_path / "t.gguf"))
    ids = tokenizer.encode("<|im_start|>hi 42 there<|im_end|>")
    assert ids[0] == 256 and ids[-1] == 257  # control tokens stay whole
    assert tokenizer.decode(ids) == "hi 42 there"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hi 42 there<|im_end|>"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == \
        "<|im_start|>x<|im_end|>"
