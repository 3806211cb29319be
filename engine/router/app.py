"""The router's HTTP front (FastAPI): the same OpenAI API as ``kvscope serve``, each
request proxied to the replica the policy picks, with an async HTTP client.

- Bodies and answers pass through unchanged (streams chunk by chunk), so the API, the
  errors and streaming are exactly the replica's.
- A request is retried once on another replica when its replica is lost before the
  client has seen a byte of the answer: the connection is refused, or it drops before
  the whole body (a stream: before its first chunk) came back. Generation has no side
  effects, so the client just gets its answer from the other replica (vLLM-world routers
  such as SGLang's retry the same way). Once only, so a request that itself brought a
  replica down cannot walk through the fleet.
- A request whose replica fails later (a stream that already sent chunks), answers 5xx,
  or times out fails with a clear ``replica_failed`` error (a stream gets an error event,
  then ``[DONE]``); nobody else is affected.
- A replica that drops or refuses a connection leaves the rotation until its /health
  answers 200 again.
- A client that disconnects while its answer is computed gets its replica request closed
  (the replica then aborts it, as for a direct client), not left running for nobody.
- ``/health``: 200 while at least one replica is in rotation, else 503.
- ``/metrics``: see ``engine.router.metrics``; ``/router/replicas``: the same as JSON.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvscope.engine.router import metrics as router_metrics
from kvscope.engine.router.policy import Decision, Policy
from kvscope.engine.router.prompt_tokens import prompt_token_ids
from kvscope.engine.router.replica import Replica

MAX_BODY_BYTES = 4 << 20
DISCONNECT_POLL_S = 0.5  # how often a request waiting on its replica checks its client
FORWARD_HEADERS = ("authorization", "content-type", "accept")


def _error(status: int, message: str, code: str, type_: str = "server_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": None,
                                   "code": code}}, status)


def _sse_error(message: str, code: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


class Router:
    """Replicas, the policy, the tokenizer, the HTTP client and the health loop."""

    def __init__(self, replicas: list[Replica], policy: Policy, tokenizer: Any = None, *,
                 health_interval_s: float = 0.5, request_timeout_s: float = 600.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        # transport: how requests reach the replicas (None: the network); tests hand in
        # a simulated fleet (httpx.MockTransport)
        if not replicas:
            raise ValueError("the router needs at least one replica")
        self.replicas = replicas
        self.policy = policy
        self.tokenizer = tokenizer
        self.health_interval_s = health_interval_s
        self.request_timeout_s = request_timeout_s
        self.decisions: collections.Counter[tuple[str, str]] = collections.Counter()
        self.unroutable = 0
        self.client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task | None = None
        self._transport = transport

    # -------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        for r in self.replicas:
            r.start()
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.request_timeout_s, connect=2.0), limits=limits,
            transport=self._transport)
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.client is not None:
            await self.client.aclose()
        for r in self.replicas:
            r.close()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.check_health()

    async def check_health(self) -> None:
        async def one(r: Replica) -> None:
            try:
                resp = await self.client.get(r.url + "/health", timeout=2.0)
                ok = resp.status_code == 200
                r.health_error = "" if ok else f"/health answered {resp.status_code}"
            except httpx.HTTPError as e:
                ok, r.health_error = False, f"/health: {type(e).__name__}: {e}"
            r.healthy = ok

        await asyncio.gather(*(one(r) for r in self.replicas))

    # ---------------------------------------------------------------- routing
    def choose(self, token_ids: list[int] | None, exclude: Replica | None = None
               ) -> Decision | None:
        pool = [r for r in self.replicas if r is not exclude]
        return self.policy.choose(pool, token_ids)

    def note_usage(self, replica: Replica, predicted: int, usage: Any) -> None:
        """One answer's usage: chat's and completions' names, or the Responses API's."""
        if not isinstance(usage, dict):
            return
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        c = replica.counters
        c.reported += 1
        c.prompt_tokens += int(usage.get("prompt_tokens") or usage.get("input_tokens") or 0)
        c.actual_cached_tokens += int(details.get("cached_tokens") or 0)
        c.predicted_reported += predicted

    def describe(self) -> dict[str, Any]:
        return {"policy": self.policy.name, "unroutable": self.unroutable,
                "replicas": [r.describe() for r in self.replicas]}


def create_app(router: Router) -> FastAPI:
    app = FastAPI(title="kvscope router", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router

    @app.get("/health")
    async def health() -> JSONResponse:
        up = [r.name for r in router.replicas if r.in_rotation]
        return JSONResponse({"status": "ok" if up else "no_replica", "in_rotation": up},
                            200 if up else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router_metrics.render(router),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/router/replicas")
    async def replicas() -> JSONResponse:
        return JSONResponse(router.describe())

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await _forward_simple(router, request, "GET", "/v1/models")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await _forward_simple(router, request, "POST", "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await _forward_simple(router, request, "POST", "/detokenize")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _proxy(router, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _proxy(router, request, "/v1/chat/completions")

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await _proxy(router, request, "/v1/responses")

    return app


def _headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}


async def _forward_simple(router: Router, request: Request, method: str, path: str) -> Response:
    """A request any replica answers alike (the model list, tokenizing): to one in rotation."""
    body = await _read_body(request)
    if body is None:
        return _too_large()
    d = router.choose(None)
    if d is None:
        return _error(503, "no replica is available", "no_replica", "service_unavailable")
    try:
        resp = await router.client.request(method, d.replica.url + path, content=body or None,
                                           headers=_headers(request))
    except httpx.HTTPError as e:
        return _error(502, f"replica {d.replica.name} ({d.replica.url}) failed: {e}",
                      "replica_failed")
    return Response(resp.content, resp.status_code,
                    media_type=resp.headers.get("content-type"))


async def _read_body(request: Request) -> bytes | None:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large() -> JSONResponse:
    return _error(413, f"request body is larger than {MAX_BODY_BYTES} bytes",
                  "request_too_large", "invalid_request_error")


def _wants_stream(body: bytes) -> bool:
    try:
        return json.loads(body).get("stream") is True
    except (ValueError, AttributeError):
        return False


async def _proxy(router: Router, request: Request, path: str) -> Response:
    body = await _read_body(request)
    if body is None:
        return _too_large()
    token_ids = prompt_token_ids(router.tokenizer, path, body)
    stream = _wants_stream(body)
    tried: Replica | None = None
    for attempt in range(2):
        d = router.choose(token_ids, exclude=tried)
        if d is None:
            router.unroutable += 1
            return _error(503, "no replica is available", "no_replica", "service_unavailable")
        r = d.replica
        req = router.client.build_request("POST", r.url + path, content=body,
                                          headers=_headers(request))
        # Open from the moment it is sent: a non-streamed answer's headers come only when
        # it is complete, and the next routing decision must already count it.
        r.in_flight += 1
        resp: httpx.Response | None = None
        first, content = b"", b""
        try:
            resp = await _unless_client_left(request, router.client.send(req, stream=True))
            if stream and resp.status_code == 200:
                chunks = resp.aiter_raw()
                first = await _unless_client_left(request, anext(chunks, b""))
            else:
                content = await _unless_client_left(request, resp.aread())
        except BaseException as e:  # cancelled too: the replica's request must not leak
            r.in_flight -= 1
            if resp is not None:
                await resp.aclose()  # the replica sees its client go and aborts the request
            if isinstance(e, _ClientLeft):
                return Response(status_code=499)  # nobody reads it
            if isinstance(e, httpx.ConnectError):
                r.healthy, r.health_error = False, "connection refused"
                tried = r
                continue  # nothing was sent: safe to try another replica
            if not isinstance(e, httpx.HTTPError):
                raise
            _count(router, d)
            if _dropped(e) and attempt == 0:
                _lost(r, e, retried=True)
                tried = r
                continue
            return _replica_failed(router, r, e)
        _count(router, d)
        if stream and resp.status_code == 200:
            return StreamingResponse(_relay(router, d, resp, first, chunks), status_code=200,
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Kvscope-Replica": r.name})
        r.in_flight -= 1
        await resp.aclose()
        if resp.status_code >= 500:
            r.counters.failed += 1
        elif resp.status_code == 200:
            with contextlib.suppress(ValueError, AttributeError):
                router.note_usage(r, d.predicted_cached_tokens, json.loads(content).get("usage"))
        return Response(content, resp.status_code,
                        media_type=resp.headers.get("content-type"),
                        headers={"X-Kvscope-Replica": r.name})
    router.unroutable += 1
    return _error(503, "no replica is available (connections refused)", "no_replica",
                  "service_unavailable")


class _ClientLeft(Exception):
    """The router's client disconnected while its answer was still being computed."""


