"""Each architecture beyond Llama against transformers on a tiny random model built from a
config of that architecture and saved as safetensors (and as GGUF where llama.cpp writes the
architecture): logits within tolerance of HF's forward, and the engine's greedy tokens (paged
cache, several blocks) identical to HF ``generate`` for 32 steps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvscope.engine import LLM, SamplingParams
from kvscope.engine.model.loader import load_model
from tests.model.tiny_models import hf_logits, our_logits, save_hf, tiny_hf_model, write_tiny_gguf

PROMPT = [(11 * i + 5) % 272 for i in range(40)]
STEPS = 32


def hf_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    hf.generation_config.eos_token_id = None  # as ignore_eos: EOS is a token like any other
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                          max_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine_greedy(path, prompt: list[int] | str, steps: int, **engine_args) -> list[int]:
    """Greedy token ids from the engine; a text prompt goes through the model's tokenizer."""
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=8, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    request = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    out = llm.generate(request, params, use_tqdm=False)[0].outputs[0]
    return out.token_ids


def check_parity(hf, path, prompt: list[int] = PROMPT, atol: float = 2e-5) -> None:
    model, _, _ = load_model(path)
    torch.testing.assert_close(our_logits(model, prompt), hf_logits(hf, prompt), atol=atol,
                               rtol=0)
    assert engine_greedy(path, prompt, STEPS) == hf_greedy(hf, prompt, STEPS)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    hf = tiny_hf_model("qwen3", seed=11)
    return hf, save_hf(hf, tmp_path_factory.mktemp("qwen3"))


def test_qwen3_matches_transformers(qwen3):
    hf, path = qwen3
    _, _, config = load_model(path)
    assert config.architecture == "qwen3" and config.qk_norm and config.head_dim == 24
    assert not config.attention_bias
    check_parity(hf, path)


def test_qwen3_gguf_matches_transformers(qwen3, tmp_path):
    hf, _ = qwen3
    path = write_tiny_gguf(hf, tmp_path / "qwen3.gguf", arch="qwen3", tie=False)
    model, _, config = load_model(path)
    assert config.architecture == "qwen3" and config.qk_norm and config.head_dim == 24
    torch.testing.assert_close(our_logits(model, PROMPT), hf_logits(hf, PROMPT), atol=2e-5,
                               rtol=0)


def test_qwen3_compiled_decode_matches_transformers(qwen3):
    """The torch.compile'd CPU decode forward traces the same forward, q/k norms included."""
    hf, path = qwen3
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=8, enforce_eager=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]
    compiled = llm.llm_engine.runner.compiled
    assert compiled is not None and compiled.enabled and compiled.compiled_buckets
    assert out.token_ids == hf_greedy(hf, PROMPT, 8)


