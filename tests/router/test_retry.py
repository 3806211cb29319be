"""The router retries a request once on another replica when its replica is lost before the
client saw a byte of the answer, and only then. A simulated fleet (httpx.MockTransport
behind the router's client) plays replicas that drop connections at chosen points; the
router's app is called in process."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from kvscope.engine.router.app import Router, create_app
from kvscope.engine.router.policy import Policy
from kvscope.engine.router.replica import Replica
from tests.waiting import HANG_S

ANSWER = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "ok"}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
BODY = {"model": "m", "prompt": "Hello", "max_tokens": 1}


class _Stream(httpx.AsyncByteStream):
    """Yields ``chunks``, then breaks the connection if ``then_drop``."""

    def __init__(self, chunks: list[bytes], then_drop: bool) -> None:
        self.chunks, self.then_drop = chunks, then_drop

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for c in self.chunks:
            yield c
        if self.then_drop:
            raise httpx.RemoteProtocolError("peer closed connection")


def _sse(*objs: object) -> list[bytes]:
    return [f"data: {json.dumps(o)}\n\n".encode() for o in objs] + [b"data: [DONE]\n\n"]


# how each replica answers a completion: "ok", or how it fails
Behaviour = Callable[[httpx.Request], httpx.Response]


def _ok(req: httpx.Request) -> httpx.Response:
    if json.loads(req.content).get("stream"):
        return httpx.Response(200, stream=_Stream(_sse(ANSWER), False),
                              headers={"content-type": "text/event-stream"})
    return httpx.Response(200, json=ANSWER)


def _dies_before_headers(req: httpx.Request) -> httpx.Response:
    raise httpx.RemoteProtocolError("Server disconnected without sending a response.")


def _dies_mid_body(req: httpx.Request) -> httpx.Response:
    return httpx.Response(200, stream=_Stream([b'{"id": "cm'], True),
                          headers={"content-type": "application/json"})


def _dies_before_first_chunk(req: httpx.Request) -> httpx.Response:
    return httpx.Response(200, stream=_Stream([], True),
                          headers={"content-type": "text/event-stream"})


def _dies_after_first_chunk(req: httpx.Request) -> httpx.Response:
    return httpx.Response(200, stream=_Stream(_sse(ANSWER)[:1], True),
                          headers={"content-type": "text/event-stream"})


def _answers_500(req: httpx.Request) -> httpx.Response:
    return httpx.Response(500, json={"error": {"message": "engine failed"}})


def _times_out(req: httpx.Request) -> httpx.Response:
    raise httpx.ReadTimeout("timed out")


def _fleet(*behaviours: Behaviour) -> tuple[Router, list[int]]:
    """A router over replicas r0, r1, ... (round-robin, starting at r0) and the number
    of completion requests each received."""
    replicas = [Replica(f"r{i}", f"http://replica{i}") for i in range(len(behaviours))]
    hits = [0] * len(behaviours)

    def handler(req: httpx.Request) -> httpx.Response:
        i = int(req.url.host.removeprefix("replica"))
        if req.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        hits[i] += 1
        return behaviours[i](req)

    router = Router(replicas, Policy("round-robin"), health_interval_s=3600,
                    transport=httpx.MockTransport(handler))
    return router, hits


def _post(router: Router, body: dict, path: str = "/v1/completions"
          ) -> tuple[httpx.Response, bytes]:
    async def go() -> tuple[httpx.Response, bytes]:
        await router.start()
        try:
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(router)),
                                       base_url="http://router")
            async with client:
                r = await client.post(path, json=body)
                return r, r.content
        finally:
            await router.close()

    return asyncio.run(go())


def test_a_replica_that_dies_before_answering_is_retried_on_another():
    router, hits = _fleet(_dies_before_headers, _ok)
    r, _ = _post(router, BODY)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
    assert r.headers["x-kvscope-replica"] == "r1" and hits == [1, 1]
    r0, r1 = router.replicas
    assert (r0.counters.failed, r0.counters.retried, r0.healthy) == (1, 1, False)
    assert (r1.counters.failed, r1.counters.routed, r1.in_flight) == (0, 1, 0)
    assert r0.in_flight == 0


def test_a_body_cut_short_is_retried():
    router, hits = _fleet(_dies_mid_body, _ok)
    r, _ = _post(router, BODY)
    assert r.status_code == 200 and r.headers["x-kvscope-replica"] == "r1" and hits == [1, 1]
    assert router.replicas[0].counters.retried == 1 and router.replicas[0].in_flight == 0


def test_a_stream_lost_before_its_first_chunk_is_retried():
    router, hits = _fleet(_dies_before_first_chunk, _ok)
    r, content = _post(router, {**BODY, "stream": True})
    assert r.status_code == 200 and hits == [1, 1]
    lines = [ln for ln in content.decode().split("\n") if ln.startswith("data: ")]
    assert json.loads(lines[0][6:])["choices"][0]["text"] == "ok"
    assert lines[-1] == "data: [DONE]" and "error" not in content.decode()
    assert [x.in_flight for x in router.replicas] == [0, 0]


def test_a_stream_lost_after_its_first_chunk_is_not_retried():
    router, hits = _fleet(_dies_after_first_chunk, _ok)
    r, content = _post(router, {**BODY, "stream": True})
    lines = [ln for ln in content.decode().split("\n") if ln.startswith("data: ")]
    assert hits == [1, 0]  # the client already holds a chunk from r0
    assert json.loads(lines[0][6:])["choices"][0]["text"] == "ok"
    assert json.loads(lines[-2][6:])["error"]["code"] == "replica_failed"
    assert lines[-1] == "data: [DONE]"
    assert (router.replicas[0].counters.failed, router.replicas[0].counters.retried) == (1, 0)
    assert router.replicas[0].in_flight == 0


def test_only_one_retry():
    router, hits = _fleet(_dies_before_headers, _dies_before_headers)
    r, _ = _post(router, BODY)
    assert r.status_code == 502 and r.json()["error"]["code"] == "replica_failed"
    assert hits == [1, 1]  # a request that kills replicas does not walk the fleet
    assert [x.counters.retried for x in router.replicas] == [1, 0]
    assert [x.counters.failed for x in router.replicas] == [1, 1]


def test_an_answer_or_a_timeout_is_not_retried():
    for behaviour, status in ((_answers_500, 500), (_times_out, 502)):
        router, hits = _fleet(behaviour, _ok)
        r, _ = _post(router, BODY)
        assert r.status_code == status and hits == [1, 0], behaviour.__name__
        assert router.replicas[0].counters.retried == 0


def test_a_request_cancelled_while_waiting_for_the_first_chunk_is_released():
    """The router holds a stream's answer until its first chunk; if the request is cancelled
    meanwhile (its client left, the router stops), the replica's request is closed and
    the replica's in-flight count comes back down."""
    started, closed = asyncio.Event(), []

    class Hanging(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            started.set()
            await asyncio.Event().wait()  # prefill that never ends
            yield b""

        async def aclose(self) -> None:
            closed.append(True)

    router, _ = _fleet(lambda req: httpx.Response(200, stream=Hanging()))

    async def go() -> None:
        await router.start()
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(router)),
                                   base_url="http://router")
        async with client:
            task = asyncio.create_task(client.post("/v1/completions", json={**BODY,
                                                                             "stream": True}))
            await asyncio.wait_for(started.wait(), HANG_S)
            assert router.replicas[0].in_flight == 1
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await router.close()

    asyncio.run(go())
    assert router.replicas[0].in_flight == 0 and closed == [True]


