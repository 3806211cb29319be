"""The invariance suite on a windowed model: a tiny random Gemma 3 (five sliding-window
layers of W = 8 per global one) whose greedy tokens, far past the window, are the contiguous
reference's (itself transformers' generate: tests/model/test_architectures.py) under every
cache configuration that must not change them: block sizes, preemption, chunked prefill,
prefix caching, copy-on-write forks, the contiguous layout, the swap tier."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model.loader import load_model
from engine.reference_generate import generate_reference
from engine.sampling import SamplingParams
from tests.engine.conftest import run_all
from tests.model.tiny_models import save_hf, tiny_hf_model

WINDOW = 8
SHARED = [(5 * i + 7) % 272 for i in range(24)]  # a prefix three windows long
PROMPTS = [SHARED + [(3 * i + t) % 272 for i in range(5 + 4 * t)] for t in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    hf = tiny_hf_model("gemma3_text", seed=21, sliding_window=WINDOW)
    path = save_hf(hf, tmp_path_factory.mktemp("gemma3-w8"))
    return load_model(path)


@pytest.fixture(scope="module")
def reference(loaded):
    model, tok, _ = loaded
    return [generate_reference(model, tok, p, GREEDY).token_ids for p in PROMPTS]


@pytest.fixture
def make_engine(loaded):
    engines: list[LLMEngine] = []

    def make(**kwargs) -> LLMEngine:
        kwargs = {"device": "cpu", "dtype": torch.float32, "model": "tiny-gemma3", **kwargs}
        eng = LLMEngine(EngineConfig(**kwargs), loaded=loaded)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.close()


def generate(engine, prompts, params=GREEDY):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    out = run_all(engine)
    return [out[str(i)] for i in range(len(prompts))]


def test_the_model_is_windowed(loaded):
    assert loaded[2].layer_windows.count(WINDOW) == 6 and loaded[2].layer_windows[5] is None
    assert all(len(p) > 3 * WINDOW for p in PROMPTS)


@pytest.mark.parametrize("engine_args", [
    {"block_size": 1, "num_gpu_blocks": 512},
    {"block_size": 4, "num_gpu_blocks": 128},
    {"block_size": 16, "num_gpu_blocks": 32},
    {"block_size": 4, "num_gpu_blocks": 128, "max_num_batched_tokens": 7},  # chunked
    {"kv_layout": "contiguous", "max_model_len": 64, "num_gpu_blocks": 64},
], ids=["bs1", "bs4", "bs16", "chunked7", "contiguous"])
def test_configurations_keep_the_reference_tokens(make_engine, reference, engine_args):
    outs = generate(make_engine(**engine_args), PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_preemption_and_the_swap_tier_keep_the_reference_tokens(make_engine, reference):
    # 24 blocks of 4 hold two of the four sequences at most: the growing ones preempt
    for extra in ({}, {"swap_space": 0.01, "preemption_mode": "swap"}):
        eng = make_engine(block_size=4, num_gpu_blocks=24, watermark=0.0, **extra)
        outs = generate(eng, PROMPTS)
        assert eng.scheduler.num_preemptions > 0
        assert [o.outputs[0].token_ids for o in outs] == reference


def test_prefix_caching_hits_keep_the_reference_tokens(make_engine, reference):
    eng = make_engine(block_size=4, num_gpu_blocks=128, enable_prefix_caching=True)
    outs = []
    for i, p in enumerate(PROMPTS):  # one at a time: later prompts hit the shared prefix
        eng.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
        outs.append(run_all(eng)[str(i)])
    assert all(o.metrics.num_cached_tokens >= 20 for o in outs[1:])
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_forks_keep_the_reference_tokens(make_engine, reference):
    eng = make_engine(block_size=4, num_gpu_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=2)
    outs = generate(eng, PROMPTS[:2], params)
    for out, ref in zip(outs, reference[:2], strict=True):
        assert out.outputs[0].token_ids == out.outputs[1].token_ids == ref
    assert eng.cache.metrics()["cow_copies"] > 0
