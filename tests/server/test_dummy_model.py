"""Serving a dummy model (random weights, no tokenizer; engine.model.dummy), as the GPU
device runs it (in process, the real engine): token-id prompts work, text and chat are
clear 400s, and the server keeps serving after them."""

from __future__ import annotations

from tests.server.conftest import serve_in_process


def test_dummy_model_serves_token_ids_and_refuses_text():
    served = serve_in_process("--model", "dummy:tiny", "--num-gpu-blocks", "64")
    try:
        http = served.http
        ok = {"model": "dummy:tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4}
        r = http.post("/v1/completions", json=ok)
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": 4,
                                     "total_tokens": 8,
                                     "prompt_tokens_details": {"cached_tokens": 0}}
        r = http.post("/v1/completions", json={**ok, "logprobs": 2})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == 4 and all(t.startswith("token_id:") for t in lp["tokens"])
        r = http.post("/v1/completions", json={**ok, "prompt": "hello"})
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "prompt"
        chat = {"model": "dummy:tiny", "messages": [{"role": "user", "content": "hi"}]}
        r = http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json=ok)  # still serving
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        served.close()
