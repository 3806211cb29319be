"""Every kind of bad request gets the right status and an OpenAI error body, changes
nothing, and the server keeps serving: a valid request streams throughout the bad ones
and completes, and a valid request after them succeeds (the real engine, in process)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.server.asgi import InProcess
from tests.server.conftest import CAPACITY_TOKENS
from tests.waiting import HANG_S

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
WORDS = " ".join(["memory"] * 2500)  # ~2500 tokens: past max_model_len (2048)
MID = " ".join(["page"] * (CAPACITY_TOKENS + 100))  # fits the context, never the cache

CASES = [
    # (name, path, body (dict or raw bytes), status, param, code)
    ("malformed json", CMPL, b'{"prompt": ', 400, None, "invalid_json"),
    ("not an object", CMPL, b"[1, 2]", 400, None, None),
    ("empty body", CHAT, b"", 400, None, "invalid_json"),
    ("max_tokens string", CMPL, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", None),
    ("max_tokens float", CMPL, {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", None),
    ("messages not list", CHAT, {"messages": "hi"}, 400, "messages", None),
    ("no messages", CHAT, {"messages": []}, 400, "messages", None),
    ("bad role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages",
     None),
    ("missing prompt", CMPL, {"max_tokens": 2}, 400, "prompt", None),
    ("prompt wrong type", CMPL, {"prompt": 3}, 400, "prompt", None),
    ("unknown field", CMPL, {"prompt": "x", "max_token": 2}, 400, "max_token", None),
    ("unsupported tools", CHAT, {"messages": HI, "tools": [{"type": "function"}]}, 400,
     "tools", None),
    ("unknown model", CMPL, {"prompt": "x", "model": "gpt-4"}, 404, "model",
     "model_not_found"),
    ("unknown model chat", CHAT, {"messages": HI, "model": "nope"}, 404, "model",
     "model_not_found"),
    ("prompt over max_model_len", CMPL, {"prompt": WORDS, "max_tokens": 1}, 400, "prompt",
     "context_length_exceeded"),
    ("chat over max_model_len", CHAT, {"messages": [{"role": "user", "content": WORDS}]},
     400, "messages", "context_length_exceeded"),
    ("prompt never fits the cache", CMPL, {"prompt": MID, "max_tokens": 1}, 400, "prompt",
     None),
    ("max_tokens 0", CMPL, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("max_tokens negative", CHAT, {"messages": HI, "max_tokens": -1}, 400, "max_tokens",
     None),
    ("max_tokens absurd", CMPL, {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens",
     "context_length_exceeded"),
    ("n too large", CMPL, {"prompt": "x", "n": 5}, 400, "n", None),
    ("n x prompts too large", CMPL, {"prompt": ["a", "b", "c"], "n": 2}, 400, "n", None),
    ("n zero", CHAT, {"messages": HI, "n": 0}, 400, "n", None),
    ("temperature negative", CMPL, {"prompt": "x", "temperature": -1}, 400, "temperature",
     None),
    ("top_p above 1", CHAT, {"messages": HI, "top_p": 2.0}, 400, "top_p", None),
    ("stop wrong type", CMPL, {"prompt": "x", "stop": 5}, 400, "stop", None),
    ("token id out of vocab", CMPL, {"prompt": [1, 10**9]}, 400, "prompt", None),
    ("empty prompt", CMPL, {"prompt": ""}, 400, "prompt", None),
    ("penalty out of range", CMPL, {"prompt": "x", "presence_penalty": 2.5}, 400,
     "presence_penalty", None),
    ("logit_bias past 100", CHAT, {"messages": HI, "logit_bias": {"1": 500}}, 400,
     "logit_bias", None),
    ("logit_bias key not a token id", CHAT, {"messages": HI, "logit_bias": {"a": 5}}, 400,
     "logit_bias", None),
    ("logit_bias id past the vocabulary", CMPL, {"prompt": "x", "logit_bias": {"99999999": 5}},
     400, "logit_bias", None),
    ("oversized body", CMPL, {"prompt": "x" * 70_000}, 413, None, "request_too_large"),
]


def _check_error(r: httpx.Response, status: int, param: str | None, code: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


@pytest.fixture(scope="module")
def background(served: InProcess):
    """A valid streaming request that runs while the bad ones are sent: its thread and
    what it got."""
    result: dict = {}

    def run() -> None:
        with served.http.stream("POST", CHAT, json={
                "messages": [{"role": "user", "content": "Tell me a story."}],
                "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            result["status"] = r.status_code
            result["lines"] = [line for line in r.iter_lines() if line]

    t = threading.Thread(target=run)
    t.start()
    yield t, result
    t.join(HANG_S)


@pytest.mark.parametrize(("name", "path", "body", "status", "param", "code"), CASES,
                         ids=[c[0] for c in CASES])
def test_bad_request(served: InProcess, background, name: str, path: str, body,
                     status: int, param: str | None, code: str | None) -> None:
    if isinstance(body, bytes):
        r = served.http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = served.http.post(path, json=body)
    _check_error(r, status, param, code)


def test_chunked_body_over_limit_is_413(served: InProcess) -> None:
    def chunks():
        for _ in range(40):
            yield b" " * 4096  # 160 KiB, no Content-Length

    r = served.http.post(CMPL, content=chunks())
    _check_error(r, 413, None, "request_too_large")


def test_wrong_method_and_path(served: InProcess) -> None:
    r = served.http.get(CMPL)
    assert r.status_code == 405 and r.json()["error"]["message"]
    r = served.http.post("/v1/embeddings", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_everyone_else_still_served(served: InProcess, background) -> None:
    """Runs after the bad requests (file order): the background stream finished normally,
    nothing leaked, and a new request succeeds. (/metrics counts a request before its
    client sees it end: no wait is needed once the answers are in.)"""
    thread, result = background
    r = served.http.post(CMPL, json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    thread.join(HANG_S)
    assert result["status"] == 200
    lines = result["lines"]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][6:])["usage"]
    assert usage["completion_tokens"] == 8
    m = served.metrics()
    assert m["kvscope:num_requests_running"] == 0
    assert m["kvscope:kv_cache_usage_perc"] == 0.0  # no refused request holds a block