async def _unless_client_left(request: Request, awaitable: Any) -> Any:
    """``await awaitable``, checking every ``DISCONNECT_POLL_S`` that the client is still
    there; if it left, cancel it and raise _ClientLeft (the daemon does the same)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected() and not task.done():
                raise _ClientLeft
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def _dropped(e: httpx.HTTPError) -> bool:
    """The replica's connection broke (it died or was killed), as opposed to a timeout or
    a bad answer: the failures after which another replica may safely take the request."""
    return isinstance(e, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError)


def _lost(r: Replica, e: Exception, retried: bool = False) -> None:
    r.counters.failed += 1
    r.counters.retried += retried
    r.healthy, r.health_error = False, f"failed a request: {type(e).__name__}"


def _count(router: Router, d: Decision) -> None:
    d.replica.counters.routed += 1
    router.decisions[(d.replica.name, d.reason)] += 1


def _replica_failed(router: Router, r: Replica, e: Exception) -> JSONResponse:
    _lost(r, e)
    return _error(502, f"replica {r.name} ({r.url}) failed during the request: "
                  f"{type(e).__name__}: {e}", "replica_failed")


def _final_usage(event: dict[str, Any]) -> Any:
    """A stream's closing usage, or None: chat's and completions' usage chunk (no choices:
    with vLLM's continuous_usage_stats every chunk carries the usage so far, and only this
    one is final) or the Responses API's completed/incomplete event."""
    if event.get("type") in ("response.completed", "response.incomplete"):
        return event["response"].get("usage")
    return event.get("usage") if event.get("choices") == [] else None


async def _relay(router: Router, d: Decision, resp: httpx.Response, first: bytes,
                 rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Pass the replica's SSE stream through (``first``, already read, then ``rest``); read
    its usage chunk on the way."""
    r, pending = d.replica, b""
    t0 = time.monotonic()

    async def chunks() -> AsyncIterator[bytes]:
        if first:
            yield first
        async for chunk in rest:
            yield chunk

    try:
        async for chunk in chunks():
            yield chunk
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.startswith(b"data: {") and b'"usage"' in line:
                    with contextlib.suppress(ValueError, AttributeError, TypeError):
                        router.note_usage(r, d.predicted_cached_tokens,
                                          _final_usage(json.loads(line[6:])))
    except httpx.HTTPError as e:
        _lost(r, e)
        yield _sse_error(f"replica {r.name} ({r.url}) failed during the request after "
                         f"{time.monotonic() - t0:.1f} s: {type(e).__name__}: {e}",
                         "replica_failed")
    finally:
        r.in_flight -= 1
        await resp.aclose()
