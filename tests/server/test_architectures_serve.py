"""``kvscope serve`` serves each architecture (tiny random HF directories of that
architecture, as transformers writes them): completions that run past the sliding window.
(The tokens themselves are checked against transformers in tests/model: with no tokenizer
the daemon answers token counts here, and its logprobs need a tokenizer.)"""

from __future__ import annotations

import pytest

from tests.model.tiny_models import save_hf, tiny_hf_model
from tests.server.conftest import serve_in_process

PROMPT = [(13 * i + 1) % 272 for i in range(40)]


@pytest.mark.parametrize("kind,overrides", [
    ("qwen3", {}),
    ("phi3", {}),
    ("mistral", {"sliding_window": 16}),
    ("gemma3_text", {}),  # W = 16 on six of its seven layers
])
def test_serve_answers_past_the_window(tmp_path, kind, overrides):
    path = str(save_hf(tiny_hf_model(kind, seed=31, **overrides), tmp_path / kind))
    served = serve_in_process("--model", path, "--dtype", "float32", "--num-gpu-blocks", "64")
    try:
        body = {"model": path, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        for n in (8, 9):
            r = served.http.post("/v1/completions", json={**body, "max_tokens": n})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == n
            assert r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        served.close()
