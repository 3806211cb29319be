"""EngineLoop, the server's EngineClient over a real engine's step API, driven here by a
scripted engine (tests/server/doubles.py): every admitted request gets exactly one
terminal delivery; the metrics hooks of a step run before its deliveries (a client that
sees its answer end finds /metrics counting it); an engine fault ends every request in
flight with an error and refuses new ones; the simulated engine keeps the same seam."""

from __future__ import annotations

import queue

import pytest

from kvscope.engine.outputs import RequestOutput
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.server.engine_client import Aborted, EngineClient, EngineUnavailable
from kvscope.engine.server.engine_loop import EngineLoop
from tests.server.doubles import ScriptedLLMEngine, SimulatedEngine
from tests.waiting import HANG_S

PROMPT = {"prompt_token_ids": [1, 2, 3]}


def _terminal(q: queue.Queue) -> list:
    """Deliveries until a terminal one (a finished output or an abort)."""
    got = []
    while True:
        got.append(q.get(timeout=HANG_S))
        if isinstance(got[-1], Aborted) or got[-1].finished:
            return got


def test_both_engine_clients_keep_the_seam():
    assert isinstance(EngineLoop(ScriptedLLMEngine()), EngineClient)
    assert isinstance(SimulatedEngine(), EngineClient)


def test_one_terminal_delivery_after_the_hooks_that_count_it():
    log: list = []
    engine = ScriptedLLMEngine(tokens=3)
    loop = EngineLoop(engine, on_step=lambda e: log.append(("step",)),
                      on_finish=lambda out: log.append(("finish", out.request_id)))
    q: queue.Queue = queue.Queue()

    def deliver(item: object) -> None:  # on the engine thread: the log is in its order
        log.append(("deliver", item.request_id))
        q.put(item)

    loop.start()
    try:
        loop.submit("a", PROMPT, SamplingParams(max_tokens=3), deliver).result(HANG_S)
        got = _terminal(q)
    finally:
        loop.stop()
    assert [len(o.outputs[0].token_ids) for o in got] == [1, 2, 3]
    assert isinstance(got[-1], RequestOutput) and got[-1].finished
    finish = log.index(("finish", "a"))
    last_delivery = max(i for i, e in enumerate(log) if e == ("deliver", "a"))
    assert finish < last_delivery and ("step",) in log[finish:last_delivery]
    assert q.empty() and loop.num_inflight == 0


def test_an_abort_is_one_terminal_delivery():
    engine = ScriptedLLMEngine(tokens=10**9)  # never ends on its own
    loop = EngineLoop(engine)
    q: queue.Queue = queue.Queue()
    loop.start()
    try:
        loop.submit("a", PROMPT, SamplingParams(), q.put).result(HANG_S)
        assert isinstance(q.get(timeout=HANG_S), RequestOutput)  # it is running
        loop.abort("a")
        while not isinstance(item := q.get(timeout=HANG_S), Aborted):
            pass
        assert item == Aborted("a", "client")
        loop.abort("a")  # already ended: nothing more
        loop.abort("never-admitted")
    finally:
        loop.stop()
    assert all(not isinstance(x, Aborted) for x in list(q.queue))
    assert engine.requests == {}


def test_an_engine_fault_ends_every_request_and_refuses_new_ones():
    engine = ScriptedLLMEngine(tokens=10**9)
    loop = EngineLoop(engine)
    q: queue.Queue = queue.Queue()
    engine.fail_step = RuntimeError("kernel error")
    loop.start()
    try:
        loop.submit("a", PROMPT, SamplingParams(), q.put).result(HANG_S)
        assert q.get(timeout=HANG_S) == Aborted("a", "error", "engine step failed: kernel "
                                                               "error")
        assert isinstance(loop.failed, RuntimeError)
        with pytest.raises(EngineUnavailable, match="kernel error"):
            loop.submit("b", PROMPT, SamplingParams(), q.put).result(HANG_S)
    finally:
        loop.stop()
    assert engine.closed


def test_a_refused_request_changes_nothing():
    engine = ScriptedLLMEngine()
    loop = EngineLoop(engine)
    loop.start()
    try:
        with pytest.raises(ValueError, match="empty"):
            loop.submit("a", {"prompt_token_ids": []}, SamplingParams(),
                        lambda item: None).result(HANG_S)
    finally:
        loop.stop()
    assert loop.num_inflight == 0 and engine.requests == {}
