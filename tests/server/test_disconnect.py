"""A client that leaves before its answer is done aborts its request in the engine,
streamed or not (jobs.py, sse.py). The app is driven directly, as an ASGI server would:
the client leaves once the simulated engine holds its request, so which comes first is
the test's choice. (The real daemon over TCP, with its blocks freed and recorded:
test_lifecycle.py.)"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.server.asgi import serve_double
from tests.server.doubles import CharTokenizer, SimulatedEngine
from tests.waiting import HANG_S


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_aborts_its_request(stream: bool) -> None:
    engine = SimulatedEngine(["never sent"], hold=True)
    served = serve_double(engine, tokenizer=CharTokenizer())
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                       "stream": stream}).encode()
    asked: list[bool] = []

    async def receive() -> dict:
        if not asked:
            asked.append(True)
            return {"type": "http.request", "body": body, "more_body": False}
        # The client leaves once its request is in the engine. Until then it is there:
        # nothing to receive (Starlette's disconnect check gives up at the first await).
        while engine.num_inflight != 1:
            await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        pass

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "path": "/v1/chat/completions", "raw_path": b"",
             "query_string": b"", "root_path": "", "scheme": "http",
             "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("kvscope", 80)}
    try:
        served.run(asyncio.wait_for(served.app(scope, receive, send), HANG_S))
        engine.wait(lambda e: e.num_inflight == 0)
    finally:
        served.close()
    assert engine.aborts == [(engine.submitted[0].request_id, "client")]
