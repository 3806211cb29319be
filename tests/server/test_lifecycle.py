"""Lifecycle of a real daemon with events and a recording: a client that disconnects
mid-stream aborts its request and frees its blocks (seen in /metrics and as events in
the recording); SIGTERM drains: new requests get 503, a short in-flight request
finishes, a long one is aborted at the drain timeout, the process exits 0 and the
recording is complete and readable."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.events.wire.recording import Recording
from tests.server.conftest import Daemon, start_daemon, stop_daemon

CHAT = "/v1/chat/completions"
DRAIN_S = 6


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory) -> Iterator[Daemon]:
    record = Path(tmp_path_factory.mktemp("rec")) / "run.kvtrace"
    # room for a 4,000-token answer: the drain test's long request must not be able to
    # finish inside the drain window however fast decoding gets (470 tokens once did)
    d = start_daemon("--num-gpu-blocks", "300", "--max-model-len", "4500",
                     "--events", "tcp://127.0.0.1:*", "--drain-timeout", str(DRAIN_S),
                     record=record)
    yield d
    stop_daemon(d)


def _stream_body(content: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}


def test_client_disconnect_aborts_and_frees_blocks(lifecycle: Daemon) -> None:
    with httpx.stream("POST", lifecycle.url + CHAT, timeout=120,
                      json=_stream_body("Tell me a very long story.", 400)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and \
                    '"content":""' not in line:
                break  # a real token arrived: the request holds blocks now
    # Leaving the `with` closed the connection mid-stream.
    m = lifecycle.wait_metric("kvscope:request_aborted_total", 1.0)
    assert m["kvscope:request_aborted_total"] == 1.0
    m = lifecycle.wait_metric("kvscope:kv_cache_usage_perc", 0.0)
    assert m["kvscope:kv_cache_usage_perc"] == 0.0
    assert m["kvscope:num_requests_running"] == 0
    assert m.get("kvscope:request_success_total", 0.0) == 0.0


def test_sigterm_drains_and_recording_is_complete(lifecycle: Daemon) -> None:
    results: dict[str, list[str]] = {}

    def run(name: str, body: dict) -> None:
        with httpx.stream("POST", lifecycle.url + CHAT, timeout=120, json=body) as r:
            results[name] = [line for line in r.iter_lines() if line]

    # 16 tokens: long enough that the poll below sees both requests in flight (with 2 the
    # short one could finish between two polls once decode got faster), short enough to
    # finish inside the drain window.
    short = threading.Thread(target=run, args=("short", _stream_body("Say hi.", 16)))
    long = threading.Thread(target=run, args=("long", _stream_body("Write an essay.", 4000)))
    long.start()
    short.start()
    end = time.monotonic() + 120
    while httpx.get(lifecycle.url + "/health").json().get("in_flight", 0) < 2:
        assert time.monotonic() < end, "the two requests never arrived"
        time.sleep(0.05)
    t_signal = time.monotonic()
    lifecycle.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    refused = httpx.post(lifecycle.url + CHAT, timeout=10, json={
        "messages": [{"role": "user", "content": "late"}], "max_tokens": 1})
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(lifecycle.url + "/health").status_code == 503
    assert lifecycle.proc.wait(DRAIN_S + 60) == 0
    assert time.monotonic() - t_signal < DRAIN_S + 30
    short.join(30)
    long.join(30)

    # The short request finished normally; the long one got an error event, then [DONE].
    short_chunks = [json.loads(x[6:]) for x in results["short"][:-1]]
    assert results["short"][-1] == "data: [DONE]"
    assert short_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert results["long"][-1] == "data: [DONE]"
    assert "error" in json.loads(results["long"][-2][6:])
    assert "stopped; recording written" in lifecycle.output

    # The recording is complete (indexed, no warning) and ends with an empty cache; the
    # disconnected and the drained requests both finished with reason "abort".
    rec = Recording(lifecycle.record)
    assert rec.steps and not rec.truncated
    final = rec.state_at(rec.steps[-1]).canonical()
    assert final["seqs"] == {}
    assert all(r == 0 for r in final["tiers"]["gpu"]["ref"])
    reasons = [e["reason"] for b in rec for e in b["events"] if e["kind"] == "seq_finish"]
    assert reasons.count("abort") == 2 and reasons.count("length") == 1
    rec.close()
