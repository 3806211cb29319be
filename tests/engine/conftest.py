"""Engine tests share one loaded default model (loading costs seconds; the weights are
read-only during generation, so sharing them across engines is safe).

Where they run (issue 18): by default the embedded model on CPU in fp32. On a GPU machine,
where the GGUF cannot travel, ``KVSCOPE_TEST_MODEL=dummy:smollm2-135m
KVSCOPE_TEST_DEVICE=cuda`` runs the same invariance checks on random weights of the real
shapes (engine.model.dummy; every engine shares the one seeded model), and
``KVSCOPE_TEST_DTYPE`` picks the dtype (default float32: greedy identity across batch
shapes is a property of the cache, and bf16 rounding differs between kernels' batch shapes).
A dummy model has no tokenizer, so tests turn their text prompts into ids with
``prompt_ids``."""

from __future__ import annotations

import os
import re
import zlib

import pytest
import torch

from kvscope.engine.config import EngineConfig
from kvscope.engine.engine import LLMEngine
from kvscope.engine.model import load_model
from kvscope.engine.reference_generate import generate_reference
from kvscope.engine.sampling_params import SamplingParams

# Prompts and greedy params of the invariance tests (engine and swap tier alike).
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "List three colours of the rainbow:",
    "In 1969, the first humans",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
TEST_MODEL = os.environ.get("KVSCOPE_TEST_MODEL", "smollm2")
TEST_DEVICE = os.environ.get("KVSCOPE_TEST_DEVICE", "cpu")
TEST_DTYPE = getattr(torch, os.environ.get("KVSCOPE_TEST_DTYPE", "float32"))


def prompt_ids(tokenizer, text: str, vocab: int = 49152) -> list[int]:
    """The prompt's token ids: the tokenizer's, or (a dummy model has none) one id per word
    or punctuation mark, a hash of it, so prompts keep about their real token counts (the
    preemption tests size the cache by them) and a shared prefix gives shared ids."""
    if tokenizer is not None:
        return tokenizer.encode(text)
    words = re.findall(r"\s*(?:\w+|[^\w\s])", text)
    return [zlib.crc32(w.encode()) % (vocab - 3) + 3 for w in words]


def as_prompt(loaded, text: str) -> dict:
    return {"prompt_token_ids": prompt_ids(loaded[1], text, loaded[2].vocab_size)}


@pytest.fixture(scope="session")
def loaded():
    # One thread: on a shared 2-core box a second torch thread makes every small op wait.
    torch.set_num_threads(1)
    return load_model(TEST_MODEL, device=TEST_DEVICE, dtype=TEST_DTYPE)


@pytest.fixture(scope="session")
def reference(loaded):
    """{prompt: greedy token ids} from plain contiguous generation, the correctness oracle."""
    model, tok, cfg = loaded
    return {p: generate_reference(model, tok, prompt_ids(tok, p, cfg.vocab_size),
                                  GREEDY).token_ids for p in PROMPTS}


@pytest.fixture
def make_engine(loaded):
    engines: list[LLMEngine] = []

    def make(**kwargs) -> LLMEngine:
        # 1 GiB of KV unless a test sizes it (the CPU default; on a GPU the engine would
        # otherwise take 90% of the card for each of the engines a test keeps open)
        sized = "num_gpu_blocks" in kwargs or "kv_cache_memory_bytes" in kwargs
        kwargs = {"device": TEST_DEVICE, "dtype": TEST_DTYPE,
                  **({} if sized else {"kv_cache_memory_bytes": 1 << 30}), **kwargs}
        eng = LLMEngine(EngineConfig(**kwargs), loaded=loaded)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.close()


def run_all(engine: LLMEngine, check: bool = True) -> dict:
    """Step until idle; return {request_id: final RequestOutput}. With ``check``, the cache
    manager's invariants are verified after every step."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check:
            engine.cache.check_invariants()
    return done
