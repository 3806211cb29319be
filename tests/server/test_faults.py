"""Fault isolation in the daemon (issue 19): limits are checked at the boundary (a 400
naming the field, the server keeps serving: in process); a request that breaks inside
the engine step fails alone; a genuine engine fault makes the daemon exit non-zero after
telling its clients, instead of living on answering 500 (a real daemon with faults
injected)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.server.asgi import InProcess
from tests.server.conftest import SHARED, Daemon, start_daemon, stop_daemon
from tests.server.faulty_serve import KILLER_TOKEN, POISON_SEED
from tests.waiting import HANG_S

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def faulty() -> Daemon:
    d = start_daemon(*SHARED, module="tests.server.faulty_serve")
    yield d
    stop_daemon(d)


@pytest.mark.parametrize(("path", "body", "param"), [
    (CMPL, {"prompt": "x", "max_tokens": 1, "logprobs": 60000}, "logprobs"),
    (CMPL, {"prompt": "x", "max_tokens": 1, "logprobs": 21}, "logprobs"),
    (CMPL, {"prompt": "x", "max_tokens": 1, "prompt_logprobs": 60000}, "prompt_logprobs"),
    (CHAT, {"messages": HI, "max_tokens": 1, "logprobs": True, "top_logprobs": 60000},
     "top_logprobs"),
    (CHAT, {"messages": HI, "max_tokens": 1, "logprobs": True, "top_logprobs": -1},
     "top_logprobs"),
    (CMPL, {"prompt": "x", "max_tokens": 1, "seed": 2**70}, "seed"),
    (CMPL, {"prompt": "x", "max_tokens": 1, "temperature": float("inf")}, "temperature"),
    (CMPL, {"prompt": "x", "max_tokens": 1, "stop_token_ids": [10**9]}, "stop_token_ids"),
    (CMPL, {"prompt": "x", "max_tokens": 1, "top_k": -5}, "top_k"),
    (CMPL, {"prompt": "x", "max_tokens": 2, "min_tokens": -1}, "min_tokens"),
])
def test_limits_are_a_400_naming_the_field(served: InProcess, path, body, param):
    r = served.http.post(path, content=json.dumps(body),
                         headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert served.http.get("/health").json()["status"] == "ok"
    assert served.state.engine.num_inflight == 0  # nothing reached the engine


def test_logprobs_at_the_limit_work(served: InProcess):
    r = served.http.post(CMPL, json={"prompt": "x", "max_tokens": 2, "logprobs": 20})
    assert r.status_code == 200, r.text
    assert all(len(t) == 20 for t in r.json()["choices"][0]["logprobs"]["top_logprobs"])


def test_a_request_failing_in_the_step_fails_alone(faulty: Daemon):
    ok: dict = {}

    def stream() -> None:
        with httpx.stream("POST", faulty.url + CMPL, timeout=HANG_S, json={
                "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True,
                "temperature": 0, "stream": True}) as r:
            ok["status"] = r.status_code
            ok["lines"] = [ln for ln in r.iter_lines() if ln.startswith("data: ")]

    t = threading.Thread(target=stream)
    t.start()
    bad = httpx.post(faulty.url + CMPL, timeout=HANG_S, json={
        "prompt": "Once upon a time", "max_tokens": 8, "seed": POISON_SEED, "n": 2})
    t.join(HANG_S)
    assert bad.status_code == 500
    assert "injected per-request fault" in bad.json()["error"]["message"]
    assert ok["status"] == 200 and ok["lines"][-1] == "data: [DONE]"
    assert not any('"error"' in ln for ln in ok["lines"])
    health = httpx.get(faulty.url + "/health", timeout=HANG_S).json()
    assert health["status"] == "ok"
    m = faulty.wait_metric("kvscope:kv_cache_usage_perc", 0.0)
    assert m["kvscope:kv_cache_usage_perc"] == 0.0  # the failed request's blocks are free
    after = httpx.post(faulty.url + CHAT, json={"messages": HI, "max_tokens": 2}, timeout=HANG_S)
    assert after.status_code == 200


def test_an_engine_fault_exits_non_zero(faulty: Daemon):
    """Runs last in this module: it ends the daemon."""
    r = httpx.post(faulty.url + CMPL, json={"prompt": [1, KILLER_TOKEN, 2], "max_tokens": 2},
                   timeout=HANG_S)
    assert r.status_code == 500
    assert faulty.proc.wait(HANG_S) == 3
    assert "the engine failed" in faulty.output
