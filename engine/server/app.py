"""The daemon's HTTP API (FastAPI): OpenAI-compatible completions, chat and responses,
vLLM's tokenize, models, health and Prometheus metrics (routes/, one module per family),
in front of one ``EngineClient``.

Every handler only validates, tokenizes and talks to the engine through its
``EngineClient`` (engine_client.py); outputs come back on a per-request asyncio queue
(jobs.py). Errors are OpenAI-shaped (``APIError``); a refused request changes nothing in
the engine.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvscope.engine.server.errors import APIError
from kvscope.engine.server.openapi import install as install_openapi
from kvscope.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeCompletionRequest,
)
from kvscope.engine.server.responses_protocol import ResponsesRequest
from kvscope.engine.server.routes import chat, completions, meta, responses, tokenize
from kvscope.engine.server.state import ServerState


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="kvscope", docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.kv = state
    app.add_middleware(_Answering, state=state)
    for family in (meta, completions, chat, responses, tokenize):
        app.include_router(family.router)
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, ResponsesRequest,
                          TokenizeCompletionRequest, DetokenizeRequest])

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                       type=kind)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    return app


class _Answering:
    """Counts the HTTP requests being answered (``ServerState.answering``), from their
    arrival until their answer, streamed or not, is sent: what the daemon waits for before
    it closes the server, so that every handler of an aborted request has told its client
    (daemon.py)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.state.answering += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.answering -= 1