def _phi4_mini_like(**overrides) -> dict:
    """Phi-4-mini's shape of RoPE in small: 3/4 of each head rotated, LongRoPE factors."""
    rotary = int(16 * 0.75)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.1 * i for i in range(rotary // 2)],
            "long_factor": [1.5 + 0.5 * i for i in range(rotary // 2)]}
    return {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 128,
            "rope_parameters": rope, "tie_word_embeddings": True} | overrides


def test_phi3_matches_transformers(tmp_path):
    hf = tiny_hf_model("phi3", seed=12)
    path = save_hf(hf, tmp_path)
    _, _, config = load_model(path)
    assert config.architecture == "phi3" and config.rope_dim == config.head_dim
    check_parity(hf, path)


def test_phi4_mini_partial_rotary_and_longrope_match_transformers(tmp_path):
    hf = tiny_hf_model("phi3", seed=13, **_phi4_mini_like())
    path = save_hf(hf, tmp_path)
    _, _, config = load_model(path)
    assert config.rotary_dim == 12 and config.rope_scaling["rope_type"] == "longrope"
    assert config.rope_scaling["attention_factor"] > 1.0  # 256 / 128: factor 2
    check_parity(hf, path)  # 40 + 32 tokens: inside the pretraining length (short factors)


def test_phi4_mini_gguf_matches_safetensors(tmp_path):
    """Phi-4-mini's shape written as llama.cpp's converter writes it (arch phi3: fused
    attn_qkv and ffn_up, rope.dimension_count the rotated part, LongRoPE factors as the
    rope_factors_long/short tensors, window 0 for none): the config and logits of the same
    model from safetensors, and HF's greedy tokens."""
    hf = tiny_hf_model("phi3", seed=17, **_phi4_mini_like())
    path = write_tiny_gguf(hf, tmp_path / "phi4.gguf", arch="phi3")
    model, _, config = load_model(path)
    from_hf, _, hf_config = load_model(save_hf(hf, tmp_path / "hf"))
    assert config.rotary_dim == 12 and config.sliding_window is None
    assert config.rope_scaling.keys() == hf_config.rope_scaling.keys()
    for key, value in hf_config.rope_scaling.items():  # GGUF's factors are float32
        assert config.rope_scaling[key] == (value if key == "rope_type" else
                                            pytest.approx(value, rel=1e-6)), key
    assert dataclasses.replace(config, bos_token_id=hf_config.bos_token_id,
                               eos_token_ids=hf_config.eos_token_ids,
                               rms_norm_eps=hf_config.rms_norm_eps,
                               rope_scaling=hf_config.rope_scaling) == hf_config
    ours = our_logits(model, PROMPT)
    torch.testing.assert_close(ours, our_logits(from_hf, PROMPT), atol=1e-6, rtol=0)
    assert engine_greedy(path, PROMPT, STEPS) == hf_greedy(hf, PROMPT, STEPS)


def test_longrope_long_factors_past_the_pretraining_length():
    """Past original_max_position_embeddings the long factors apply: our cos/sin equal
    transformers' at those positions (its rotary embedding switches on the max position)."""
    import transformers

    from kvscope.engine.model.config import config_from_hf
    from kvscope.engine.model.rope import RotaryEmbedding

    hf_config = transformers.Phi3Config(hidden_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=256,
                                        pad_token_id=0, **_phi4_mini_like())
    ours = config_from_hf(hf_config.to_dict(), "phi3")
    rope = RotaryEmbedding(ours.rope_dim, ours.rope_theta, ours.rope_scaling, torch.device("cpu"))
    theirs = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(hf_config)
    x = torch.zeros(1, 4, 16)
    for positions in (torch.arange(0, 100), torch.arange(128, 200)):  # short, then long
        hf_cos, hf_sin = theirs(x, positions[None])
        cos, sin = rope.cos_sin(positions, torch.float32)
        torch.testing.assert_close(cos[:, 0], hf_cos[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(sin[:, 0], hf_sin[0], atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    hf = tiny_hf_model("gemma3_text", seed=14)
    return hf, save_hf(hf, tmp_path_factory.mktemp("gemma3"))


def test_gemma3_matches_transformers_past_its_window(gemma3):
    """Windowed layers (W = 16) and global ones, separate RoPE bases (the global one linearly
    scaled), q/k norms, four norms a layer, the scaled embedding; a 40-token prompt and 32
    greedy tokens run far past the window."""
    hf, path = gemma3
    _, _, config = load_model(path)
    assert config.architecture == "gemma3_text" and config.qk_norm
    assert config.layer_windows == (16, 16, 16, 16, 16, None, 16)
    assert config.rope_local_theta == 10000.0 and config.rope_scaling["factor"] == 4.0
    assert config.attn_scale == 24 ** -0.5
    check_parity(hf, path, atol=5e-5)


def test_gemma3_final_logit_softcap_matches_transformers(tmp_path):
    hf = tiny_hf_model("gemma3_text", seed=15, final_logit_softcapping=0.5)
    model, _, config = load_model(save_hf(hf, tmp_path))
    assert config.final_logit_softcapping == 0.5
    ours = our_logits(model, PROMPT)
    assert float(ours.abs().max()) <= 0.5
    torch.testing.assert_close(ours, hf_logits(hf, PROMPT), atol=2e-5, rtol=0)


def test_gemma3_gguf_matches_safetensors(tmp_path):
    """Gemma 3 written as llama.cpp's converter writes it (arch gemma3: norms stored as 1 + w,
    its four norm names, the global base with its linear scaling and the local base in the
    metadata, the window, the soft-cap, tied embeddings, its SentencePiece tokenizer) loads
    to the config and logits of the same model from safetensors, and decodes HF's greedy
    tokens past the window from a text prompt the engine tokenizes."""
    hf = tiny_hf_model("gemma3_text", seed=16, query_pre_attn_scalar=16,
                       final_logit_softcapping=2.0, vocab_size=400)  # the SPM vocab's 397
    path = write_tiny_gguf(hf, tmp_path / "gemma3.gguf", arch="gemma3", spm=True)
    model, tokenizer, config = load_model(path)
    text = "<start_of_turn>user\nhello there, the quick brown fox<end_of_turn>"
    ids = tokenizer.encode(text)
    assert ids[:2] == [2, 4] and ids[-1] == 5  # BOS, the turn markers whole
    assert len(ids) > config.sliding_window and tokenizer.decode(ids) == \
        "user\nhello there, the quick brown fox"
    from_hf, _, hf_config = load_model(save_hf(hf, tmp_path / "hf"))
    assert config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps)  # GGUF's is a float32
    assert dataclasses.replace(config, bos_token_id=hf_config.bos_token_id,
                               eos_token_ids=hf_config.eos_token_ids,
                               rms_norm_eps=hf_config.rms_norm_eps) == hf_config
    assert model.lm_head is model.embed
    ours = our_logits(model, PROMPT)
    torch.testing.assert_close(ours, our_logits(from_hf, PROMPT), atol=1e-6, rtol=0)
    torch.testing.assert_close(ours, hf_logits(hf, PROMPT), atol=5e-5, rtol=0)
    assert engine_greedy(path, text, STEPS) == hf_greedy(hf, ids, STEPS)
