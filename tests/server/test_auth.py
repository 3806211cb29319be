"""--api-key / KVSCOPE_API_KEY: /v1/* needs the bearer token (401 otherwise, checked
before anything else); /health and /metrics stay open. In-process app, no model: the
check happens before a request reaches the engine."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from engine.cli import build_parser
from engine.server.app import ServerSettings, ServerState, create_app
from engine.server.metrics import ServerMetrics


class _IdleLoop:
    """Stands in for EngineLoop: alive, nothing in flight; never given a request here."""

    failed = None
    alive = True
    num_inflight = 0

    def submit(self, *a, **k):  # pragma: no cover - must never be reached
        raise AssertionError("an unauthorized request reached the engine")


def _state(key: str | None) -> ServerState:
    return ServerState(loop=_IdleLoop(), metrics=ServerMetrics("smollm2"),
                       settings=ServerSettings(api_key=key), tokenizer=None,
                       max_model_len=2048, vocab_size=49152)


def _get(state: ServerState, method: str, path: str, **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": "Basic s3cret"},
                                     {"Authorization": "s3cret"}])
@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/models"),
                                              ("POST", "/v1/completions"),
                                              ("POST", "/v1/chat/completions")])
def test_missing_or_wrong_key_is_401(headers: dict, method: str, path: str) -> None:
    r = _get(_state("s3cret"), method, path, headers=headers, json={"prompt": "x"})
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"


def test_right_key_passes_and_open_endpoints() -> None:
    state = _state("s3cret")
    r = _get(state, "GET", "/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "smollm2"
    assert _get(state, "GET", "/health").status_code == 200
    assert _get(state, "GET", "/metrics").status_code == 200
    assert _get(_state(None), "GET", "/v1/models").status_code == 200  # no key configured


def test_draining_refuses_with_503() -> None:
    state = _state(None)
    state.draining = True
    r = _get(state, "POST", "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert _get(state, "GET", "/health").status_code == 503


def test_api_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSCOPE_API_KEY", "from-env")
    args = build_parser().parse_args(["serve"])
    assert args.api_key == "from-env" and args.host == "127.0.0.1"
    args = build_parser().parse_args(["serve", "--api-key", "flag"])
    assert args.api_key == "flag"
    monkeypatch.delenv("KVSCOPE_API_KEY")
    assert build_parser().parse_args(["serve"]).api_key is None
