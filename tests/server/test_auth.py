"""--api-key / KVSCOPE_API_KEY: /v1/* needs the bearer token (401 otherwise, checked
before anything else); /health and /metrics stay open. In-process app over a simulated
engine: the check happens before a request reaches the engine, which records none."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvscope.engine.cli import build_parser
from tests.server.asgi import InProcess, serve_double
from tests.server.doubles import SimulatedEngine


@pytest.fixture
def keyed() -> Iterator[InProcess]:
    s = serve_double(SimulatedEngine(), api_key="s3cret")
    yield s
    s.close()


@pytest.fixture
def open_server() -> Iterator[InProcess]:
    s = serve_double(SimulatedEngine())
    yield s
    s.close()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": "Basic s3cret"},
                                     {"Authorization": "s3cret"}])
@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/models"),
                                              ("POST", "/v1/completions"),
                                              ("POST", "/v1/chat/completions")])
def test_missing_or_wrong_key_is_401(keyed: InProcess, headers: dict, method: str,
                                     path: str) -> None:
    r = keyed.http.request(method, path, headers=headers, json={"prompt": "x"})
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    assert keyed.state.engine.submitted == []  # nothing reached the engine


def test_right_key_passes_and_open_endpoints(keyed: InProcess, open_server: InProcess) -> None:
    r = keyed.http.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "smollm2"
    assert keyed.http.get("/health").status_code == 200
    assert keyed.http.get("/metrics").status_code == 200
    assert open_server.http.get("/v1/models").status_code == 200  # no key configured


def test_draining_refuses_with_503(open_server: InProcess) -> None:
    open_server.state.draining = True
    r = open_server.http.post("/v1/completions", json={"prompt": [1, 2]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert open_server.http.get("/health").status_code == 503
    assert open_server.state.engine.submitted == []


def test_api_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSCOPE_API_KEY", "from-env")
    args = build_parser().parse_args(["serve"])
    assert args.api_key == "from-env" and args.host == "127.0.0.1"
    args = build_parser().parse_args(["serve", "--api-key", "flag"])
    assert args.api_key == "flag"
    monkeypatch.delenv("KVSCOPE_API_KEY")
    assert build_parser().parse_args(["serve"]).api_key is None
