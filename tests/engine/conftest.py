"""Engine tests share one loaded default model (loading costs seconds; the weights are
read-only during generation, so sharing them across engines is safe)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model import load_model
from engine.reference_generate import generate_reference
from engine.sampling import SamplingParams

# Prompts and greedy params of the invariance tests (engine and swap tier alike).
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "List three colours of the rainbow:",
    "In 1969, the first humans",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="session")
def loaded():
    # One thread: on a shared 2-core box a second torch thread makes every small op wait.
    torch.set_num_threads(1)
    return load_model("smollm2", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def reference(loaded):
    """{prompt: greedy token ids} from plain contiguous generation, the correctness oracle."""
    model, tok, _ = loaded
    return {p: generate_reference(model, tok, tok.encode(p), GREEDY).token_ids for p in PROMPTS}


@pytest.fixture
def make_engine(loaded):
    engines: list[LLMEngine] = []

    def make(**kwargs) -> LLMEngine:
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
