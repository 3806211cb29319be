"""Mistral's sliding window, honoured: past the window a windowed layer sees only the last W
positions, in the contiguous reference forward and in the engine's paged CPU path, exactly
as transformers computes it."""

from __future__ import annotations

import pytest
import torch

from kvscope.engine import LLM, SamplingParams
from kvscope.engine.model.config import config_from_hf
from kvscope.engine.model.loader import load_model
from tests.model.tiny_models import hf_logits, our_logits, save_hf, tiny_hf_model

WINDOW = 48
PROMPT = [(7 * i + 3) % 272 for i in range(97)]  # two windows and a token


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    hf = tiny_hf_model("mistral", seed=5, sliding_window=WINDOW)
    return hf, save_hf(hf, tmp_path_factory.mktemp("mistral-w48"))


def hf_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    hf.generation_config.eos_token_id = None  # as ignore_eos
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                          max_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_config_reads_the_window(windowed):
    _, path = windowed
    _, _, config = load_model(path)
    assert config.sliding_window == WINDOW and config.layer_windows == (WINDOW, WINDOW)
    base = {"model_type": "mistral", "num_hidden_layers": 1, "hidden_size": 8,
            "num_attention_heads": 2, "intermediate_size": 8, "vocab_size": 8}
    assert not config_from_hf(base | {"sliding_window": None}, "x").windowed


def test_past_the_window_logits_match_transformers(windowed):
    hf, path = windowed
    model, _, _ = load_model(path)
    torch.testing.assert_close(our_logits(model, PROMPT), hf_logits(hf, PROMPT), atol=2e-5,
                               rtol=0)


@pytest.mark.parametrize("engine_args", [
    {"block_size": 8, "disable_hybrid_kv_cache_manager": True},  # every block kept
    # the hybrid cache (every layer windowed, so the window group holds all the pages and
    # releases each block once out of the window: engine.cache.window_group) with a
    # prefill in chunks and prefix-cache hits on the second request: the hit takes the
    # window blocks of the prefix's last W tokens only
    {"block_size": 16, "max_num_batched_tokens": 32},
    {"block_size": 8, "enable_prefix_caching": False},
    {"block_size": 16, "max_num_batched_tokens": 32, "enable_prefix_caching": False},
])
def test_engine_greedy_past_the_window_matches_transformers_generate(windowed, engine_args):
    hf, path = windowed
    llm = LLM(str(path), device="cpu", dtype="float32", **engine_args)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    expected = hf_greedy(hf, PROMPT, 32)
    hybrid = not engine_args.get("disable_hybrid_kv_cache_manager")
    assert (llm.llm_engine.cache.window is not None) == hybrid
    for i in range(2):
        res = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
        assert res.outputs[0].token_ids == expected
        if i and engine_args.get("enable_prefix_caching", True):
            assert res.metrics.num_cached_tokens > WINDOW


@pytest.mark.parametrize("engine_args", [{"kv_demotion": "int8"},
                                         {"kv_cache_dtype": "kivi4"}])
def test_windowed_model_refuses_the_page_formats_that_take_no_window(windowed, engine_args):
    _, path = windowed
    with pytest.raises(ValueError, match="sliding-window layers.*takes no window.*int8"):
        LLM(str(path), device="cpu", dtype="float32", **engine_args)


def test_qwen2_windowed_layers_are_refused():
    from kvscope.engine.model.errors import ModelLoadError

    cfg = {"model_type": "qwen2", "num_hidden_layers": 1, "hidden_size": 8,
           "num_attention_heads": 2, "intermediate_size": 8, "vocab_size": 8,
           "use_sliding_window": True, "sliding_window": 16}
    with pytest.raises(ModelLoadError, match="qwen2 with use_sliding_window"):
        config_from_hf(cfg, "x")


def test_swap_preemption_of_a_model_windowed_in_every_layer(windowed):
    """Every layer windowed: the hybrid cache's group 0 has no pages (bookkeeping only), so
    a swap moves pages of the window group alone (engine.runner.swapper); two requests in
    a window pool that holds one decoding sequence and a prefill chunk at most swap, and
    both keep transformers' tokens."""
    hf, path = windowed
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=8, num_gpu_blocks=12,
              max_num_batched_tokens=16, swap_space=0.01, preemption_mode="swap",
              watermark=0.0)
    eng = llm.llm_engine
    assert eng.runner.swapper.device_tensors == [] and eng.runner.swapper.window is not None
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:60]]
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in res] == [hf_greedy(hf, p, 24) for p in prompts]
    assert eng.cache.window_host.num_swap_outs > 0 and eng.cache.num_swap_fallbacks == 0
    assert eng.swapper.window.blocks_out > 0 and eng.swapper.blocks_out == 0


def test_a_window_pool_smaller_than_one_prefill_chunk_is_raised_to_it(windowed):
    """``num_gpu_blocks=10`` of 8 tokens and a 97-token prompt in one 128-token chunk: the
    chunk needs its 97 positions beside the window at once (14 window blocks), so a window
    pool of 10 would leave the prompt waiting forever; the pool gets that floor instead."""
    hf, path = windowed
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=8, num_gpu_blocks=10,
              max_num_batched_tokens=128, enable_prefix_caching=False)
    assert llm.llm_engine.cache.window.pool.num_blocks >= 14
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    res = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    assert res.outputs[0].token_ids == hf_greedy(hf, PROMPT, 8)
