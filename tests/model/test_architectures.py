"""Each architecture beyond Llama against transformers on a tiny random model built from a
config of that architecture and saved as safetensors (and as GGUF where llama.cpp writes the
architecture): logits within tolerance of HF's forward, and the engine's greedy tokens (paged
cache, several blocks) identical to HF ``generate`` for 32 steps."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.loader import load_model
from tests.model.tiny_models import hf_logits, our_logits, save_hf, tiny_hf_model, write_tiny_gguf

PROMPT = [(11 * i + 5) % 272 for i in range(40)]
STEPS = 32


def hf_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                          max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine_greedy(path, prompt: list[int], steps: int, **engine_args) -> list[int]:
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=8, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
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
