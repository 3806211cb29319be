"""The daemon's drain (engine/server/daemon.py ``drain``), in process over a simulated
engine, so that which request finishes and which is cut short is the test's choice, not
the box's speed: new requests get 503 and /health says "draining" at once; a request in
flight runs to its end; what is left when the drain window closes, or when a second
signal comes, is aborted and its client gets an error, streamed or not. (The real daemon's
SIGTERM, exit code and recording: test_lifecycle.py.)"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from collections.abc import Iterator

import pytest

from kvscope.engine.server.daemon import drain
from tests.server.asgi import InProcess, serve_double
from tests.server.doubles import CharTokenizer, SimulatedEngine
from tests.waiting import HANG_S

CHAT = "/v1/chat/completions"


def _body(stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
            "stream": stream}


@pytest.fixture
def held() -> Iterator[InProcess]:
    """A server whose engine answers nothing until the test releases it."""
    s = serve_double(SimulatedEngine(["Hel", "lo"], finish_reason="length", hold=True),
                     tokenizer=CharTokenizer(), drain_timeout_s=HANG_S)
    yield s
    s.close()


def _client(served: InProcess, stream: bool) -> tuple[threading.Thread, dict]:
    """A request on its own thread (it waits for the engine): the thread and its answer."""
    got: dict = {}

    def run() -> None:
        r = served.http.post(CHAT, json=_body(stream))
        got["status"], got["text"] = r.status_code, r.text

    t = threading.Thread(target=run)
    t.start()
    return t, got


def _start_drain(served: InProcess, signals: list[int]) -> asyncio.Future:
    fut = asyncio.run_coroutine_threadsafe(drain(served.state, signals), served.loop)
    # The loop runs its callbacks in order: once this no-op has run, so has the drain's
    # first step (it sets ``draining`` before it first waits).
    served.run(asyncio.sleep(0))
    return fut


def _events(text: str) -> list[str]:
    return [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]


def test_a_request_in_flight_finishes_and_new_ones_are_refused(held: InProcess):
    engine = held.state.engine
    t, got = _client(held, stream=True)
    engine.wait(lambda e: e.num_inflight == 1)
    fut = _start_drain(held, [signal.SIGTERM])
    late = held.http.post(CHAT, json=_body(False))
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
    assert held.http.get("/health").json() == {"status": "draining"}
    assert len(engine.submitted) == 1  # the late request never reached the engine
    assert not fut.done()  # the drain waits for the request in flight
    engine.release(engine.submitted[0].request_id)
    fut.result(HANG_S)
    t.join(HANG_S)
    events = _events(got["text"])
    assert got["status"] == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert engine.aborts == []


@pytest.mark.parametrize("stream", [True, False])
def test_what_is_left_when_the_window_closes_is_aborted(held: InProcess, stream: bool):
    engine = held.state.engine
    held.state.settings.drain_timeout_s = 0.0
    t, got = _client(held, stream)
    engine.wait(lambda e: e.num_inflight == 1)
    _start_drain(held, [signal.SIGTERM]).result(HANG_S)
    t.join(HANG_S)
    assert engine.aborts == [(engine.submitted[0].request_id, "shutdown")]
    if stream:
        events = _events(got["text"])
        assert got["status"] == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "service_unavailable"
    else:
        assert got["status"] == 503
        assert json.loads(got["text"])["error"]["type"] == "service_unavailable"


def test_a_second_signal_cuts_the_drain_short(held: InProcess):
    engine = held.state.engine
    t, got = _client(held, stream=True)
    engine.wait(lambda e: e.num_inflight == 1)
    signals = [signal.SIGTERM]
    fut = _start_drain(held, signals)
    assert not fut.done()
    signals.append(signal.SIGTERM)  # what serve_forever's handler records
    fut.result(HANG_S)
    t.join(HANG_S)
    assert engine.aborts == [(engine.submitted[0].request_id, "shutdown")]
    assert json.loads(_events(got["text"])[-2])["error"]["type"] == "service_unavailable"
