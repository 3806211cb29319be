"""Random weights of real shapes (engine.model.dummy, vLLM's --load-format dummy): the
presets' shapes, seeded weights, the tokenizer-free path and its errors."""

from __future__ import annotations

import json

import pytest
import torch

from kvscope.engine import LLM, SamplingParams
from kvscope.engine.cli import main
from kvscope.engine.config import EngineConfig
from kvscope.engine.model import ModelLoadError, load_model, read_config
from kvscope.engine.model.dummy import PRESETS, dummy_config, weight_bytes

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_llama_3_8b_preset_has_the_real_shapes_and_weight_bytes():
    cfg = dummy_config("dummy:llama-3-8b")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta) == \
        (32, 4096, 32, 8, 128, 14336, 128256, 500000.0)
    # Meta-Llama-3-8B: 8.03B parameters, 0.53B of them the embedding (not read by decode)
    params = weight_bytes(cfg, 1) + cfg.vocab_size * cfg.hidden_size
    assert 8.02e9 < params < 8.04e9
    small = read_config("dummy:smollm2-135m")[1]
    assert (small.num_layers, small.hidden_size, small.num_heads, small.num_kv_heads,
            small.head_dim, small.vocab_size, small.tie_word_embeddings) == \
        (30, 576, 9, 3, 64, 49152, True)


def test_same_seed_same_weights_other_seed_other_weights():
    a, tok, _ = load_model("dummy:tiny", seed=3)
    b, _, _ = load_model("dummy:tiny", seed=3)
    c, _, _ = load_model("dummy:tiny", seed=4)
    assert tok is None
    assert torch.equal(a.dense_layers()[1].qkv, b.dense_layers()[1].qkv)
    assert torch.equal(a.lm_head, b.lm_head)
    assert not torch.equal(a.dense_layers()[1].qkv, c.dense_layers()[1].qkv)
    bf16, _, _ = load_model("dummy:tiny", dtype=torch.bfloat16, seed=3)
    assert bf16.dtype == torch.bfloat16  # the same draws, rounded
    assert torch.equal(bf16.dense_layers()[0].down, a.dense_layers()[0].down.to(torch.bfloat16))


def test_llm_with_load_format_dummy_generates_from_token_ids():
    llm = LLM(model="tiny", load_format="dummy", seed=1, num_gpu_blocks=64)
    twin = LLM(model="dummy:tiny", seed=1, num_gpu_blocks=64, block_size=4)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [10, 11]}]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    # same seed, other block size: the same greedy tokens (what the device checks rely on)
    assert [o.outputs[0].token_ids for o in twin.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in outs]
    with pytest.raises(ValueError, match="need a tokenizer.*prompt_token_ids"):
        llm.generate("a text prompt", GREEDY)
    with pytest.raises(ValueError, match="chat.*needs a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY)
    # the failed requests left nothing behind
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        outs[0].outputs[0].token_ids


def test_hf_config_and_config_json_give_the_shapes(tmp_path):
    shapes = dict(PRESETS["tiny"], num_hidden_layers=1, vocab_size=300)
    llm = LLM(model="mine", load_format="dummy", hf_config=shapes, num_gpu_blocks=16)
    assert llm.config.num_layers == 1 and llm.config.vocab_size == 300
    (tmp_path / "config.json").write_text(json.dumps(shapes))
    model, _, cfg = load_model(f"dummy:{tmp_path}")
    assert cfg.vocab_size == 300 and model.lm_head.shape == (300, 64)


def test_bad_dummy_arguments_are_clear_errors():
    with pytest.raises(ModelLoadError, match="unknown dummy model.*dummy:llama-3-8b"):
        load_model("dummy:llama-9")
    with pytest.raises(ValueError, match="load_format must be one of"):
        EngineConfig(load_format="safetensors")
    with pytest.raises(ValueError, match="hf_config.*load_format='dummy'"):
        EngineConfig(hf_config={"model_type": "llama"})
    with pytest.raises(ModelLoadError, match="lacks required key"):
        dummy_config("x", {"model_type": "llama"})


def test_cli_generate_with_token_ids_and_text_error(capsys):
    assert main(["generate", "--model", "dummy:tiny", "--prompt-token-ids", "--max-tokens",
                 "3", "1,2,3"]) == 0
    ids = capsys.readouterr().out.strip().split(",")
    assert len(ids) == 3 and all(i.isdigit() for i in ids)
    assert main(["generate", "--model", "dummy:tiny", "hello"]) == 1
    assert "--prompt-token-ids" in capsys.readouterr().out
    assert main(["generate", "--model", "tiny", "--load-format", "dummy", "--prompt-token-ids",
                 "--max-tokens", "2", "4,5"]) == 0  # vLLM's spelling
    assert len(capsys.readouterr().out.strip().split(",")) == 2


def test_gemma_3_1b_kv_preset_has_the_1b_kv_cache():
    """The CPU stand-in of Gemma 3 1B for capacity runs keeps every field its KV cache
    depends on; only the forward's width shrinks."""
    real, kv = dummy_config("dummy:gemma-3-1b"), dummy_config("dummy:gemma-3-1b-kv")
    assert real.layer_windows == kv.layer_windows and kv.layer_windows.count(None) == 4
    assert (real.num_kv_heads, real.head_dim, real.num_layers) == \
        (kv.num_kv_heads, kv.head_dim, kv.num_layers) == (1, 256, 26)
    assert weight_bytes(kv, 1) * 30 < weight_bytes(real, 1)
