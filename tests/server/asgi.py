"""The daemon's app in this process, for the tests about requests and their answers: the
app runs on an event loop of its own thread and every HTTP call reaches it through
httpx.ASGITransport, so no port, no subprocess, and the engine behind it is whatever the
test gives (the real one, or a double of tests/server/doubles.py).

``InProcess.http`` is a plain (synchronous) httpx.Client and ``openai()`` the official
client on it, so a test reads as it would against a daemon. Answers arrive whole
(ASGITransport buffers a streamed body): a test about a client leaving mid-stream drives
the app itself (test_disconnect.py) or runs the real daemon.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import httpx
import openai

from kvscope.engine.loadgen.summary import parse_metrics
from kvscope.engine.server.app import create_app
from kvscope.engine.server.state import ServerState
from tests.waiting import HANG_S

BASE = "http://kvscope"
T = TypeVar("T")


class InProcess:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.app = create_app(state)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="asgi",
                                        daemon=True)
        self._thread.start()
        self.http = httpx.Client(transport=_Bridge(self), base_url=BASE, timeout=HANG_S)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the app's event loop; its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(HANG_S)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0,
                             http_client=self.http)

    def metrics(self) -> dict[str, float]:
        r = self.http.get("/metrics")
        r.raise_for_status()
        return parse_metrics(r.text)

    def close(self) -> None:
        """Stop the engine behind the app, then the event loop."""
        self.http.close()
        self.state.engine.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(HANG_S)
        self.loop.close()


class _Bridge(httpx.BaseTransport):
    """A synchronous transport that hands each request to ASGITransport on the app's
    loop. A body the client streams (no Content-Length) reaches the app in its chunks."""

    def __init__(self, server: InProcess) -> None:
        self.server = server
        self.asgi = httpx.ASGITransport(app=server.app)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        chunks = list(request.stream)

        async def call() -> tuple[int, httpx.Headers, bytes]:
            inner = httpx.Request(request.method, request.url, headers=request.headers,
                                  stream=_Chunks(chunks))
            resp = await self.asgi.handle_async_request(inner)
            return resp.status_code, resp.headers, await resp.aread()

        status, headers, content = self.server.run(call())
        return httpx.Response(status, headers=headers, content=content, request=request)


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for c in self.chunks:
            yield c


def serve_double(engine: Any, *, tokenizer: Any = None, max_model_len: int = 2048,
                 vocab_size: int = 49152, **settings: Any) -> InProcess:
    """The app in front of an engine double (tests/server/doubles.py), with these
    ServerSettings."""
    from kvscope.engine.server.metrics import ServerMetrics
    from kvscope.engine.server.state import ServerSettings

    s = ServerSettings(**settings)
    return InProcess(ServerState(engine=engine, metrics=ServerMetrics(s.served_model_name),
                                 settings=s, tokenizer=tokenizer, max_model_len=max_model_len,
                                 vocab_size=vocab_size))