@pytest.mark.parametrize(("stream", "headers_first"),
                         [(False, False), (False, True), (True, True)])
def test_a_client_that_leaves_releases_its_replica(stream: bool, headers_first: bool,
                                                   monkeypatch) -> None:  # noqa: ANN001
    """A client that disconnects while its answer is computed: the router closes the
    replica's request (the replica then aborts it, as for a direct client) instead of
    waiting for an answer nobody reads. The daemon sends a non-streamed answer's headers
    only when it is complete (headers_first False); a stream's right away. Meanwhile the
    request counts as in flight on its replica."""
    import kvscope.engine.router.app as app_module

    monkeypatch.setattr(app_module, "DISCONNECT_POLL_S", 0.01)
    started, closed = asyncio.Event(), []

    class Hanging(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            started.set()
            await asyncio.Event().wait()  # a long generation
            yield b""

        async def aclose(self) -> None:
            closed.append(True)

    async def answer(req: httpx.Request) -> httpx.Response:
        if headers_first:
            return httpx.Response(200, stream=Hanging())
        started.set()
        try:
            await asyncio.Event().wait()  # the whole answer, headers included, comes later
        except asyncio.CancelledError:
            closed.append(True)
            raise
        raise AssertionError("unreachable")

    router, _ = _fleet(answer)
    app = create_app(router)
    body = json.dumps({**BODY, "stream": stream}).encode()
    received: list[bool] = []

    async def receive() -> dict:
        if not received:
            received.append(True)
            return {"type": "http.request", "body": body, "more_body": False}
        await started.wait()  # the client leaves once the replica is at work
        assert router.replicas[0].in_flight == 1
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        pass

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "path": "/v1/completions", "raw_path": b"",
             "query_string": b"", "root_path": "", "scheme": "http",
             "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("router", 80)}

    async def go() -> None:
        await router.start()
        try:
            await asyncio.wait_for(app(scope, receive, send), HANG_S)
        finally:
            await router.close()

    asyncio.run(go())
    assert closed and router.replicas[0].in_flight == 0


def _streams(*objs: object) -> Behaviour:
    def answer(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=_Stream(_sse(*objs), False),
                              headers={"content-type": "text/event-stream"})
    return answer


def test_a_streams_usage_is_counted_once():
    """With vLLM's continuous_usage_stats (guidellm sends it) every chunk carries the usage
    so far: only the closing usage chunk counts. The Responses API's usage comes in its
    response.completed event."""
    so_far = {"prompt_tokens": 3, "completion_tokens": 1,
              "prompt_tokens_details": {"cached_tokens": 2}}
    router, _ = _fleet(_streams(
        {"choices": [{"index": 0, "text": "o"}], "usage": so_far},
        {"choices": [{"index": 0, "text": "k"}], "usage": {**so_far, "completion_tokens": 2}},
        {"choices": [], "usage": {**so_far, "completion_tokens": 2}}))
    r, _ = _post(router, {**BODY, "stream": True})
    c = router.replicas[0].counters
    assert r.status_code == 200 and (c.reported, c.prompt_tokens, c.actual_cached_tokens) == (
        1, 3, 2)
    usage = {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 4},
             "output_tokens": 1, "total_tokens": 6}
    router, _ = _fleet(_streams(
        {"type": "response.created", "response": {"usage": None}},
        {"type": "response.completed", "response": {"usage": usage}}))
    r, _ = _post(router, {"input": "Hello", "stream": True}, "/v1/responses")
    c = router.replicas[0].counters
    assert r.status_code == 200 and (c.reported, c.prompt_tokens, c.actual_cached_tokens) == (
        1, 5, 4)
