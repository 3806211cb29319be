"""Lifecycle of a real daemon with events and a recording: a client that disconnects
mid-stream aborts its request and frees its blocks (seen in /metrics and as events in
the recording); SIGTERM drains: new requests get 503, a short in-flight request
finishes, a long one is aborted when a second signal cuts the drain short, the process
exits 0 and the recording is complete and readable.

Nothing here races the clock: the drain window is longer than any test may take, so the
short request finishes by its token count (16 steps beside the long one's 4,000), and the
second signal, sent once it has, decides when the long one ends. The window closing on
requests still running is test_drain.py's (in process, over a simulated engine)."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvscope.engine.events.wire.recording import Recording
from tests.server.conftest import Daemon, start_daemon, stop_daemon
from tests.waiting import HANG_S

CHAT = "/v1/chat/completions"


def _until(condition: Callable[[], bool], what: str) -> None:
    """Wait for something the daemon does (its HTTP answers are the events); HANG_S is a
    hang guard, not a measure of speed."""
    end = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < end, f"{what}: never happened"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory) -> Iterator[Daemon]:
    record = Path(tmp_path_factory.mktemp("rec")) / "run.kvtrace"
    # room for a 4,000-token answer: the drain test's long request must not be able to
    # finish inside the drain window however fast decoding gets (470 tokens once did)
    d = start_daemon("--num-gpu-blocks", "300", "--max-model-len", "4500",
                     "--events", "tcp://127.0.0.1:*", "--drain-timeout", str(HANG_S),
                     record=record)
    yield d
    stop_daemon(d)


def _stream_body(content: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}


def test_client_disconnect_aborts_and_frees_blocks(lifecycle: Daemon) -> None:
    with httpx.stream("POST", lifecycle.url + CHAT, timeout=HANG_S,
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
    running = {"short": threading.Event(), "long": threading.Event()}

    def run(name: str, body: dict) -> None:
        with httpx.stream("POST", lifecycle.url + CHAT, timeout=HANG_S, json=body) as r:
            lines = []
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    running[name].set()  # its first chunk: it is in the engine
            results[name] = lines

    def health() -> httpx.Response:
        return httpx.get(lifecycle.url + "/health", timeout=HANG_S)

    # The short request has 63 more steps to go when its first chunk is read, so the
    # signal below finds it in flight; the long one could not finish in 60 times that.
    short = threading.Thread(target=run, args=("short", _stream_body("Say hi.", 64)))
    long = threading.Thread(target=run, args=("long", _stream_body("Write an essay.", 4000)))
    long.start()
    short.start()
    assert running["long"].wait(HANG_S) and running["short"].wait(HANG_S)
    lifecycle.proc.send_signal(signal.SIGTERM)
    _until(lambda: health().status_code == 503, "the drain began")
    refused = httpx.post(lifecycle.url + CHAT, timeout=HANG_S, json={
        "messages": [{"role": "user", "content": "late"}], "max_tokens": 1})
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "service_unavailable"
    assert health().json() == {"status": "draining"}
    short.join(HANG_S)  # it finishes inside the drain
    assert "short" in results and "long" not in results
    lifecycle.proc.send_signal(signal.SIGTERM)  # the second signal: abort what is left
    assert lifecycle.proc.wait(HANG_S) == 0
    long.join(HANG_S)
    assert "draining 2 in-flight request(s)" in lifecycle.output

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
