"""engine.runner.compiled: the torch.compile'd CPU decode forward (enforce_eager=False) gives the
eager forward's greedy fp32 tokens, pads a decode batch to its bucket without touching the KV
cache with the padding, and falls back to eager (never a crash) when compiling fails or no C++
compiler exists. Tiny shapes (dummy:tiny, 2 layers): one bucket compiles here."""

from __future__ import annotations

import logging

import pytest

from kvscope.engine import LLM, SamplingParams
from kvscope.engine.runner import compiled as compiled_mod

PROMPTS = [[5, 17, 99, 3, 250, 7], [11, 12], [300, 301, 302, 303, 304, 305, 306, 307, 308, 42]]


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def _tiny(**kw) -> LLM:
    return LLM("dummy:tiny", device="cpu", dtype="float32", seed=3, num_gpu_blocks=64, **kw)


@pytest.fixture(scope="module")
def eager_tokens() -> list[list[int]]:
    llm = _tiny()
    assert llm.llm_engine.runner.compiled is None  # CPU's default: eager
    return _greedy(llm)


def test_compiled_decode_gives_the_eager_tokens(eager_tokens):
    llm = _tiny(enforce_eager=False)
    compiled = llm.llm_engine.runner.compiled
    assert compiled is not None
    assert _greedy(llm) == eager_tokens
    # the 3 decoding sequences ran padded to the 4-token bucket, compiled (not a fallback)
    assert compiled.enabled and list(compiled.compiled_buckets) == [4]


def test_compile_failure_falls_back_to_eager(eager_tokens, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("inductor exploded")

    llm = _tiny(enforce_eager=False)
    compiled = llm.llm_engine.runner.compiled
    monkeypatch.setattr(compiled, "_fn", broken)
    with caplog.at_level(logging.WARNING, logger=compiled_mod.__name__):
        assert _greedy(llm) == eager_tokens
    assert not compiled.enabled and compiled.compiled_buckets == {}
    assert "inductor exploded" in caplog.text and "running eagerly" in caplog.text


def test_no_cpp_compiler_runs_eagerly(monkeypatch, caplog):
    monkeypatch.setattr(compiled_mod, "compiler_problem", lambda: "no g++ on PATH")
    with caplog.at_level(logging.WARNING, logger=compiled_mod.__name__):
        llm = _tiny(enforce_eager=False)
    assert llm.llm_engine.runner.compiled is None
    assert "no g++ on PATH" in caplog.text


def test_buckets():
    assert [compiled_mod.bucket_for(n) for n in (1, 2, 3, 5, 128)] == [1, 2, 4, 8, 128]
    assert compiled_mod.bucket_for(129) is None


def test_cli_switch():
    from kvscope.engine.cli import build_parser

    for cmd in (["serve"], ["generate", "hi"]):
        assert build_parser().parse_args(cmd).enforce_eager is None  # the device's default
        assert build_parser().parse_args([*cmd, "--no-enforce-eager"]).enforce_eager is False
        assert build_parser().parse_args([*cmd, "--enforce-eager"]).enforce_eager is True
