"""The daemon serving a dummy model (random weights, no tokenizer; engine.model.dummy), as
the GPU device runs it: token-id prompts work, text and chat are clear 400s, and the
daemon keeps serving after them."""

from __future__ import annotations

import httpx

from tests.server.conftest import start_daemon, stop_daemon


def test_dummy_model_serves_token_ids_and_refuses_text():
    d = start_daemon("--model", "dummy:tiny", "--num-gpu-blocks", "64")
    try:
        url = d.url + "/v1"
        ok = {"model": "dummy:tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4}
        r = httpx.post(url + "/completions", json=ok, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": 4,
                                     "total_tokens": 8,
                                     "prompt_tokens_details": {"cached_tokens": 0}}
        r = httpx.post(url + "/completions", json={**ok, "prompt": "hello"}, timeout=60)
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "prompt"
        chat = {"model": "dummy:tiny", "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(url + "/chat/completions", json=chat, timeout=60)
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
        r = httpx.post(url + "/completions", json=ok, timeout=60)  # still serving
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        stop_daemon(d)
